"""Sans-I/O encoding of wire messages: one message <-> one frame of bytes.

Frame layout (all integers little-endian):

    offset 0   magic b"DSKF"
    offset 4   u16 protocol version
    offset 6   u32 header length L (counts trailing spaces that pad the header to 8-byte alignment)
    offset 10  L bytes of UTF-8 JSON: {"type": NAME, "fields": {...}, "tensors": [{"dtype", "shape"}]}
    then       each tensor's raw C-order little-endian bytes, each starting at an 8-aligned offset,
               zero padding in between, nothing after the last one.

In "fields", a tensor or bytes field holds the index of its entry in "tensors"; every entry is used
exactly once. The caller hands `decode` one complete frame (a websocket message) and gets a message or
ProtocolError; nothing else escapes, and no length is used before it is checked against Limits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import types
import typing
from dataclasses import dataclass
from enum import Enum
from functools import cache

import numpy as np

from deskfleet.common.wire_messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message
from deskfleet.common.wire_tensors import WIRE_DTYPES, ProtocolError, Tensor, wire_dtype_name

MAGIC = b"DSKF"
_PREFIX = struct.Struct("<4sHI")
_ALIGN = 8
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_MESSAGE_BY_NAME = {cls.__name__: cls for cls in MESSAGE_TYPES}


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts. Set the websocket's max message size to max_frame_bytes."""

    max_header_bytes: int = 256 * 1024
    max_tensors: int = 8
    max_tensor_bytes: int = 256 * 1024 * 1024
    max_frame_bytes: int = 320 * 1024 * 1024
    max_rank: int = 4


DEFAULT_LIMITS = Limits()


# Public functions

