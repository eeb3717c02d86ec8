"""A pipeline stage: the IRs of a layer range fused into ONE stateful OpenVINO model, and its sessions.

Fusion wires each unit's outputs to the next unit's inputs in one graph (rope -> [embed] -> layers ->
[head]), so a stage costs one infer call and a re-plan moves layer files instead of re-exporting. The
fused graph is then made stateful: every layer's past key/value Parameter and present Result become a
ReadValue/Assign pair (OpenVINO's MakeStateful), each cache read goes through Gather(beam_idx) so a
micro-batch can add, drop and reorder rows, and the initial state is zero-length with the input's batch.

Stage inputs (B rows, T new tokens, S = slots after this call):
    input_ids [B,T] i64 (first stage) or hidden_states [B,T,H] f32; attention_mask [B,S] i64;
    position_ids [B,T] i64; beam_idx [B] i32; last stage also logits_positions [B,N] i64
Outputs: stage_hidden_out [B,T,H], or (last stage) logits [B,N,V] and next_tokens [B,N] i64 at the N
positions asked for: all T when verifying draft tokens, only each row's last one at prefill and plain
decoding (the vocabulary projection of a prompt's other positions is work nobody reads).

No torch here: this runs on every employee PC.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino import passes

from deskfleet.common.devices import VIRTUAL, device_kind, device_targets, lists_device
from deskfleet.common.model_spec import (
    ExportMismatchError,
    Manifest,
    ModelSpec,
    TensorNames,
    verify_files,
)
from deskfleet.common.wire_messages import KV_CACHE_PRECISIONS

from . import huge_pages
from .openvino_core import openvino_core

log = logging.getLogger(__name__)

IDLE_SESSIONS = 2  # recycled sessions a stage keeps for the next micro-batches (see Stage.recycle)


class Precision(str, Enum):
    F32 = "f32"  # exact: f32 compute, an f32 KV cache (the CPU plugin's default is u8), no activation quantization
    # Fast. On a CPU: f32 arithmetic, activations quantized to int8 on the fly for the compressed weights (in
    # groups as large as the 4-bit weights' groups: see CompileSettings.properties), a u8 KV cache. f32
    # arithmetic is every CPU's default except those with AMX, whose default is bf16; on the 2-core AMX
    # Xeon here the bf16 path made every decode-sized call slower (330M INT4, 2 threads: 1 token 15.0 ->
    # 10.8 ms, 8 rows 28.5 -> 16.1, 5-token verification 28.0 -> 13.7) and only prompts faster (64 tokens
    # 46.5 -> 71 ms, 256 tokens 118 -> 290). Elsewhere (GPU, NPU, AUTO, ...): the device's default.
    FAST = "fast"


@dataclass(frozen=True)
class CompileSettings:
    device: str = "CPU"
    precision: Precision = Precision.FAST
    num_threads: int | None = None
    kv_cache: str | None = None  # KV_CACHE_PRECISION; None: the precision's own (f32 exact, fast the device's)

    def __post_init__(self) -> None:
        device_targets(self.device)  # ValueError naming it when it is not OpenVINO's syntax ("cpu", "GPU,CPU")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_PRECISIONS:
            raise ValueError(f"unknown KV cache precision {self.kv_cache!r}: "
                             f"choose one of {', '.join(KV_CACHE_PRECISIONS)}")
        if self.precision is Precision.F32 and self.kv_cache not in (None, "f32"):
            raise ValueError(f"--precision f32 is exact and keeps the KV cache in f32, not {self.kv_cache}: leave "
                             f"out --kv-cache, or give --precision fast for a {self.kv_cache} cache")

    def for_drafting(self) -> CompileSettings:
        """The settings of a target that verifies drafts (K+1 tokens a call). A fast CPU stage with no KV
        cache precision chosen keeps its cache in f32 instead of u8: the plugin's multi-token attention
        dequantizes a u8 cache once per query token, so a verification call grows dear with the context
        (279M code target, 5 tokens at 300 slots: 26.7 ms with u8, 20.7-22.6 with f32; one token 16.9-17.5
        vs 16.4-16.6). Batched plain steps keep u8: at 8 rows an f32 cache was ~5% slower."""
        if self.precision is Precision.FAST and self.kv_cache is None and device_kind(self.device) == "CPU":
            return replace(self, kv_cache="f32")
        return self

    def properties(self, weight_group_size: int | None = None) -> dict[str, str]:
        """OpenVINO properties for this device, dropping those the device does not support.

        weight_group_size: the group of the model's 4-bit weights (`weight_group_size(model)`). A fast CPU
        stage quantizes its activations on the fly in groups of that size instead of the plugin's 32: the
        kernel then scales once per weight group. Measured on this repo's INT4 exports (group 128, one
        thread, alternating in one process): decode steps 1.02-1.10x faster at one row and 1.07-1.13x at
        eight, prompts 1.23-1.37x, 5-token verifications 1.04-1.23x; the demo target's held-out perplexity
        18.279 -> 18.271 (f32 exact: 18.272), its argmax equal to the exact f32 one at 99.1% of positions
        instead of 99.3%.
        """
        core = openvino_core()
        wanted: dict[str, str] = {"PERFORMANCE_HINT": "LATENCY"}
        if self.precision is Precision.FAST and device_kind(self.device) == "CPU":
            wanted["INFERENCE_PRECISION_HINT"] = "f32"  # not bf16 on AMX CPUs: see Precision.FAST
            if weight_group_size:
                wanted["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(weight_group_size)
        if self.kv_cache is not None:
            wanted["KV_CACHE_PRECISION"] = self.kv_cache
        if self.precision is Precision.F32:
            wanted["INFERENCE_PRECISION_HINT"] = "f32"
            wanted["KV_CACHE_PRECISION"] = "f32"
            # INT4/INT8 weights: the CPU plugin quantizes activations on the fly by default, and a call of
            # T tokens (verifying drafts) then rounds differently from T calls of one token.
            wanted["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = "0"
        if self.num_threads:
            wanted["INFERENCE_NUM_THREADS"] = str(self.num_threads)
        if device_kind(self.device) in VIRTUAL:
            # each device named in the list must be here: OpenVINO's AUTO:GPU,CPU on a PC without a GPU driver
            # failed in compile_model with the GPU plugin's library error, not by falling back on the CPU
            missing = [target for target in device_targets(self.device)  # a bare AUTO's own name: nothing to find
                       if target not in VIRTUAL and not lists_device(target, core.available_devices)]
            if missing:
                raise ValueError(f"device {self.device} lists {', '.join(missing)}, not available on this PC "
                                 f"(OpenVINO finds {', '.join(core.available_devices) or 'none'}): leave "
                                 f"{'it' if len(missing) == 1 else 'them'} out of the list")
            return wanted
        if not lists_device(self.device, core.available_devices):
            raise ValueError(f"device {self.device} is not available on this PC (OpenVINO finds "
                             f"{', '.join(core.available_devices) or 'none'})")
        supported = set(core.get_property(self.device, "SUPPORTED_PROPERTIES"))
        for name in sorted(set(wanted) - supported):
            if name in {"INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION"} and self.precision is Precision.F32:
                raise ValueError(f"device {self.device} does not support {name}: it cannot run --precision f32")
            log.warning("device %s does not support %s; left at its default", self.device, name)
            del wanted[name]
        return wanted


@dataclass(frozen=True)
class LayerRange:
    start: int
    stop: int
    num_layers: int  # of the whole model

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.stop == self.num_layers


@dataclass(frozen=True)
class StageOutput:
    """hidden: [B,T,H] (a copy, safe to hand to another thread), or next_tokens [B,N] and logits [B,N,V]."""

    hidden: np.ndarray | None = None
    next_tokens: np.ndarray | None = None
    logits: np.ndarray | None = None


# Public methods

def openvino_reason(error: BaseException) -> str:
    """The line of an OpenVINO exception that says what is wrong: its last, past "Exception from src/...cpp:117:"
    and the "Check '...' failed at src/..." lines before it."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(error).__name__


