"""`deskfleet bench parity`: decode speed of deskfleet vs OpenVINO GenAI, and of k stages vs 1.

Every variant generates exactly `new_tokens` greedy tokens (EOS ignored) from the same prompt ids, one
variant after the other in interleaved rounds (A B C ... A B C ...) after one untimed warm-up run each,
so that drift of the shared machine (thermal, other load) falls on all of them alike. Decode tok/s is
tokens after the first over the time after the first (prefill excluded), for every variant.

Variants (those whose inputs are given):
    deskfleet-1       1-stage LocalPipeline + the Engine (what `deskfleet generate` runs)
    genai             GenAI LLMPipeline on optimum-intel's export, in a subprocess of the GenAI venv, with
                      its default attention backend (PagedAttention on CPU in GenAI 2026)
    genai-sdpa        the same with ATTENTION_BACKEND=SDPA: the stateful path deskfleet's stages take
    fused-direct      the fused 1-stage model, driven by a plain infer loop (no worker thread, no queues)
    whole-direct      optimum-intel's whole-model IR, compiled here and driven by the same plain loop
    deskfleet-K       K-stage LocalPipeline, for each K of stage_counts
    deskfleet-1-4k-pages
                      deskfleet-1 with DESKFLEET_HUGE_PAGES=0 (huge_pages_ablation; process isolation)

fused-direct vs whole-direct compares a stage fused from per-layer IRs with a model exported whole on the
same runtime and loop; deskfleet-1 vs fused-direct is the cost of the pipeline's thread and queues; and
whole-direct vs genai is the cost of a Python decode loop vs GenAI's C++ one.

Isolation. "process" (the default) runs every variant, deskfleet's as well as GenAI's, in a process of its
own that is started afresh for every round and holds only that variant's model: load, one untimed warm-up
generation, one timed generation, exit. "shared" loads deskfleet's variants once into this process (GenAI
stays in its runner) and runs an untimed warm-up round first. Shared is quicker, but with several large
models in one process each variant keeps the memory placement it drew at load for every round: on the
2-core VM, 1.1B model, fused-direct vs whole-direct came out 1.03x in one shared run and 0.91x in the
next, a swing larger than the differences the bench is for.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from deskfleet.agent import allocator
from deskfleet.agent.openvino_core import openvino_core
from deskfleet.agent.stage import CompileSettings, LayerRange, Stage, StageSession
from deskfleet.common.model_spec import Manifest, load_manifest
from deskfleet.controller.engine import Engine, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline

from .arguments import check_at_least, check_genai_inputs
from .host import host_report
from .rounds import round_order
from .runner_process import RunnerProcess

log = logging.getLogger(__name__)

GENAI_RUNNER = Path(__file__).with_name("genai_runner.py")
DESKFLEET_RUNNER = Path(__file__).with_name("parity_runner.py")
ISOLATIONS = ("process", "shared")
NO_HUGE_PAGES = "deskfleet-1-4k-pages"
PRECISION_PROPERTIES = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS",
                        "PERFORMANCE_HINT", "NUM_STREAMS", "DYNAMIC_QUANTIZATION_GROUP_SIZE")


@dataclass(frozen=True)
class RunRecord:
    """One timed generation."""

    decode_tok_s: float
    tokens: tuple[int, ...]
    prefill_s: float
    extra: dict[str, float] = field(default_factory=dict)


class Variant(Protocol):
    name: str

    def run(self) -> RunRecord: ...

    def close(self) -> None: ...


# Public methods: pure parts

def interleaved_order(names: Sequence[str], rounds: int, after: int = 0) -> list[tuple[int, str]]:
    """(round, variant) in the order they run: every variant once per round, each round starting one variant
    further along `names` (rounds.round_order), so that none always runs first or always follows the same one.
    `after`: untimed rounds run before in `names`' own order (a warm-up), which the rotation counts on from."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {list(names)}")
    return [(index, name) for index in range(rounds) for name in round_order(names, index + after)]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, mean, min, max and spread ((max - min) / median, in percent) of positive samples."""
    if not values:
        raise ValueError("no samples")
    median = statistics.median(values)
    return {
        "median": round(median, 3),
        "mean": round(statistics.fmean(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "spread_pct": round(100.0 * (max(values) - min(values)) / median, 2) if median else None,
        "samples": [round(value, 3) for value in values],
    }


def compare(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """The ratio of medians, and the median, min and max of the per-round ratios (rounds are paired)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("compare needs the same non-zero number of samples on both sides")
    paired = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {
        "ratio_of_medians": round(statistics.median(numerator) / statistics.median(denominator), 4),
        "paired_median": round(statistics.median(paired), 4),
        "paired_min": round(min(paired), 4),
        "paired_max": round(max(paired), 4),
    }