def encode(message: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Encode `message` as one frame; ProtocolError if it breaks `limits` (the receiver would refuse)."""
    name = type(message).__name__
    if _MESSAGE_BY_NAME.get(name) is not type(message):
        raise ProtocolError(f"{name} is not a wire message type")
    arrays: list[Tensor] = []
    fields = _fields_to_json(type(message), message, name, arrays)
    descriptors = [{"dtype": wire_dtype_name(a), "shape": list(a.shape)} for a in arrays]
    header = json.dumps({"type": name, "fields": fields, "tensors": descriptors},
                        separators=(",", ":"), sort_keys=True, allow_nan=False).encode("utf-8")
    header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)
    _check_counts(len(header), len(arrays), limits)
    parts: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(header)), header]
    offset = _PREFIX.size + len(header)
    for index, array in enumerate(arrays):
        _check_shape(index, list(array.shape), limits)
        little = np.ascontiguousarray(array, dtype=WIRE_DTYPES[wire_dtype_name(array)])
        if little.nbytes > limits.max_tensor_bytes:
            raise ProtocolError(f"tensor {index} has {little.nbytes} bytes, limit {limits.max_tensor_bytes}")
        padding = -offset % _ALIGN
        parts += [bytes(padding), little.reshape(-1).data.cast("B")]
        offset += padding + little.nbytes
    if offset > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {offset} bytes exceeds limit {limits.max_frame_bytes}")
    return b"".join(parts)


def decode(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode one complete frame. Raises ProtocolError, and only that, for any bad input.

    Tensors in the result are read-only views over `frame`: keep `frame` unchanged while they live,
    and copy a tensor before writing to it.
    """
    view = memoryview(frame).cast("B")
    if len(view) > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {len(view)} bytes exceeds limit {limits.max_frame_bytes}")
    if len(view) < _PREFIX.size:
        raise ProtocolError(f"frame of {len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError(f"frame magic is {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"frame protocol version {version} is not supported (this side speaks "
                            f"{PROTOCOL_VERSION})")
    _check_counts(header_length, 0, limits)
    header_end = _PREFIX.size + header_length
    if header_end > len(view):
        raise ProtocolError(f"header length {header_length} runs past the frame end ({len(view)} bytes)")
    header = _parse_header(bytes(view[_PREFIX.size:header_end]))
    arrays = _read_tensors(view, header_end, header["tensors"], limits)
    name = header["type"]
    if not isinstance(name, str) or name not in _MESSAGE_BY_NAME:
        raise ProtocolError(f"header type {name!r} is not a known message type")
    used: set[int] = set()
    message = _fields_from_json(_MESSAGE_BY_NAME[name], header["fields"], name, arrays, used)
    if len(used) != len(arrays):
        raise ProtocolError(f"{name}: tensors {sorted(set(range(len(arrays))) - used)} are not referenced")
    return typing.cast(Message, message)


def peek_version(frame: bytes | bytearray | memoryview,
                 limits: Limits = DEFAULT_LIMITS) -> tuple[int, str | None] | None:
    """(the protocol version a deskfleet frame of any version says it is, the software version its Hello names or
    None), or None for a frame that is not a deskfleet frame. Read at the Hello only, so that a peer of another
    version is told apart from a malformed one: `decode` refuses any frame of another version, its Hello too, and
    a fleet that is being upgraded PC by PC meets them (the message must say which side to upgrade). Best effort:
    a Hello whose header this version cannot read gives None for the software version; nothing raises."""
    view = memoryview(frame).cast("B")
    if len(view) < _PREFIX.size:
        return None
    magic, version, header_length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        return None
    software: str | None = None
    if header_length <= min(limits.max_header_bytes, len(view) - _PREFIX.size):
        try:
            header = json.loads(bytes(view[_PREFIX.size:_PREFIX.size + header_length]).decode("utf-8"))
            fields = header.get("fields") if isinstance(header, dict) and header.get("type") == "Hello" else None
            value = fields.get("software_version") if isinstance(fields, dict) else None
            if isinstance(value, str) and value.isprintable():
                software = value[:40]
        except (ValueError, RecursionError):
            pass
    return int(version), software


def same_message(first: object, second: object) -> bool:
    """Field-by-field equality that compares tensors by wire dtype, shape and the bytes they travel as
    (a NaN equals itself, as a round trip keeps it; -0.0 differs from 0.0)."""
    if type(first) is not type(second):
        return False
    if isinstance(first, np.ndarray) and isinstance(second, np.ndarray):
        return _same_tensor(first, second)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return all(same_message(getattr(first, f.name), getattr(second, f.name))
                   for f in dataclasses.fields(first))
    if isinstance(first, tuple) and isinstance(second, tuple):
        return len(first) == len(second) and all(map(same_message, first, second))
    return first == second


# Private functions: framing

def _same_tensor(first: Tensor, second: Tensor) -> bool:
    name = wire_dtype_name(first)
    if name != wire_dtype_name(second) or first.shape != second.shape:
        return False
    dtype = WIRE_DTYPES[name]
    return np.ascontiguousarray(first, dtype=dtype).tobytes() == np.ascontiguousarray(second, dtype=dtype).tobytes()


def _check_counts(header_length: int, tensor_count: int, limits: Limits) -> None:
    if header_length > limits.max_header_bytes:
        raise ProtocolError(f"header of {header_length} bytes exceeds limit {limits.max_header_bytes}")
    if tensor_count > limits.max_tensors:
        raise ProtocolError(f"{tensor_count} tensors exceed limit {limits.max_tensors}")


def _check_shape(index: int, shape: object, limits: Limits) -> list[int]:
    if not isinstance(shape, list) or len(shape) > limits.max_rank:
        raise ProtocolError(f"tensor {index} shape must be a list of at most {limits.max_rank} dims")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= limits.max_tensor_bytes:
            raise ProtocolError(f"tensor {index} shape {shape} has a bad dim {dim!r}")
    return shape


def _reject_constant(token: str) -> object:
    raise ProtocolError(f"header contains {token}, which JSON does not allow")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ProtocolError("header repeats a key in one object")
    return result


def _parse_header(raw: bytes) -> dict[str, object]:
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant,
                            object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as error:  # bad UTF-8, bad JSON, ints past 4300 digits
        if isinstance(error, ProtocolError):
            raise
        raise ProtocolError(f"header is not valid JSON: {error}") from None
    if not isinstance(header, dict) or set(header) != {"type", "fields", "tensors"}:
        raise ProtocolError("header must be an object with exactly type, fields and tensors")
    return header


def _read_tensors(view: memoryview, offset: int, descriptors: object, limits: Limits) -> list[Tensor]:
    if not isinstance(descriptors, list):
        raise ProtocolError("header tensors must be a list")
    _check_counts(0, len(descriptors), limits)
    arrays: list[Tensor] = []
    for index, descriptor in enumerate(descriptors):
        if not isinstance(descriptor, dict) or set(descriptor) != {"dtype", "shape"}:
            raise ProtocolError(f"tensor {index} descriptor must have exactly dtype and shape")
        dtype_name = descriptor["dtype"]
        if not isinstance(dtype_name, str) or dtype_name not in WIRE_DTYPES:
            raise ProtocolError(f"tensor {index} dtype {dtype_name!r} is not one of {list(WIRE_DTYPES)}")
        dtype = WIRE_DTYPES[dtype_name]
        shape = _check_shape(index, descriptor["shape"], limits)
        count = math.prod(shape)
        size = count * dtype.itemsize
        if size > limits.max_tensor_bytes:
            raise ProtocolError(f"tensor {index} has {size} bytes, limit {limits.max_tensor_bytes}")
        start = offset + (-offset % _ALIGN)
        if start + size > len(view):
            raise ProtocolError(f"tensor {index} ({size} bytes) runs past the frame end: frame truncated")
        if any(view[offset:start]):
            raise ProtocolError(f"padding before tensor {index} is not zero")
        array = np.frombuffer(view, dtype=dtype, count=count, offset=start).reshape(shape)
        if dtype_name == "bool" and count and int(array.view(np.uint8).max()) > 1:
            raise ProtocolError(f"tensor {index} is bool but holds bytes other than 0 and 1")
        arrays.append(array)
        offset = start + size
    if offset != len(view):
        raise ProtocolError(f"frame has {len(view) - offset} bytes after its last part")
    return arrays


# Private functions: fields <-> JSON, driven by the dataclass annotations

# The helpers below read annotations; they are cached because every message of a type asks the same
# questions (uncached, reading annotations was most of the 80 us a Forward took to encode or decode).

@cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@cache
def _origin_and_args(annotation: object) -> tuple[object, tuple[object, ...]]:
    return typing.get_origin(annotation), typing.get_args(annotation)


@cache
def _is_tensor(annotation: object) -> bool:
    """np.ndarray[...] however it is spelled: numpy < 2.5 makes npt.NDArray[X] an alias whose origin is
    np.ndarray; numpy 2.5 makes NDArray a `type` alias (TypeAliasType), whose __value__ holds np.ndarray."""
    origin = typing.get_origin(annotation)
    if origin is np.ndarray:
        return True
    value = getattr(origin, "__value__", None)
    return value is not None and (value is np.ndarray or typing.get_origin(value) is np.ndarray)


@cache
def _union_members(annotation: object) -> tuple[object, ...] | None:
    """For `X | Y | None` return (X, Y, NoneType); for anything that is not a union None."""
    origin, arguments = _origin_and_args(annotation)
    return arguments if origin in (typing.Union, types.UnionType) else None


@cache
def _non_none_members(members: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(member for member in members if member is not type(None))


@cache
def _kind(annotation: object) -> str:
    """What an annotation asks for: union, tuple, int_tuple (tuple[int, ...]), tensor, bytes, enum,
    dataclass, float, int, str, bool, or unknown."""
    if _union_members(annotation) is not None:
        return "union"
    origin, arguments = _origin_and_args(annotation)
    if origin is tuple:
        return "int_tuple" if arguments == (int, Ellipsis) else "tuple"
    if _is_tensor(annotation):
        return "tensor"
    if not isinstance(annotation, type):
        return "unknown"
    if annotation in (bytes, float, int, str, bool):
        return annotation.__name__
    if issubclass(annotation, Enum):
        return "enum"
    return "dataclass" if dataclasses.is_dataclass(annotation) else "unknown"


def _int64(value: object) -> bool:
    return type(value) is int and _INT64_MIN <= value <= _INT64_MAX


def _union_member(members: tuple[object, ...], kind: object, path: str) -> type:
    """The dataclass member of a tagged union named `kind`."""
    for member in members:
        if isinstance(member, type) and member.__name__ == kind and dataclasses.is_dataclass(member):
            return member
    names = [m.__name__ for m in members if isinstance(m, type) and m is not type(None)]
    raise ProtocolError(f"{path} kind {kind!r} is not one of {names}")


def _tuple_elements(arguments: tuple[object, ...], length: int, path: str) -> tuple[object, ...]:
    """Element annotations for a tuple of `length` items: tuple[X, ...] or a fixed tuple[X, Y]."""
    if len(arguments) == 2 and arguments[1] is Ellipsis:
        return (arguments[0],) * length
    if len(arguments) != length:
        raise ProtocolError(f"{path} must hold exactly {len(arguments)} items, got {length}")
    return arguments


def _fields_to_json(cls: type, value: object, path: str, arrays: list[Tensor]) -> dict[str, object]:
    hints = _hints(cls)
    return {name: _to_json(hints[name], getattr(value, name), f"{path}.{name}", arrays)
            for name in _field_names(cls)}


def _to_json(annotation: object, value: object, path: str, arrays: list[Tensor]) -> object:
    kind = _kind(annotation)
    if kind == "union":
        members = _union_members(annotation)
        assert members is not None
        if value is None and type(None) in members:
            return None
        others = _non_none_members(members)
        if len(others) == 1:
            return _to_json(others[0], value, path, arrays)
        member = _union_member(members, type(value).__name__, path)
        return {"kind": member.__name__, "fields": _to_json(member, value, path, arrays)}
    if kind == "int_tuple" and isinstance(value, tuple) and all(type(item) is int for item in value):
        return list(value)
    if kind in ("tuple", "int_tuple") and isinstance(value, tuple):
        elements = _tuple_elements(_origin_and_args(annotation)[1], len(value), path)
        return [_to_json(element, item, f"{path}[{i}]", arrays)
                for i, (element, item) in enumerate(zip(elements, value, strict=True))]
    if kind == "tensor" and isinstance(value, np.ndarray):
        arrays.append(value)
        return len(arrays) - 1
    if kind == "bytes" and isinstance(value, bytes):
        arrays.append(np.frombuffer(value, dtype=np.uint8))
        return len(arrays) - 1
    if kind == "enum" and isinstance(value, typing.cast(type, annotation)):
        return typing.cast(Enum, value).value
    if kind == "dataclass" and isinstance(value, typing.cast(type, annotation)):
        return _fields_to_json(typing.cast(type, annotation), value, path, arrays)
    if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ProtocolError(f"{path} must be finite, got {value}")
        return float(value)
    if kind == "str" and type(value) is str:
        return _text(value, path)
    if kind in ("int", "bool") and type(value) is annotation:
        return value
    raise ProtocolError(f"{path} does not hold a {annotation}: {type(value).__name__}")


def _text(value: str, path: str) -> str:
    """`value` when it is text UTF-8 can carry; a lone surrogate (os.fsdecode of a file name that is not
    UTF-8 makes them) is refused on both sides."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(f"{path} holds a lone surrogate, not text") from None
    return value


def _fields_from_json(cls: type, value: object, path: str, arrays: list[Tensor],
                      used: set[int]) -> object:
    if not isinstance(value, dict):
        raise ProtocolError(f"{path} must be an object")
    names = _field_names(cls)
    if value.keys() != set(names):
        missing, extra = sorted(set(names) - set(value)), sorted(set(value) - set(names))
        raise ProtocolError(f"{path}: missing fields {missing}, unknown fields {extra}")
    hints = _hints(cls)
    arguments = {name: _from_json(hints[name], value[name], f"{path}.{name}", arrays, used)
                 for name in names}
    return cls(**arguments)


def _take_array(value: object, path: str, arrays: list[Tensor], used: set[int]) -> Tensor:
    if type(value) is not int or not 0 <= value < len(arrays):
        raise ProtocolError(f"{path} must be a tensor index below {len(arrays)}, got {value!r}")
    if value in used:
        raise ProtocolError(f"{path} reuses tensor {value}")
    used.add(value)
    return arrays[value]


def _from_json(annotation: object, value: object, path: str, arrays: list[Tensor],
               used: set[int]) -> object:
    kind = _kind(annotation)
    if kind == "union":
        members = _union_members(annotation)
        assert members is not None
        if value is None and type(None) in members:
            return None
        others = _non_none_members(members)
        if len(others) == 1:
            return _from_json(others[0], value, path, arrays, used)
        if not isinstance(value, dict) or set(value) != {"kind", "fields"}:
            raise ProtocolError(f"{path} must be an object with exactly kind and fields")
        member = _union_member(members, value["kind"], path)
        return _fields_from_json(member, value["fields"], f"{path}<{member.__name__}>", arrays, used)
    if kind in ("tuple", "int_tuple"):
        if not isinstance(value, list):
            raise ProtocolError(f"{path} must be a list")
        if kind == "int_tuple" and all(_int64(item) for item in value):
            return tuple(value)
        elements = _tuple_elements(_origin_and_args(annotation)[1], len(value), path)
        return tuple(_from_json(element, item, f"{path}[{i}]", arrays, used)
                     for i, (element, item) in enumerate(zip(elements, value, strict=True)))
    if kind == "tensor":
        return _take_array(value, path, arrays, used)
    if kind == "bytes":
        array = _take_array(value, path, arrays, used)
        if array.dtype != np.uint8 or array.ndim != 1:
            raise ProtocolError(f"{path} must be a 1-D uint8 tensor")
        return array.tobytes()
    if kind == "unknown" or not isinstance(annotation, type):
        raise ProtocolError(f"{path} has an annotation the codec cannot read")
    if kind == "enum":
        allowed = [member.value for member in typing.cast(type[Enum], annotation)]
        if value not in allowed:
            raise ProtocolError(f"{path} is {value!r}, expected one of {allowed}")
        return annotation(value)
    if kind == "dataclass":
        return _fields_from_json(annotation, value, path, arrays, used)
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and type(value) is int:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ProtocolError(f"{path} is outside the int64 range")
        return value
    if annotation is float and type(value) in (int, float):
        number = typing.cast(float, value)
        if type(value) is int and not _INT64_MIN <= number <= _INT64_MAX:
            raise ProtocolError(f"{path} is outside the int64 range")
        if not math.isfinite(number):
            raise ProtocolError(f"{path} must be finite, got {number}")
        return float(number)
    if annotation is str and isinstance(value, str):
        return _text(value, path)
    raise ProtocolError(f"{path} must be {annotation.__name__}, got {type(value).__name__}")