def build_stage_model(model_dir: Path, manifest: Manifest, layers: LayerRange, verify: bool = True,
                      map_weights: bool = False) -> ov.Model:
    """Fuse the IRs of `layers` into one stateful ov.Model. Verifies every file's sha256 first.

    map_weights: map the .bin files (OpenVINO's default) instead of reading them into the process's memory;
    see Stage for which a CPU stage wants. The shard cache never rewrites a file in place (shards are stored
    by sha256 and replaced by rename), so a mapped file stays what was verified."""
    stems = manifest.stage_ir_stems(layers.start, layers.stop)
    if verify:
        verify_files(model_dir, manifest, [name for stem in stems for name in manifest.ir_files(stem)])
    core = openvino_core()
    units = {stem: core.read_model(model_dir / f"{stem}.xml", config={"ENABLE_MMAP": map_weights}) for stem in stems}
    spec = manifest.spec

    attention_mask = _parameter(TensorNames.ATTENTION_MASK, [-1, -1], ov.Type.i64)
    position_ids = _parameter(TensorNames.POSITION_IDS, [-1, -1], ov.Type.i64)
    beam_idx = _parameter(TensorNames.BEAM_IDX, [-1], ov.Type.i32)

    rope = units[Manifest.ROPE_IR]
    _check_rope_rows(rope, spec.max_context)
    _check_widths(units, spec)
    _rewire(rope, TensorNames.POSITION_IDS, position_ids.output(0))
    _rewire(rope, TensorNames.ATTENTION_MASK, attention_mask.output(0))
    cos, sin, bias = (_produced(rope, name) for name in (TensorNames.COS, TensorNames.SIN,
                                                          TensorNames.ATTENTION_BIAS))
    if layers.is_first:
        stage_input = _parameter(TensorNames.INPUT_IDS, [-1, -1], ov.Type.i64)
        embed = units[Manifest.EMBED_IR]
        _rewire(embed, TensorNames.INPUT_IDS, stage_input.output(0))
        hidden = _produced(embed, TensorNames.EMBED_OUT)
    else:
        stage_input = _parameter(TensorNames.HIDDEN_STATES, [-1, -1, spec.hidden_size], ov.Type.f32)
        hidden = stage_input.output(0)

    kv_pairs: list[tuple[ov.Node, ov.Node]] = []
    for index in range(layers.start, layers.stop):
        layer = units[Manifest.layer_ir(index)]
        _rewire(layer, TensorNames.layer_hidden_in(index), hidden)
        _rewire(layer, TensorNames.ATTENTION_BIAS, bias)
        _rewire(layer, TensorNames.COS, cos)
        _rewire(layer, TensorNames.SIN, sin)
        for kind in ("key", "value"):
            past = _input_node(layer, TensorNames.past(kind, index))
            _insert_beam_gather(past, beam_idx)
            kv_pairs.append((past, _result_node(layer, TensorNames.present(kind, index))))
        hidden = _produced(layer, TensorNames.layer_hidden_out(index))

    extra_parameters = []
    if layers.is_last:
        logits_positions = _parameter(TensorNames.LOGITS_POSITIONS, [-1, -1], ov.Type.i64)
        extra_parameters.append(logits_positions)
        selected = ops.gather(hidden, logits_positions, ops.constant(np.int64(1)), batch_dims=1)  # [B, N, H]
        head = units[Manifest.HEAD_IR]
        _rewire(head, TensorNames.HEAD_IN, selected.output(0))
        next_tokens = _result_node(head, TensorNames.NEXT_TOKENS)
        argmax = first_max_index(_produced(head, TensorNames.LOGITS), spec.vocab_size)
        argmax.get_tensor().set_names({TensorNames.NEXT_TOKENS})
        next_tokens.input(0).replace_source_output(argmax)
        outputs = [_result_node(head, TensorNames.LOGITS), next_tokens]
    else:
        result = ops.result(hidden)
        result.output(0).get_tensor().set_names({TensorNames.STAGE_HIDDEN_OUT})
        outputs = [result]

    parameters = [stage_input, attention_mask, position_ids, beam_idx, *extra_parameters]
    parameters += [past for past, _ in kv_pairs]
    model = ov.Model(outputs + [present for _, present in kv_pairs], parameters,
                     f"{manifest.model_name}-layers-{layers.start}-{layers.stop}")
    manager = passes.Manager()
    manager.register_pass(passes.MakeStateful(kv_pairs))
    manager.run_passes(model)
    _zero_length_initial_state(model, stage_input)
    stateful = sum(op.get_type_name() == "ReadValue" for op in model.get_ops())
    if stateful != len(kv_pairs):
        raise RuntimeError(f"only {stateful} of {len(kv_pairs)} KV pairs became stateful")
    return model


