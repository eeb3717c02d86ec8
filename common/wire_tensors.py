"""Tensors on the wire: the dtype whitelist, the one protocol exception, and shape checks.

A stage states what it expects as a TensorSpec (allowed dtypes and named dims such as
("B", "T", 4096)); `check_tensor` compares a received array with it and binds the named dims, so
the caller can check that B and T agree across the tensors of one message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Tensor = npt.NDArray[np.generic]

# Wire name -> little-endian numpy dtype. Nothing outside this table is ever decoded.
WIRE_DTYPES: dict[str, np.dtype[np.generic]] = {
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
MAX_RANK = 4


PROTOCOL_ERROR_MAX_CHARS = 500  # a ProtocolError's text at most: it quotes what a peer sent


class ProtocolError(ValueError):
    """A frame or message broke the protocol; the message names the field and what was wrong.

    The receiver must drop the message (and usually answer Error(BAD_MESSAGE) and close); nothing in
    a frame that raised this has been acted on. The text is cut to PROTOCOL_ERROR_MAX_CHARS: it quotes what the
    peer sent (field names, types), and a stranger's join with a field name of 60,000 characters wrote that much
    to the controller's log a try.
    """

    def __init__(self, message: str = "") -> None:
        if len(message) > PROTOCOL_ERROR_MAX_CHARS:
            message = f"{message[:PROTOCOL_ERROR_MAX_CHARS - 3]}..."
        super().__init__(message)


# Public functions

def wire_dtype_name(array: Tensor) -> str:
    """The wire name of `array`'s dtype, whatever its byte order; ProtocolError if not whitelisted."""
    for name, dtype in WIRE_DTYPES.items():
        if array.dtype.kind == dtype.kind and array.dtype.itemsize == dtype.itemsize:
            return name
    raise ProtocolError(f"dtype {array.dtype} is not one of {', '.join(WIRE_DTYPES)}")


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects: allowed wire dtype names and one entry per dim.

    A dim is an int (exact size) or a name; the same name must have the same size everywhere it is
    bound, within one `check_tensor` call and across calls that share a bindings mapping.
    """

    dtypes: tuple[str, ...]
    dims: tuple[str | int, ...]

    def __post_init__(self) -> None:
        unknown = [name for name in self.dtypes if name not in WIRE_DTYPES]
        if unknown or not self.dtypes:
            raise ValueError(f"TensorSpec dtypes must be among {list(WIRE_DTYPES)}, got {self.dtypes}")
        if len(self.dims) > MAX_RANK:
            raise ValueError(f"TensorSpec rank {len(self.dims)} exceeds {MAX_RANK}")


def check_tensor(name: str, array: object, spec: TensorSpec,
                 bound: Mapping[str, int] | None = None) -> dict[str, int]:
    """Check `array` against `spec`; return the named dims bound so far (`bound` plus new ones).

    Raises ProtocolError naming `name` and the first mismatch (type, dtype, rank or a dim size).
    """
    if not isinstance(array, np.ndarray):
        raise ProtocolError(f"{name} must be a tensor, got {type(array).__name__}")
    dtype_name = wire_dtype_name(array)
    if dtype_name not in spec.dtypes:
        raise ProtocolError(f"{name} has dtype {dtype_name}, expected {' or '.join(spec.dtypes)}")
    if array.ndim != len(spec.dims):
        raise ProtocolError(f"{name} has shape {list(array.shape)}, expected rank {len(spec.dims)} "
                            f"{list(spec.dims)}")
    sizes = dict(bound or {})
    for axis, (dim, size) in enumerate(zip(spec.dims, array.shape, strict=True)):
        if isinstance(dim, int):
            expected = dim
        elif dim in sizes:
            expected = sizes[dim]
        else:
            sizes[dim] = size
            continue
        if size != expected:
            raise ProtocolError(f"{name} dim {axis} ({dim}) is {size}, expected {expected} "
                                f"(shape {list(array.shape)})")
    return sizes
