"""Lazy access to a checkpoint's safetensors weights, one tensor at a time, and the check that they are the
tensors its config describes.

Export walks the model layer by layer, so a 70B checkpoint never needs to fit in memory at once; the check
reads only the files' headers (and, for a tied model that stores an lm_head.weight too, that tensor and the
embedding), so a checkpoint that cannot be exported is refused before any work.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path, PurePath
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from deskfleet.common.console import ctrl_c_held
from deskfleet.common.json_file import JsonFileError, read_json_object

from .hf_config import CheckpointConfig, not_a_file

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors dtypes of an unquantized checkpoint (read as float32: exactly, f64 rounded); anything else (int8,
# fp8, bool) is quantized or not a weight
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
PROBLEMS_SHOWN = 5
COMPARE_BLOCK_BYTES = 64 << 20  # rows of two tensors compared at a time, as float32


class MalformedCheckpointError(ValueError):
    """The checkpoint's weight files do not hold what its config describes; the message names the file or tensor."""


class CheckpointWeights:
    """Tensors of a (possibly sharded) safetensors checkpoint by name, converted to float32."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        index_path = model_dir / INDEX_NAME
        if index_path.is_file():
            weight_map = _read_weight_map(index_path)
        elif (model_dir / SINGLE_NAME).is_file():
            weight_map = {}
        else:
            for name in (INDEX_NAME, SINGLE_NAME):
                if (found := not_a_file(model_dir / name)) is not None:
                    raise FileNotFoundError(f"{model_dir / name} {found}")
            pickles = sorted(path.name for path in model_dir.glob("pytorch_model*.bin"))
            pickled = "" if not pickles else (
                f": it holds {', '.join(pickles[:2])}{' ...' if len(pickles) > 2 else ''}, PyTorch pickles, which "
                "export never loads (loading one can run any code it carries); download the model's *.safetensors "
                "files instead, or convert it only if you trust where it came from")
            raise FileNotFoundError(
                f"{model_dir} has no {SINGLE_NAME} or {INDEX_NAME} (only safetensors checkpoints are "
                f"supported){pickled}")
        shard_names = sorted(set(weight_map.values())) or [SINGLE_NAME]
        self._handles = {name: _open_shard(model_dir / name) for name in shard_names}
        if weight_map and shard_names != [SINGLE_NAME] and (model_dir / SINGLE_NAME).is_file():
            # transformers loads the single file and ignores the index; this class would read the index: the
            # two would run different weights, so the stale one must go (unless the index names only it)
            raise MalformedCheckpointError(
                f"{model_dir} holds both {SINGLE_NAME} and {INDEX_NAME} (naming other shards): transformers "
                f"would load {SINGLE_NAME}, the index names other files; remove whichever is stale")
        if not weight_map:
            weight_map = {key: SINGLE_NAME for key in self._handles[SINGLE_NAME].keys()}
        held = {shard: set(handle.keys()) for shard, handle in self._handles.items()}
        for name, shard in weight_map.items():
            if name not in held[shard]:
                raise MalformedCheckpointError(f"{index_path} places tensor {name!r} in {shard}, which lacks it")
        self._weight_map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._shard(name)].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype name (F16, BF16, F32, I8, ...)."""
        return str(self._handles[self._shard(name)].get_slice(name).get_dtype())

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, lambda handle: handle.get_tensor(name))

    def check(self, config: CheckpointConfig) -> None:
        """Raise MalformedCheckpointError unless every tensor the config needs is here, of float type and of
        the shape the config gives (extra tensors, such as a rotary table, are ignored), and, for a tied model, any
        lm_head.weight stored anyway equals the embedding."""
        layers = config.spec.num_layers
        if f"model.layers.{layers - 1}.input_layernorm.weight" not in self:  # before listing a billion names
            if "model.layers.0.input_layernorm.weight" not in self:  # "no layer 1" said layer 0 was there
                raise MalformedCheckpointError(f"config.json gives {layers} layers, but the weights hold none (no "
                                               "model.layers.0.input_layernorm.weight): not a Llama-family "
                                               "checkpoint's tensors, or named otherwise")
            raise MalformedCheckpointError(f"config.json gives {layers} layers, but the weights have no layer "
                                           f"{layers - 1} (model.layers.{layers - 1}.input_layernorm.weight)")
        problems = []
        for name, expected in expected_tensors(config).items():
            if name not in self:
                problems.append(f"{name} is missing")
            elif (shape := self.shape(name)) != expected:
                problems.append(f"{name} has shape {list(shape)} where the config gives {list(expected)}")
            elif (dtype := self.dtype(name)) not in FLOAT_DTYPES:
                problems.append(f"{name} is {dtype}: only f16, bf16, f32 and f64 tensors can be exported (a "
                                f"quantized checkpoint? export from the unquantized one)")
        embedding, head = "model.embed_tokens.weight", "lm_head.weight"
        tied_but_stored = config.spec.tie_word_embeddings and head in self
        if not problems and tied_but_stored and not self._same_values(embedding, head):
            # transformers computes the logits with lm_head.weight (warning only), export with the embedding
            problems.append(f"config.json sets tie_word_embeddings=true, but the checkpoint's {head} differs from "
                            f"{embedding}: set tie_word_embeddings to false to use {head}, or remove {head}")
        if problems:
            more = f" (and {len(problems) - PROBLEMS_SHOWN} more)" if len(problems) > PROBLEMS_SHOWN else ""
            raise MalformedCheckpointError(
                f"the checkpoint's weights do not match its config.json: {'; '.join(problems[:PROBLEMS_SHOWN])}{more}")
        if f"model.layers.{layers}.input_layernorm.weight" in self:  # an edited num_hidden_layers, or a truncation
            stored = layers + 1
            while f"model.layers.{stored}.input_layernorm.weight" in self:
                stored += 1
            extra = f"layer {layers} is" if stored == layers + 1 else f"layers {layers} to {stored - 1} are"
            log.warning("config.json gives %d layers, but the weights hold %d: %s not exported", layers, stored, extra)

    def _same_values(self, first: str, second: str) -> bool:
        """Whether two tensors hold the same values as export reads them (float32), compared a block of rows
        at a time: a large model's vocabulary matrices are gigabytes each."""
        shape = self.shape(first)
        if self.shape(second) != shape:
            return False
        if not shape:
            return bool(torch.equal(self.get(first), self.get(second)))
        row_elements = max(1, math.prod(shape[1:]))
        rows = max(1, COMPARE_BLOCK_BYTES // (4 * row_elements))
        for start in range(0, shape[0], rows):
            if not torch.equal(self._rows(first, start, start + rows), self._rows(second, start, start + rows)):
                return False
        return True

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, lambda handle: handle.get_slice(name)[start:stop])

    def _read(self, name: str, take: Any) -> torch.Tensor:
        """take(handle) of the shard holding `name`, as float32; a file that cannot be read is named, and so is a
        tensor holding NaN or infinite values (see _check_finite)."""
        shard = self._shard(name)
        try:
            # a Ctrl-C landing inside safetensors' read, as torch builds the tensor, came out as a ValueError that
            # called the checkpoint damaged: it is held until the read is done, then stops the export as elsewhere
            with ctrl_c_held():
                tensor = take(self._handles[shard])
        except Exception as error:  # safetensors raises its own SafetensorError for a cut or corrupt file
            raise MalformedCheckpointError(f"tensor {name!r} of {shard} cannot be read: {error}") from None
        tensor = tensor.to(torch.float32)
        _check_finite(name, shard, tensor)  # after the cast: a float64 past float32's range is inf to the export
        return tensor

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointWeights:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _shard(self, name: str) -> str:
        shard = self._weight_map.get(name)
        if shard is None:
            raise MalformedCheckpointError(f"the checkpoint has no tensor {name!r}")
        return shard