REPACKED_SHARE = 0.5  # of a stage's weight bytes: anonymous memory grown by this much at warm-up = repacked
WEIGHTS_ENV_VAR = "DESKFLEET_STAGE_WEIGHTS"
WEIGHTS_AUTO, WEIGHTS_READ, WEIGHTS_MAPPED = "auto", "read", "mapped"


def stage_weights_choice(environ: Mapping[str, str] | None = None) -> str:
    """How a CPU stage holds its weight files: DESKFLEET_STAGE_WEIGHTS=auto (the default: mapped where the
    plugin repacks them, see weights_were_repacked), read (always read into memory: a few percent faster
    decoding where the plugin repacks them, at twice the memory) or mapped (always). ValueError naming the
    variable for anything else."""
    value = (os.environ if environ is None else environ).get(WEIGHTS_ENV_VAR, WEIGHTS_AUTO).strip().lower()
    if value not in (WEIGHTS_AUTO, WEIGHTS_READ, WEIGHTS_MAPPED):
        raise ValueError(f"{WEIGHTS_ENV_VAR}={value!r}: choose {WEIGHTS_AUTO}, {WEIGHTS_READ} or {WEIGHTS_MAPPED}")
    return value


def weights_were_repacked(anonymous_before: int | None, anonymous_after: int | None, weight_bytes: int) -> bool:
    """Whether the CPU plugin copied a stage's weights into memory of its own at the first inference (the
    process's anonymous memory grew by REPACKED_SHARE of their bytes or more over the warm-up call; measured
    from after the compile, whose own buffers would count for a small model), so that the mapped files are
    read no more; True where the process's anonymous memory cannot be read (not Linux).

    Where it repacks them (measured on an AVX-512 EPYC, INT4: the 170M model's stage grew 102 MB of anonymous
    memory for 102 MB of files), a stage that read its files into memory held every weight twice (227 MB),
    and mapped it holds them once plus page cache the kernel may reclaim (84 MB), decoding as fast (4.88 vs
    5.00 ms a token, one core, 12 alternating runs in one process). Where it runs most of them in place (a
    Xeon with AMX: 40 of ~100 MB repacked), mapped weights stay in 4 KB page-cache pages that huge pages
    cannot back, and reading them into memory decoded 8% faster (11.27 -> 10.37 ms): the stage is built
    again that way. Elsewhere than Linux there are no huge pages to gain, so mapping always wins (but Windows
    reads them: see Stage)."""
    if anonymous_before is None or anonymous_after is None or weight_bytes <= 0:
        return True
    return anonymous_after - anonymous_before >= REPACKED_SHARE * weight_bytes