def genai_variant_name(backend: str) -> str:
    """"genai" for GenAI's default attention backend, "genai-sdpa" / "genai-pa" for a chosen one."""
    return "genai" if backend == "default" else f"genai-{backend.lower()}"


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter length if one is a prefix), else None."""
    for index, (left, right) in enumerate(zip(a, b, strict=False)):
        if left != right:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_prompt(vocab_size: int, length: int, bos_token_id: int | None, seed: int = 1234) -> list[int]:
    """A fixed pseudo-random prompt (BOS first when the model has one), of ordinary (non-special) ids."""
    if length < 1:
        raise ValueError(f"prompt_tokens must be at least 1, got {length}")
    low = min(3, vocab_size - 1)
    ids = np.random.default_rng(seed).integers(low, vocab_size, size=length).tolist()
    if bos_token_id is not None:
        ids[0] = bos_token_id
    return [int(token) for token in ids]


def run_rounds(variants: Sequence[Variant], rounds: int, warmup: int = 1,
               on_run: Callable[[int, str, RunRecord], None] | None = None) -> dict[str, list[RunRecord]]:
    """Warm every variant up, then run them in interleaved rounds; records per variant in round order."""
    by_name = {variant.name: variant for variant in variants}
    for _ in range(warmup):
        for variant in variants:
            variant.run()
    records: dict[str, list[RunRecord]] = {variant.name: [] for variant in variants}
    for index, name in interleaved_order(list(by_name), rounds, after=warmup):
        record = by_name[name].run()
        records[name].append(record)
        if on_run is not None:
            on_run(index, name, record)
    return records


def build_report(records: dict[str, list[RunRecord]], stage_counts: Sequence[int], meta: dict[str, Any]
                 ) -> dict[str, Any]:
    """The JSON report: per-variant statistics, the deskfleet/GenAI ratio, k-stage costs and breakdown."""
    speeds = {name: [record.decode_tok_s for record in runs] for name, runs in records.items()}
    report: dict[str, Any] = dict(meta)
    report["decode_tok_s"] = {name: summarize(values) for name, values in speeds.items()}
    report["prefill_s_median"] = {name: round(statistics.median(record.prefill_s for record in runs), 4)
                                  for name, runs in records.items()}
    base = "deskfleet-1"
    genai = [name for name in speeds if name.startswith("genai")]
    if genai:
        report["deskfleet_vs_genai"] = {name: compare(speeds[base], speeds[name]) for name in genai}
        fastest = max(genai, key=lambda name: statistics.median(speeds[name]))
        report["deskfleet_vs_fastest_genai"] = dict(report["deskfleet_vs_genai"][fastest], genai=fastest,
                                                    goal=">= 1.00")
    report["stages_vs_1"] = {str(k): compare(speeds[f"deskfleet-{k}"], speeds[base]) for k in stage_counts
                             if k != 1 and f"deskfleet-{k}" in speeds}
    for entry in report["stages_vs_1"].values():
        entry["cost_pct"] = round(100.0 * (1.0 - entry["ratio_of_medians"]), 2)
    breakdown: dict[str, Any] = {}
    pairs = {"pipeline_vs_direct (deskfleet-1 / fused-direct)": (base, "fused-direct"),
             "fused_vs_whole (fused-direct / whole-direct)": ("fused-direct", "whole-direct"),
             "python_loop_vs_genai_sdpa (whole-direct / genai-sdpa)": ("whole-direct", "genai-sdpa"),
             f"huge_pages ({base} / {NO_HUGE_PAGES})": (base, NO_HUGE_PAGES)}
    for label, (left, right) in pairs.items():
        if left in speeds and right in speeds:
            breakdown[label] = compare(speeds[left], speeds[right])
    if breakdown:
        report["breakdown"] = breakdown
    reference = records[base][0].tokens
    report["tokens_match_deskfleet_1"] = {
        name: first_divergence(reference, runs[0].tokens) is None for name, runs in records.items() if name != base}
    divergence = {name: first_divergence(reference, runs[0].tokens) for name, runs in records.items()}
    report["first_divergence_from_deskfleet_1"] = {name: index for name, index in divergence.items()
                                                   if index is not None}
    return report


# Public methods: the benchmark

def run_parity_bench(model: Path, genai_model: Path | None = None, genai_python: Path | None = None,
                     prompt_tokens: int = 32, new_tokens: int = 64, rounds: int = 3,
                     stage_counts: Sequence[int] = (2, 3, 4), settings: CompileSettings | None = None,
                     genai_backends: Sequence[str] = ("default", "SDPA"), direct: bool = True,
                     isolation: str = "process", huge_pages_ablation: bool = False,
                     progress: bool = True) -> dict[str, Any]:
    """Run the parity benchmark and return its JSON-able report.

    `genai_model` is the same checkpoint exported by optimum-intel (`optimum-cli export openvino --task
    text-generation-with-past`); without it the GenAI and whole-model variants are skipped. `genai_python`
    is the python of a venv with openvino-genai (default: this one's). `genai_backends`: LLMPipeline's
    ATTENTION_BACKEND for each GenAI variant; "default" leaves GenAI's choice (PagedAttention on CPU in
    GenAI 2026), "SDPA" is the stateful path deskfleet's stages also take. `isolation`: see the module
    docstring. `huge_pages_ablation` (process isolation) adds deskfleet-1 without huge pages.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if huge_pages_ablation and isolation != "process":
        raise ValueError("the huge-pages ablation needs process isolation (the setting is per process)")
    check_at_least(1, prompt_tokens=prompt_tokens, rounds=rounds)
    check_at_least(2, new_tokens=new_tokens)  # decoding is timed from the second token (the runner failed on 1)
    model = Path(model)
    settings = settings or CompileSettings()
    manifest = load_manifest(model)
    spec = manifest.spec
    bad_stages = [k for k in stage_counts if not 1 <= k <= spec.num_layers]
    if bad_stages:
        raise ValueError(f"--stages {' '.join(map(str, bad_stages))}: a stage count must be between 1 and the "
                         f"model's {spec.num_layers} layers")
    check_genai_inputs(genai_model, genai_python)
    prompt = bench_prompt(spec.vocab_size, prompt_tokens, spec.bos_token_id)
    if prompt_tokens + new_tokens > spec.max_context:
        raise ValueError(f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} exceed the model's context "
                         f"of {spec.max_context} tokens")
    whole_xml = Path(genai_model) / "openvino_model.xml" if genai_model is not None else None
    if whole_xml is not None and direct and not whole_xml.is_file():
        raise FileNotFoundError(f"{whole_xml} not found: is {whole_xml.parent} an optimum-intel export?")
    variants: list[Variant] = []
    try:
        if isolation == "process":
            compiled, variants = _isolated_variants(model, genai_model, genai_python, whole_xml, prompt,
                                                    new_tokens, stage_counts, settings, genai_backends, direct,
                                                    huge_pages_ablation)
        else:
            compiled, variants = _shared_variants(model, manifest, genai_model, genai_python, whole_xml, prompt,
                                                  new_tokens, stage_counts, settings, genai_backends, direct)

        def show(index: int, name: str, record: RunRecord) -> None:
            if progress:
                print(f"round {index + 1}/{rounds} {name}: {record.decode_tok_s:.2f} tok/s", file=sys.stderr,
                      flush=True)

        started = time.perf_counter()
        records = run_rounds(variants, rounds, warmup=0 if isolation == "process" else 1, on_run=show)
        elapsed = time.perf_counter() - started
        genai_meta = {v.name: v.meta for v in variants
                      if isinstance(v, GenAIVariant | IsolatedVariant) and v.name.startswith("genai")} or None
    finally:
        for variant in variants:
            variant.close()

    meta: dict[str, Any] = {
        "model": str(model),
        "genai_model": str(genai_model) if genai_model is not None else None,
        "model_spec": {"layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
                       "kv_heads": spec.num_kv_heads, "intermediate": spec.intermediate_size,
                       "vocab": spec.vocab_size, "weights": manifest.weight_format.value,
                       "parameters_b": round(_parameter_count(manifest) / 1e9, 3)},
        "device": settings.device,
        "precision": settings.precision.value,
        "compiled_properties": compiled,
        "host": host_report(),
        "genai": genai_meta,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "isolation": isolation,
        "order": [variant.name for variant in variants],
        "bench_s": round(elapsed, 1),
    }
    return build_report(records, [k for k in stage_counts if k != 1], meta)