def expected_tensors(config: CheckpointConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family checkpoint (Llama, Mistral, Qwen2) with this config must hold, and its
    shape ([out, in] for a projection, as torch's Linear stores it)."""
    spec = config.spec
    hidden, inner = spec.hidden_size, spec.intermediate_size
    query, key_value = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, hidden)}
    for index in range(spec.num_layers):
        layer = f"model.layers.{index}"
        attention, mlp = f"{layer}.self_attn", f"{layer}.mlp"
        tensors |= {f"{layer}.input_layernorm.weight": (hidden,), f"{layer}.post_attention_layernorm.weight": (hidden,),
                    f"{attention}.q_proj.weight": (query, hidden), f"{attention}.k_proj.weight": (key_value, hidden),
                    f"{attention}.v_proj.weight": (key_value, hidden), f"{attention}.o_proj.weight": (hidden, query),
                    f"{mlp}.gate_proj.weight": (inner, hidden), f"{mlp}.up_proj.weight": (inner, hidden),
                    f"{mlp}.down_proj.weight": (hidden, inner)}
        if config.attention_bias:
            tensors |= {f"{attention}.q_proj.bias": (query,), f"{attention}.k_proj.bias": (key_value,),
                        f"{attention}.v_proj.bias": (key_value,)}
        if config.output_bias:
            tensors[f"{attention}.o_proj.bias"] = (hidden,)
        if config.mlp_bias:
            tensors |= {f"{mlp}.gate_proj.bias": (inner,), f"{mlp}.up_proj.bias": (inner,),
                        f"{mlp}.down_proj.bias": (hidden,)}
    tensors["model.norm.weight"] = (hidden,)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = (spec.vocab_size, hidden)
    return tensors