def resident_anonymous_bytes() -> int | None:
    """This process's resident anonymous memory (Linux's RssAnon), or None where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as status:  # its Name: is bytes
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def stage_weight_bytes(manifest: Manifest, layers: LayerRange) -> int:
    """The weight bytes of a stage of `layers`: its layers', the embed's on a first stage, the head's on a last (the
    manifest's sizes, which loading it checked against the files)."""
    return (sum(manifest.layer_bytes[layers.start:layers.stop]) + (manifest.embed_bytes if layers.is_first else 0)
            + (manifest.head_bytes if layers.is_last else 0))


def openvino_devices() -> tuple[str, ...]:
    """The devices OpenVINO finds on this PC ("CPU", "GPU.0", "NPU"), as the agent reports them to plans."""
    return tuple(openvino_core().available_devices)


def _check_rope_rows(rope: ov.Model, max_context: int) -> None:
    """ManifestError when the RoPE IR's cos/sin tables hold fewer positions than the manifest's context: a
    position past the table would be gathered from outside it and compute garbage, silently."""
    tables = [op.get_output_partial_shape(0) for op in rope.get_ordered_ops() if op.get_type_name() == "Constant"
              and op.get_output_partial_shape(0).rank.get_length() == 2
              and any(target.get_node().get_type_name() == "Gather" for target in op.output(0).get_target_inputs())]
    rows = min((shape[0].get_length() for shape in tables if shape[0].is_static), default=None)
    if rows is not None and rows < max_context:
        raise ExportMismatchError(f"the manifest says the context is {max_context} positions, but the RoPE tables "
                            f"(rope.xml) hold {rows}: the export's manifest has been changed")


def _check_widths(units: Mapping[str, ov.Model], spec: ModelSpec) -> None:
    """ManifestError when the manifest's vocab_size or hidden_size is not what a stage's IRs were exported with
    (an edited manifest, or files of two exports mixed in one folder). Without it, a vocabulary that differs
    from the head's failed the compile with OpenVINO's shape-inference text (first_max_index's Select), one
    larger than the embedding's rows let token ids past them be gathered from outside it, and a hidden size
    that differs failed fusing the graphs. Read from the graphs' static shapes: nothing is computed."""
    found: list[tuple[str, int, str, int | None]] = []  # manifest field, its value, what the IR holds ({}: how many)
    if Manifest.EMBED_IR in units:
        embed = units[Manifest.EMBED_IR]
        for op in embed.get_ordered_ops():  # the embedding matrix [V, H]: the data of the Gather by token id
            table = op.input_value(0).get_partial_shape() if op.get_type_name() == "Gather" else None
            if table is not None and table.rank.is_static and table.rank.get_length() == 2:
                found.append(("vocab_size", spec.vocab_size, "embed.xml holds {} embedding rows",
                              _static_length(table, 0)))
        found.append(("hidden_size", spec.hidden_size, "embed.xml gives {} values a token",
                      _last_length(_produced(embed, TensorNames.EMBED_OUT))))
    for stem, unit in units.items():
        if stem.startswith("layer_"):
            hidden_in = _input_node(unit, TensorNames.layer_hidden_in(int(stem.removeprefix("layer_"))))
            found.append(("hidden_size", spec.hidden_size, f"{stem}.xml takes {{}} values a token",
                          _last_length(hidden_in.output(0))))
    if Manifest.HEAD_IR in units:
        head = units[Manifest.HEAD_IR]
        found.append(("hidden_size", spec.hidden_size, "head.xml takes {} values a token",
                      _last_length(_input_node(head, TensorNames.HEAD_IN).output(0))))
        found.append(("vocab_size", spec.vocab_size, "head.xml gives {} logits a token (its lm_head's rows)",
                      _last_length(_produced(head, TensorNames.LOGITS))))
    for field_name, value, holds, count in found:
        if count is not None and count != value:
            raise ExportMismatchError(f"manifest.json says {field_name} {value}, but {holds.format(count)}: the export "
                                "folder was edited or holds files of another export; export the model again")


def _static_length(shape: ov.PartialShape, axis: int) -> int | None:
    return shape[axis].get_length() if shape[axis].is_static else None


def _last_length(port: ov.Output) -> int | None:
    """The static length of a port's last axis, or None when it is dynamic or the rank is."""
    shape = port.get_partial_shape()
    if not shape.rank.is_static or shape.rank.get_length() == 0:
        return None
    return _static_length(shape, shape.rank.get_length() - 1)