def _shared_variants(model: Path, manifest: Manifest, genai_model: Path | None, genai_python: Path | None,
                     whole_xml: Path | None, prompt: list[int], new_tokens: int, stage_counts: Sequence[int],
                     settings: CompileSettings, genai_backends: Sequence[str], direct: bool
                     ) -> tuple[dict[str, str], list[Variant]]:
    """deskfleet's variants loaded into this process, GenAI's in their runners (loaded once)."""
    variants: list[Variant] = []
    try:
        # The fused 1-stage model run directly is built first: deskfleet's compiled settings are read
        # off it and handed to GenAI, so that both run with the same precision, KV cache and threads.
        fused = FusedDirectVariant(model, manifest, settings, prompt, new_tokens)
        compiled = fused.compiled_properties
        variants.append(PipelineVariant(model, 1, settings, manifest, prompt, new_tokens))
        if genai_model is not None:
            for backend in genai_backends:
                variants.append(GenAIVariant(Path(genai_model), genai_python, settings.device,
                                             _genai_properties(compiled, backend), prompt, new_tokens,
                                             name=genai_variant_name(backend)))
        if direct:
            variants.append(fused)
            if whole_xml is not None:
                variants.append(WholeDirectVariant(whole_xml, settings, prompt, new_tokens))
        else:
            fused.close()
        for k in stage_counts:
            if k != 1:
                variants.append(PipelineVariant(model, k, settings, manifest, prompt, new_tokens))
    except BaseException:
        for variant in variants:
            variant.close()
        raise
    return compiled, variants