def _check_finite(name: str, shard: str, tensor: torch.Tensor) -> None:
    """MalformedCheckpointError naming a tensor that holds NaN or infinite values.

    Such a checkpoint was exported without a word (NNCF printed only numpy's "invalid value encountered in
    cast"), and generate then failed at its first step, the logits not finite. Checked as the export reads each
    tensor, not in a pass of its own over the checkpoint, which would read every weight twice. The sum first:
    any NaN or inf makes it NaN or inf, and it is one vectorized pass (32M float32 values on one core: 15 ms, so
    about half a second for a 1B model's weights; isfinite().all(), which torch computes through temporary
    tensors, took 270 ms); a sum that is not finite is looked at value by value, as finite values can also sum
    past float32's range."""
    if bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all()):
        return
    nan, infinite = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    counts = " and ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (infinite, "infinite")) if count)
    raise MalformedCheckpointError(
        f"{name} (in {shard}) holds {counts} value{'s' if nan + infinite > 1 else ''} (of {tensor.numel()}): the "
        "checkpoint is damaged; download or convert it again")


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; every shard a plain file name beside the index."""
    try:
        weight_map = read_json_object(index_path).get("weight_map")
    except JsonFileError as error:
        raise MalformedCheckpointError(str(error)) from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()):
        raise MalformedCheckpointError(f"{index_path} has no \"weight_map\" object of tensor names to shard files")
    for shard in set(weight_map.values()):
        if PurePath(shard).name != shard or shard in ("", ".", ".."):
            raise MalformedCheckpointError(f"{index_path} names shard {shard!r}: not a file name beside the index")
    return weight_map


def _open_shard(path: Path) -> Any:  # a safetensors safe_open handle
    if not path.is_file():
        found = not_a_file(path) or "is missing"
        raise FileNotFoundError(f"{path} {found} (named by the checkpoint's {INDEX_NAME})")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # SafetensorError for a cut, empty or non-safetensors file
        raise MalformedCheckpointError(f"{path} is not a readable safetensors file: {error}") from None