def weight_group_size(model: ov.Model) -> int | None:
    """The group size of the model's grouped 4-bit weights (the greatest common divisor where they differ),
    or None when it has none (f32, f16 or 8-bit exports, per-channel 4-bit).

    NNCF stores a grouped weight as a u4/i4 Constant [out, in / group, group] (its zero point: [.., 1]).
    """
    groups = {shape[2] for op in model.get_ops() if op.get_type_name() == "Constant"
              and op.get_output_element_type(0) in (ov.Type.u4, ov.Type.i4)
              for shape in [op.get_output_shape(0)] if len(shape) == 3 and shape[2] > 1}
    return math.gcd(*groups) if groups else None


def export_weight_group_size(model_dir: Path) -> int | None:
    """weight_group_size of an export, read from its first decoder layer (every layer has the same policy)."""
    return weight_group_size(openvino_core().read_model(Path(model_dir) / f"{Manifest.layer_ir(0)}.xml"))


def first_max_index(logits: ov.Output, vocab_size: int) -> ov.Output:
    """The index of each row's first maximum over the last axis: [..., V] f32 -> [...] i64.

    The exported head says argmax the way torch exports it, a stable sorted TopK(k=1), which the CPU
    plugin runs by sorting the whole vocabulary row: 0.5 ms of a 6 ms decode step with a 16k vocabulary,
    and half of a 5-token verification call (2.6 of 5.1 ms on the demo target). ReduceMax, Equal, Select
    and ReduceMin are a few passes over the row and give torch's and numpy's tie rule.
    Equal is exact: the maximum is one of the row's own values, in the row's own precision.
    """
    row_max = ops.reduce_max(logits, ops.constant(np.int64(-1)), keep_dims=True)
    index = ops.constant(np.arange(vocab_size, dtype=np.int64))
    candidates = ops.select(ops.equal(logits, row_max), index, ops.constant(np.int64(vocab_size)))
    return ops.reduce_min(candidates, ops.constant(np.int64(-1)), keep_dims=False).output(0)