def _isolated_variants(model: Path, genai_model: Path | None, genai_python: Path | None, whole_xml: Path | None,
                       prompt: list[int], new_tokens: int, stage_counts: Sequence[int], settings: CompileSettings,
                       genai_backends: Sequence[str], direct: bool, huge_pages_ablation: bool
                       ) -> tuple[dict[str, str], list[Variant]]:
    """Every variant as an IsolatedVariant (a fresh process per run); deskfleet's compiled settings, for
    GenAI, come from loading deskfleet-1 once up front."""
    common = {"model": str(model), "prompt_ids": prompt, "new_tokens": new_tokens,
              "settings": {"device": settings.device, "precision": settings.precision.value,
                           "num_threads": settings.num_threads, "kv_cache": settings.kv_cache}}

    def deskfleet(name: str, config: dict[str, Any], environment: dict[str, str] | None = None) -> IsolatedVariant:
        return IsolatedVariant(name, DESKFLEET_RUNNER, None, {**common, **config}, environment)

    first = deskfleet("deskfleet-1", {"variant": "deskfleet", "stages": 1})
    compiled: dict[str, str] = first.load()["compiled_properties"]
    variants: list[Variant] = [first]
    if huge_pages_ablation:
        variants.append(deskfleet(NO_HUGE_PAGES, {"variant": "deskfleet", "stages": 1},
                                  {**os.environ, "DESKFLEET_HUGE_PAGES": "0"}))
    if genai_model is not None:
        for backend in genai_backends:
            config = {"model": str(genai_model), "device": settings.device,
                      "properties": _genai_properties(compiled, backend), "prompt_ids": prompt,
                      "new_tokens": new_tokens}
            variants.append(IsolatedVariant(genai_variant_name(backend), GENAI_RUNNER, genai_python, config,
                                            allocator.system_environment()))  # GenAI as it ships: glibc's malloc
    if direct:
        variants.append(deskfleet("fused-direct", {"variant": "fused-direct"}))
        if whole_xml is not None:
            variants.append(deskfleet("whole-direct", {"variant": "whole-direct", "whole_model_xml": str(whole_xml)}))
    for k in stage_counts:
        if k != 1:
            variants.append(deskfleet(f"deskfleet-{k}", {"variant": "deskfleet", "stages": k}))
    return compiled, variants


# Variants