class Stage:
    """A compiled stage. Each session (one InferRequest) holds the KV state of one micro-batch."""

    def __init__(self, model_dir: Path, manifest: Manifest, layers: LayerRange,
                 settings: CompileSettings | None = None) -> None:
        self.layers = layers
        self.hidden_size = manifest.spec.hidden_size
        self.vocab_size = manifest.spec.vocab_size
        self._idle_sessions: list[StageSession] = []  # recycled, KV state dropped (see recycle)
        self._huge_pages: huge_pages.CollapseReport | None = None  # what backed this stage's memory with them
        self.settings = settings = settings or CompileSettings()
        core = openvino_core()
        on_cpu = device_kind(settings.device) == "CPU"
        memory_before = huge_pages.snapshot() if on_cpu else None
        # A CPU stage maps its weight files first (see weights_were_repacked); other devices read them
        weights = stage_weights_choice() if on_cpu else WEIGHTS_READ
        if weights != WEIGHTS_READ and sys.platform == "win32":
            # Windows locks a mapped file against deletion: the shard cache removes a released stage's view and
            # evicts blobs, which a mapping not yet let go of would make fail (the view stays, and the next build
            # of that stage under its name fails). Not tried there; weights are read, also when asked to map them.
            if weights == WEIGHTS_MAPPED:
                log.warning("%s=%s is not used on Windows, which keeps a mapped weight file from being deleted "
                            "(the shard cache removes a released stage's files): the weights are read into memory",
                            WEIGHTS_ENV_VAR, WEIGHTS_MAPPED)
            weights = WEIGHTS_READ
        model = build_stage_model(model_dir, manifest, layers, map_weights=weights != WEIGHTS_READ)
        properties = settings.properties(weight_group_size(model))
        try:
            self.compiled = core.compile_model(model, settings.device, properties)
        except RuntimeError as error:  # `--device CPU.0` said 3 lines of the plugin's source paths, no option
            raise RuntimeError(f"OpenVINO could not compile layers [{layers.start}:{layers.stop}] on device "
                               f"{settings.device!r}: {openvino_reason(error)} (this PC's devices: "
                               f"{', '.join(core.available_devices) or 'none'})") from error
        log.info("compiled layers [%d:%d] on %s (%s)", layers.start, layers.stop, settings.device,
                 settings.precision.value)
        self.weights_mapped = weights != WEIGHTS_READ
        if on_cpu:
            # The CPU plugin repacks the weights at the first inference, into memory of its own: run one now,
            # so that the PC's free memory shows what the stage takes from the start (a 330M stage: 18 MB
            # less available after compiling, 120 MB after the first call) and the first prompt does not
            # pay for it; then back that memory with huge pages.
            anonymous_before = resident_anonymous_bytes()  # after compiling: the warm-up's growth is the repack
            self.warm_up()
            if weights == WEIGHTS_AUTO and not weights_were_repacked(
                    anonymous_before, resident_anonymous_bytes(), stage_weight_bytes(manifest, layers)):
                # the plugin runs these weights where they lie: read into memory, huge pages can back them (the
                # warm-up's recycled session belongs to the mapped build: it goes with it)
                self._idle_sessions.clear()
                del model, self.compiled
                model = build_stage_model(model_dir, manifest, layers, verify=False, map_weights=False)
                self.compiled = core.compile_model(model, settings.device, properties)
                self.weights_mapped = False
                self.warm_up()
            log.debug("layers [%d:%d]: weights %s", layers.start, layers.stop,
                      "mapped (repacked by the plugin)" if self.weights_mapped else "read into memory")
            self._huge_pages = huge_pages.collapse_new_regions(memory_before)

    def release_memory(self) -> None:
        """Give back what the plugin holds of this stage's calls, once the stage is let go and before it is dropped.

        The CPU plugin (2026.4) keeps a request's buffers of its largest call (see recycle), and did not free them
        when the requests and the compiled model were destroyed: an agent in-process, assigned the demo target, fed
        one 900-token prompt and released, 5 times over, grew by 40 MB a cycle (4 MB without the prompt), and in a
        2-PC soak the PC that took over its peer's layers at each of 4 failovers kept 630 MB more than a fresh
        agent. CompiledModel.release_memory frees them (the same cycles: 5 MB each; a thread and its stack the
        plugin keeps). No call of this stage may run meanwhile (the plugin refuses): the agent waits for its step.
        Ranges only hinted for huge pages (a kernel without MADV_COLLAPSE) are unmarked first, so that the freed
        memory does not fill up with them again (see huge_pages)."""
        huge_pages.take_back_hints(self._huge_pages)
        self.trim_idle_memory()

    def trim_idle_memory(self) -> None:
        """Give back the buffers of the calls this stage ran, while it keeps its weights and serves on: its idle
        sessions go, and the plugin frees what it kept of their calls (release_memory). Only while no session of
        this stage is open (the caller's check: it holds no micro-batch) and no call runs. The next micro-batch
        opens a new request, 7-15 ms, and its first calls allocate again. Measured on the demo target, a whole-model
        stage: after three micro-batches of 4 rows prefilled 700 tokens each, 572 MB of anonymous memory, 216 MB
        once trimmed (389 with the idle sessions dropped alone), and the next call's logits unchanged."""
        self._idle_sessions.clear()
        self.compiled.release_memory()

    def warm_up(self) -> None:
        """One throwaway single-token call on a session of its own, then recycled (no KV state kept)."""
        session = self.open_session()
        payload = (np.zeros((1, 1), dtype=np.int64) if self.layers.is_first
                   else np.zeros((1, 1, self.hidden_size), dtype=np.float32))
        session.forward(payload, np.ones((1, 1), dtype=np.int64), np.zeros((1, 1), dtype=np.int64),
                        np.zeros(1, dtype=np.int32))
        self.recycle(session)

    def open_session(self) -> StageSession:
        """A session with no KV state: a recycled one when there is one, else a new InferRequest."""
        return self._idle_sessions.pop() if self._idle_sessions else StageSession(self)

    def recycle(self, session: StageSession) -> None:
        """Take back a session its micro-batch no longer needs: its KV state is dropped, and open_session
        hands it out again (up to IDLE_SESSIONS are kept; beyond, it is let go).

        Reusing a request instead of creating one per stream (170M model, one core, `bench streams`
        alternating with GenAI's process on that core): opening a micro-batch's session took 0.4-3 ms instead
        of 7-15 ms (a new InferRequest after another process had run there; 1-3 ms right after our own run),
        and its buffers are already allocated. Whole runs, two A/B pairs of runs at 1-8 users: 0.95-1.00x vs
        0.92-1.00x of GenAI on a slower host (noise), 0.91-0.99x vs 0.86-0.96x on a faster one.

        Memory: a request keeps the buffers of its largest call until it is destroyed (reset_state, or
        setting zero-length states, frees nothing: 330M model, f32 KV cache, a 1024-token prompt, ~64 MB a
        request). The process keeps a dropped request's memory too (RSS unchanged after dropping four), but
        then any allocation may reuse it; a kept one serves only this stage's next sessions. Hence only
        IDLE_SESSIONS are kept: a running micro-batch and a newcomer's prefill is the common case.
        """
        if session.opened_by() is not self:
            raise ValueError("a session can only go back to the stage that opened it")
        if any(idle is session for idle in self._idle_sessions):
            return
        session.reset()
        if len(self._idle_sessions) < IDLE_SESSIONS:
            self._idle_sessions.append(session)


class StageSession:
    """One micro-batch's KV state on a stage, and the calls that advance it."""

    def __init__(self, stage: Stage) -> None:
        # a weak reference: the stage keeps its idle sessions (Stage.recycle), and a session that held its stage
        # made a cycle that only Python's full collection frees, seldom in a busy agent: every stage an agent
        # released (a redeploy, a re-plan) kept its compiled model, weight files and mappings for many minutes
        # (6 redeploys of the demo target: 314 -> 650 MB, 38 -> 80 file handles, 11 -> 60 deleted files mapped)
        self._stage = weakref.ref(stage)
        self.is_first = stage.layers.is_first
        self.request = stage.compiled.create_infer_request()
        # rows x tokens of this request's largest call: the plugin keeps that call's buffers until the request is
        # destroyed (a reset or a recycle frees nothing; see Stage.recycle), and an agent's memory guard counts
        # only a call larger than this (common/prefill_scratch.py)
        self.largest_call_tokens = 0
        self._empty_states: dict[str, np.ndarray] | None = None  # the state after reset(), see there
        # Input and output tensors over numpy buffers of our own, written and read in place every call: after
        # a decode step has streamed the weights through the caches, every call into the bindings misses
        # them, and get_tensor + .data on the outputs alone cost ~0.3 ms of a step (170M model, one core).
        # Handing the request new numpy-backed tensors each call (start_async with a dict) instead made every
        # decode step slower: 0.95-0.98x of GenAI vs 1.00x on the same compiled model.
        self._inputs = {port.get_any_name(): _HostBuffer(self.request, port)
                        for port in stage.compiled.inputs}
        next_tokens = _output_port(stage.compiled, TensorNames.NEXT_TOKENS) if stage.layers.is_last else None
        self._next_tokens = _HostBuffer(self.request, next_tokens) if next_tokens is not None else None

    def opened_by(self) -> Stage | None:
        """The stage that opened this session (None once that stage is gone)."""
        return self._stage()

    def forward(self, payload: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                beam_idx: np.ndarray, want_logits: bool = False,
                logits_positions: np.ndarray | None = None) -> StageOutput:
        """Append T slots for every row and run the stage.

        payload: input_ids [B,T] i64 (first stage) or hidden_states [B,T,H] f32; attention_mask [B,S] over
        all slots after this call (bool or any integer type: it is cast into the request's i64 tensor);
        position_ids [B,T] logical; beam_idx [B] rows of the previous state; logits_positions [B,N] (last
        stage): the positions whose logits and next tokens come back (default: all T).
        """
        name = TensorNames.INPUT_IDS if self.is_first else TensorNames.HIDDEN_STATES
        self._feed(name, payload)
        self._feed(TensorNames.ATTENTION_MASK, attention_mask)
        self._feed(TensorNames.POSITION_IDS, position_ids)
        self._feed(TensorNames.BEAM_IDX, beam_idx)
        if self._next_tokens is not None:  # the last stage
            if logits_positions is None:
                rows, tokens = position_ids.shape
                logits_positions = np.broadcast_to(np.arange(tokens, dtype=np.int64), (rows, tokens))
            self._feed(TensorNames.LOGITS_POSITIONS, logits_positions)
            self._next_tokens.expect(logits_positions.shape)  # next_tokens: [B, N]
        # start_async + wait, not infer(): the synchronous call runs the plugin in this thread, which saved
        # ~0.17 ms outside the call per decode step but made the call itself ~1 ms slower (170M, one core,
        # alternating in one process: 15.5 vs 14.5 ms); and the bindings' infer() copies every output.
        self.request.start_async()
        self.request.wait()
        self._empty_states = None
        self.largest_call_tokens = max(self.largest_call_tokens, position_ids.size)
        if self._next_tokens is None:
            return StageOutput(hidden=self.request.get_tensor(TensorNames.STAGE_HIDDEN_OUT).data.copy())
        logits = self.request.get_tensor(TensorNames.LOGITS).data.copy() if want_logits else None
        return StageOutput(next_tokens=self._next_tokens.view.copy(), logits=logits)

    def _feed(self, name: str, array: np.ndarray) -> None:
        self._inputs[name].write(array)

    def reset(self) -> None:
        """Forget every row's KV state (the next forward starts from zero slots).

        reset_state() alone is not enough on the CPU plugin with a quantized (u8) KV cache: a request reset
        after use and then fed a micro-batch of two rows (one admitted from another request's state) later
        read garbage from it: row 1's logits turned NaN after 18-40 steps (the demo target, the 170M, 330M
        and 1.1B models, OpenVINO 2026.4), where a new request or an f32 cache gave the right tokens. Setting
        every state to zero length after the reset makes the plugin start the cache afresh, and the tokens
        equal a new request's (tests/agent/test_session_recycling.py). The plugin then refuses to read such
        a state back (a stride check in its memory_state.cpp), so query_state answers for it until the next
        call or set_state."""
        self.request.reset_state()
        empty = {}
        for state in self.request.query_state():
            tensor = state.state
            shape = list(tensor.shape)
            if len(shape) == 4:  # [B, KV heads, slots, head dim] -> one row (new rows gather row 0), no slots
                shape[0], shape[2] = 1, 0
                state.state = ov.Tensor(tensor.element_type, ov.Shape(shape))
            empty[state.name] = np.zeros(shape, dtype=tensor.element_type.to_dtype())
        self._empty_states = empty

    def query_state(self) -> dict[str, np.ndarray]:
        if self._empty_states is not None:
            return {name: array.copy() for name, array in self._empty_states.items()}
        return {state.name: state.state.data.copy() for state in self.request.query_state()}

    def set_state(self, values: dict[str, np.ndarray]) -> None:
        for state in self.request.query_state():
            state.state = ov.Tensor(np.ascontiguousarray(values[state.name]))
        self._empty_states = None