class IsolatedVariant:
    """A variant run in a fresh process every time (a runner script speaking JSON lines: see
    parity_runner.py and genai_runner.py): start it, load, one untimed warm-up generation, one timed
    generation, quit. The process holds nothing but this variant's model."""

    def __init__(self, name: str, script: Path, python: Path | None, config: dict[str, Any],
                 environment: dict[str, str] | None = None) -> None:
        self.name = name
        self.script = script
        self.python = python
        self.config = config
        self.environment = environment
        self.meta: dict[str, Any] = {}

    def load(self) -> dict[str, Any]:
        """Start a process, load the variant and quit: its ready answer (load time, compiled settings)."""
        runner = RunnerProcess(self.script, self.python, self.environment)
        try:
            return self._start(runner)
        finally:
            runner.close("quit")

    def run(self) -> RunRecord:
        runner = RunnerProcess(self.script, self.python, self.environment)
        try:
            self._start(runner)
            runner.send_line("warm-up")
            runner.receive()  # first-call work (kernels for the prompt's shape) is not timed
            runner.send_line("run")
            reply = runner.receive()
        finally:
            runner.close("quit")
        return _record(reply)

    def close(self) -> None:
        pass  # nothing outlives run()

    def _start(self, runner: RunnerProcess) -> dict[str, Any]:
        ready = runner.start(json.dumps(self.config))
        self.meta = {key: value for key, value in ready.items() if key != "ready"}
        self.meta["python"] = runner.python
        self.meta["properties"] = self.config.get("properties")
        self.meta["load_s"] = round(float(ready.get("load_s", 0.0)), 2)
        return ready

class PipelineVariant:
    """deskfleet-K: a K-stage LocalPipeline and the Engine, as `deskfleet generate` runs them."""

    def __init__(self, model: Path, stages: int, settings: CompileSettings, manifest: Manifest,
                 prompt: list[int], new_tokens: int) -> None:
        self.name = f"deskfleet-{stages}"
        self.pipeline = LocalPipeline(model, stages, settings, manifest)
        self.prompt = prompt
        self.new_tokens = new_tokens

    def compiled_properties(self) -> dict[str, str]:
        return _read_properties(self.pipeline.stages[0].compiled)

    def run(self) -> RunRecord:
        tokens, decode_tok_s, prefill_s = _generate_once(self.pipeline, self.prompt, self.new_tokens)
        return RunRecord(decode_tok_s, tuple(tokens), prefill_s)

    def close(self) -> None:
        self.pipeline.close()


class _DirectLoop:
    """Greedy decoding with a plain infer loop on one stateful request; subclasses say how to infer."""

    name = "direct"

    def __init__(self, prompt: list[int], new_tokens: int) -> None:
        self.prompt = prompt
        self.new_tokens = new_tokens

    def step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def run(self) -> RunRecord:
        self.reset()
        length = len(self.prompt)
        started = time.perf_counter()
        token = self.step(np.array([self.prompt], dtype=np.int64), np.ones((1, length), dtype=np.int64),
                          np.arange(length, dtype=np.int64)[None, :])
        prefilled = time.perf_counter()
        tokens = [token]
        while len(tokens) < self.new_tokens:
            length += 1
            token = self.step(np.array([[token]], dtype=np.int64), np.ones((1, length), dtype=np.int64),
                              np.array([[length - 1]], dtype=np.int64))
            tokens.append(token)
        finished = time.perf_counter()
        decode_s = finished - prefilled
        return RunRecord((len(tokens) - 1) / decode_s if decode_s > 0 else 0.0, tuple(tokens),
                         prefilled - started)

    def close(self) -> None:
        pass


class FusedDirectVariant(_DirectLoop):
    """The fused 1-stage model (the same ov.Model deskfleet-1 runs), without thread and queues."""

    name = "fused-direct"

    def __init__(self, model: Path, manifest: Manifest, settings: CompileSettings, prompt: list[int],
                 new_tokens: int) -> None:
        super().__init__(prompt, new_tokens)
        layers = LayerRange(0, manifest.spec.num_layers, manifest.spec.num_layers)
        stage = Stage(model, manifest, layers, settings)
        self.compiled_properties = _read_properties(stage.compiled)
        self.session: StageSession | None = stage.open_session()
        self.beam = np.zeros(1, dtype=np.int32)

    def reset(self) -> None:
        assert self.session is not None
        self.session.reset()

    def close(self) -> None:
        self.session = None  # frees the compiled model when nothing else holds it

    def step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> int:
        assert self.session is not None
        output = self.session.forward(ids, mask, positions, self.beam)
        assert output.next_tokens is not None
        return int(output.next_tokens[0, -1])