class _HostBuffer:
    """One input or output of a request, backed by a numpy buffer of ours that only grows.

    The request holds an ov.Tensor over the buffer, so a call reads our inputs and writes our outputs in
    place. A new shape within the capacity costs one set_shape; beyond it the buffer doubles and the
    request is handed a tensor over the new one. `view` is the buffer as the tensor's current shape.

    Every session of a stage must give its request its own tensors for the same ports. The CPU plugin's
    requests share one graph per stream, which points its outputs at the last request's user tensors; a
    request that kept the plugin's own tensors then had its outputs also written into another session's
    buffer, freed with that session, and the heap broke (glibc: "corrupted double-linked list").
    """

    def __init__(self, request: ov.InferRequest, port: ov.ConstOutput) -> None:
        self.request = request
        self.port = port
        self.dtype = port.get_element_type().to_dtype()
        self.shape: tuple[int, ...] = ()
        self.buffer = np.zeros(0, dtype=self.dtype)
        self.tensor: ov.Tensor | None = None
        self.view: np.ndarray = self.buffer

    def write(self, array: np.ndarray) -> None:
        """Copy `array` in (numpy casts the dtype), reshaping the tensor first when it differs."""
        if array.shape != self.shape:
            self.expect(array.shape)
        self.view[...] = array

    def expect(self, shape: tuple[int, ...]) -> None:
        """Make the tensor `shape` (an output: the shape the next call will write)."""
        if shape == self.shape:
            return
        size = math.prod(shape)
        if size > self.buffer.size or self.tensor is None:
            # kept only once the request took the tensor: a shape it refuses (a wrong hidden size) must leave
            # the request reading the buffer this object writes, or the next call would feed stale inputs
            buffer = np.zeros(max(size, 2 * self.buffer.size, 1), dtype=self.dtype)
            tensor = ov.Tensor(buffer, shared_memory=True)  # its capacity: the whole buffer
            tensor.shape = list(shape)  # before the request takes it: it checks the rank
            self.request.set_tensor(self.port, tensor)
            self.buffer, self.tensor = buffer, tensor
        else:
            self.tensor.shape = list(shape)
        self.shape = tuple(shape)
        self.view = self.buffer[:size].reshape(shape)


# Private methods

def _parameter(name: str, shape: list[int], element_type: ov.Type) -> ov.Node:
    parameter = ops.parameter(ov.PartialShape(shape), element_type, name=name)
    parameter.output(0).get_tensor().set_names({name})
    return parameter


def _input_node(model: ov.Model, name: str) -> ov.Node:
    for parameter in model.get_parameters():
        if name in parameter.output(0).get_names():
            return parameter
    raise KeyError(f"IR {model.get_friendly_name()} has no input {name!r}")


def _output_port(compiled: ov.CompiledModel, name: str) -> ov.ConstOutput:
    for port in compiled.outputs:
        if name in port.get_names():
            return port
    raise KeyError(f"compiled stage has no output {name!r}")


def _result_node(model: ov.Model, name: str) -> ov.Node:
    for result in model.get_results():
        if name in result.output(0).get_names() or name in result.input_value(0).get_names():
            return result
    raise KeyError(f"IR {model.get_friendly_name()} has no output {name!r}")


def _produced(model: ov.Model, name: str) -> ov.Output:
    """The port that computes output `name` (not the Result node itself)."""
    return _result_node(model, name).input_value(0)


def _rewire(model: ov.Model, input_name: str, source: ov.Output) -> None:
    """Feed every consumer of the model's input `input_name` from `source` instead."""
    parameter = _input_node(model, input_name)
    for target in list(parameter.output(0).get_target_inputs()):
        target.replace_source_output(source)


def _insert_beam_gather(past: ov.Node, beam_idx: ov.Node) -> None:
    consumers = list(past.output(0).get_target_inputs())
    gathered = ops.gather(past, beam_idx, ops.constant(np.int64(0)))
    for target in consumers:
        target.replace_source_output(gathered.output(0))


def _zero_length_initial_state(model: ov.Model, stage_input: ov.Node) -> None:
    """Initial KV state [B, KV, 0, D], B taken from the stage input: a fresh state has no slots."""
    batch = ops.gather(ops.shape_of(stage_input, output_type="i64"), ops.constant(np.array([0], np.int64)),
                       ops.constant(np.int64(0)))
    for op in model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        shape = op.get_output_partial_shape(0)
        dims = [batch] + [ops.constant(np.array([shape[i].get_length() if i != 2 else 0], np.int64))
                          for i in range(1, 4)]
        zeros = ops.broadcast(ops.constant(np.float32(0)), ops.concat(dims, axis=0))
        op.set_arguments([zeros])
    model.validate_nodes_and_infer_types()