class WholeDirectVariant(_DirectLoop):
    """optimum-intel's whole-model stateful IR, on this runtime, with the same loop (argmax in numpy)."""

    name = "whole-direct"

    def __init__(self, xml: Path, settings: CompileSettings, prompt: list[int], new_tokens: int) -> None:
        super().__init__(prompt, new_tokens)
        core = openvino_core()
        compiled = core.compile_model(core.read_model(xml), settings.device, settings.properties())
        self.request = compiled.create_infer_request()
        self.inputs = {port.get_any_name() for port in compiled.inputs}
        self.beam = np.zeros(1, dtype=np.int32)

    def reset(self) -> None:
        self.request.reset_state()

    def step(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> int:
        feed = {"input_ids": ids, "attention_mask": mask}
        if "position_ids" in self.inputs:
            feed["position_ids"] = positions
        if "beam_idx" in self.inputs:
            feed["beam_idx"] = self.beam
        self.request.infer(feed)
        logits = self.request.get_tensor("logits").data
        return int(np.argmax(logits[0, -1]))


class GenAIVariant:
    """OpenVINO GenAI's LLMPipeline in a subprocess of the GenAI venv (genai_runner.py)."""

    def __init__(self, model: Path, python: Path | None, device: str, properties: dict[str, str],
                 prompt: list[int], new_tokens: int, name: str = "genai") -> None:
        self.name = name
        if not model.is_dir():
            raise FileNotFoundError(f"GenAI model folder {model} not found")
        # GenAI as it ships: glibc's malloc
        self.runner = RunnerProcess(GENAI_RUNNER, python, allocator.system_environment())
        ready = self.runner.start(json.dumps({"model": str(model), "device": device, "properties": properties,
                                              "prompt_ids": prompt, "new_tokens": new_tokens}))
        self.meta: dict[str, Any] = {"properties": properties, "load_s": round(ready.get("load_s", 0.0), 2),
                                     "versions": ready.get("versions"), "python": self.runner.python}

    def run(self) -> RunRecord:
        self.runner.send_line("run")
        return _record(self.runner.receive())

    def close(self) -> None:
        self.runner.close("quit")


# Private methods

def _record(reply: dict[str, Any]) -> RunRecord:
    """A runner's answer to "run" (deskfleet's reports prefill_s, GenAI's ttft_s) as a RunRecord."""
    keys = ("wall_decode_tok_s", "tpot_ms", "generate_s")
    extra: dict[str, float] = {key: float(reply[key]) for key in keys if key in reply}
    prefill = reply["prefill_s"] if "prefill_s" in reply else reply["ttft_s"]
    return RunRecord(float(reply["decode_tok_s"]), tuple(int(token) for token in reply["tokens"]), float(prefill),
                     extra)


def _generate_once(pipeline: LocalPipeline, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, decode tok/s, time to the first token) of one greedy stream, EOS ignored, through the
    Engine that `deskfleet generate` uses."""
    engine = Engine(pipeline, pipeline.manifest.spec)
    engine.add(StreamRequest(list(prompt), max_new_tokens=new_tokens, ignore_eos=True))
    (stream,) = engine.run().values()
    if stream.decode_tok_s is None:
        raise ValueError(f"a parity run needs at least 2 new tokens to time decoding, got {new_tokens}")
    return list(stream.tokens), stream.decode_tok_s, float(stream.first_token_s)


def _read_properties(compiled: Any) -> dict[str, str]:
    """The compiled model's precision, KV-cache, thread and hint settings, in the form properties take."""
    values = {}
    for name in PRECISION_PROPERTIES:
        try:
            value = compiled.get_property(name)
        except RuntimeError:
            continue
        if hasattr(value, "to_string"):  # ov.Type: bf16, f32, u8, ...
            value = value.to_string()
        elif hasattr(value, "name"):  # an enum such as PerformanceMode.LATENCY
            value = value.name
        values[name] = str(value)
    return values


def _genai_properties(compiled: dict[str, str], backend: str) -> dict[str, str]:
    """What deskfleet's compiled stage actually runs with, passed to LLMPipeline explicitly."""
    wanted = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS", "PERFORMANCE_HINT",
              "DYNAMIC_QUANTIZATION_GROUP_SIZE")
    properties = {name: compiled[name] for name in wanted if name in compiled}
    if backend != "default":
        properties["ATTENTION_BACKEND"] = backend
    return properties


def _parameter_count(manifest: Manifest) -> int:
    spec = manifest.spec
    attention = spec.hidden_size * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
    mlp = 3 * spec.hidden_size * spec.intermediate_size
    vocab = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * (attention + mlp) + vocab
