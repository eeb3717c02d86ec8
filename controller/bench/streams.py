"""`deskfleet bench streams`: concurrent users on ONE core, deskfleet's engine vs GenAI's continuous batching.

Both sides run one stage / one pipeline with INFERENCE_NUM_THREADS=1, with the process (every thread of
it) pinned to the same single core (os.sched_setaffinity), and the same weights (deskfleet's per-layer
export and optimum-intel's export of one checkpoint). For each user count N, N users arrive at once,
each with its own prompt of `prompt_tokens` ids, and each gets exactly `new_tokens` greedy tokens (EOS
ignored). Aggregate tok/s = all generated tokens / wall time from the first request to the last token
(prefill included, on both sides alike).

    deskfleet  LocalPipeline (1 stage) + Engine: the N streams are rows of one micro-batch, each prefilled
               alone and merged into the batch state (what `deskfleet generate --prompt ... x N` runs)
    genai      ContinuousBatchingPipeline in a subprocess of the GenAI venv (genai_cb_runner.py): N client
               threads call add_request, one thread calls step() until every request is done

Memory per extra stream: the KV bytes one stream's context takes (from the model's shape and the KV-cache
precision deskfleet's stage compiled with), and the measured peak-RSS growth per extra user, on both
sides, from a first pass that runs N ascending before any other run (so that no bigger run came before; peak RSS
is reset before each run through /proc/self/clear_refs).
Then timed rounds, interleaved (N=1 deskfleet, N=1 genai, N=2 deskfleet, ...), medians and spreads.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deskfleet.agent import allocator
from deskfleet.agent.stage import CompileSettings
from deskfleet.common.model_spec import Manifest, load_manifest

from .arguments import check_at_least, check_genai_inputs
from .host import host_report
from .parity import _genai_properties, _read_properties, bench_prompt, compare, summarize
from .rounds import round_order
from .runner_process import RunnerProcess

GENAI_CB_RUNNER = Path(__file__).with_name("genai_cb_runner.py")
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "u8": 1.0, "i8": 1.0, "u4": 0.5, "i4": 0.5}


@dataclass(frozen=True)
class UsersRun:
    """One run of N concurrent users."""

    tokens: list[list[int]]
    wall_s: float
    first_token_s: list[float]
    peak_rss_bytes: int

    @property
    def generated(self) -> int:
        return sum(len(tokens) for tokens in self.tokens)

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0


# Public methods: pure parts

def pin_process(cores: set[int]) -> None:
    """Pin every thread of this process (and so every thread it starts later) to `cores`."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, PermissionError):
            continue
    os.sched_setaffinity(0, cores)


def pick_core(requested: int | None) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    if requested is None:
        return allowed[-1]
    if requested not in allowed:
        raise ValueError(f"--core {requested} is not a core this process may run on (it may run on "
                         f"{', '.join(map(str, allowed))})")
    return requested


def user_prompts(vocab_size: int, users: int, length: int, bos_token_id: int | None) -> list[list[int]]:
    """One fixed pseudo-random prompt per user (the same for a given user index at every user count)."""
    return [bench_prompt(vocab_size, length, bos_token_id, seed=1000 + user) for user in range(users)]


def kv_bytes_per_token(manifest: Manifest, kv_precision: str | None) -> float:
    """Key + value bytes one token of one stream takes in every layer's cache."""
    spec = manifest.spec
    element = KV_BYTES.get((kv_precision or "f32").lower(), 4.0)
    return 2.0 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element


def per_extra_stream(peaks: dict[int, int]) -> float | None:
    """Peak-RSS growth per extra user between the fewest and the most users (bytes), or None."""
    if len(peaks) < 2:
        return None
    low, high = min(peaks), max(peaks)
    return (peaks[high] - peaks[low]) / (high - low)


def build_report(timed: dict[str, dict[int, list[UsersRun]]], memory: dict[str, dict[int, int]],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """Per user count: each side's aggregate tok/s, deskfleet/genai, and memory figures."""
    report: dict[str, Any] = dict(meta)
    per_users: dict[str, Any] = {}
    counts = sorted({users for runs in timed.values() for users in runs})
    for users in counts:
        entry: dict[str, Any] = {}
        speeds = {side: [run.tok_s for run in runs[users]] for side, runs in timed.items() if users in runs}
        entry["tok_s"] = {side: summarize(values) for side, values in speeds.items()}
        entry["first_token_s_median"] = {
            side: round(statistics.median(t for run in runs[users] for t in run.first_token_s), 3)
            for side, runs in timed.items() if users in runs}
        if "deskfleet" in speeds and "genai" in speeds:
            entry["deskfleet_vs_genai"] = compare(speeds["deskfleet"], speeds["genai"])
            entry["goal_met"] = entry["deskfleet_vs_genai"]["ratio_of_medians"] >= 1.0
        per_users[str(users)] = entry
    report["users"] = per_users
    if "deskfleet" in timed and 1 in timed["deskfleet"]:
        one = statistics.median(run.tok_s for run in timed["deskfleet"][1])
        report["deskfleet_scaling_vs_1_user"] = {
            str(users): round(statistics.median(run.tok_s for run in runs) / one, 3)
            for users, runs in timed["deskfleet"].items()}
    report["memory"] = {
        "peak_rss_mb": {side: {str(users): round(peak / 2**20, 1) for users, peak in sorted(peaks.items())}
                        for side, peaks in memory.items()},
        "rss_per_extra_stream_mb": {side: (round(value / 2**20, 2) if value is not None else None)
                                    for side, peaks in memory.items() for value in [per_extra_stream(peaks)]},
    }
    goals = [entry["goal_met"] for entry in per_users.values() if "goal_met" in entry]
    report["goal"] = "deskfleet >= 1.0x GenAI ContinuousBatchingPipeline at every user count"
    report["goal_met"] = all(goals) if goals else None
    return report


# Public methods: the benchmark

def run_streams_bench(model: Path, genai_model: Path | None = None, genai_python: Path | None = None,
                      users: Sequence[int] = (1, 2, 4, 8), prompt_tokens: int = 32, new_tokens: int = 64,
                      rounds: int = 3, core: int | None = None, settings: CompileSettings | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """Run the streams benchmark and return its JSON-able report (GenAI skipped without genai_model).

    This process runs pinned to one core meanwhile; its former affinity is restored at the end.
    """
    if not users or min(users) < 1:
        raise ValueError(f"--users values must be 1 or more, got {list(users)}")
    check_at_least(1, prompt_tokens=prompt_tokens, new_tokens=new_tokens, rounds=rounds)
    if settings is not None and settings.num_threads not in (None, 1):
        raise ValueError(f"--threads {settings.num_threads}: this bench runs one inference thread on one core "
                         "(--core), both sides")
    check_genai_inputs(genai_model, genai_python)  # not only after deskfleet's memory pass
    core = pick_core(core)
    allowed = os.sched_getaffinity(0)
    pin_process({core})
    try:
        return _run_pinned(model, genai_model, genai_python, users, prompt_tokens, new_tokens, rounds, core,
                           settings, progress)
    finally:
        pin_process(allowed)


def _run_pinned(model: Path, genai_model: Path | None, genai_python: Path | None, users: Sequence[int],
                prompt_tokens: int, new_tokens: int, rounds: int, core: int, settings: CompileSettings | None,
                progress: bool) -> dict[str, Any]:
    base = settings or CompileSettings()
    settings = replace(base, num_threads=1)
    model = Path(model)
    manifest = load_manifest(model)
    spec = manifest.spec
    if prompt_tokens + new_tokens > spec.max_context:
        raise ValueError(f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} exceed the model's context "
                         f"of {spec.max_context} tokens")
    counts = sorted(set(users))
    prompts = user_prompts(spec.vocab_size, max(counts), prompt_tokens, spec.bos_token_id)
    started = time.perf_counter()

    def show(label: str, run: UsersRun) -> None:
        if progress:
            print(f"{label}: {run.tok_s:.2f} tok/s ({run.generated} tokens in {run.wall_s:.2f} s, peak RSS "
                  f"{run.peak_rss_bytes / 2**20:.0f} MB)", file=sys.stderr, flush=True)

    # Memory pass (also the warm-up): N ascending, before any other run of that side.
    memory: dict[str, dict[int, int]] = {"deskfleet": {}}
    deskfleet = DeskfleetUsers(model, manifest, settings, max(counts), new_tokens)
    compiled = deskfleet.compiled_properties
    genai: GenAIUsers | None = None
    try:
        for count in counts:
            run = deskfleet.run(prompts[:count])
            memory["deskfleet"][count] = run.peak_rss_bytes
            show(f"memory pass deskfleet {count} users", run)
        if genai_model is not None:
            properties = _genai_properties(compiled, "default")
            properties["INFERENCE_NUM_THREADS"] = "1"
            genai = GenAIUsers(Path(genai_model), genai_python, settings.device, properties, new_tokens, {core})
            memory["genai"] = {}
            for count in counts:
                run = genai.run(prompts[:count])
                memory["genai"][count] = run.peak_rss_bytes
                show(f"memory pass genai {count} users", run)
        timed: dict[str, dict[int, list[UsersRun]]] = {"deskfleet": {n: [] for n in counts}}
        if genai is not None:
            timed["genai"] = {n: [] for n in counts}
        for index in range(rounds):
            for count in counts:
                for side, runner in round_order((("deskfleet", deskfleet), ("genai", genai)), index):
                    if runner is None:
                        continue
                    run = runner.run(prompts[:count])
                    timed[side][count].append(run)
                    show(f"round {index + 1}/{rounds} {side} {count} users", run)
        genai_meta = genai.meta if genai is not None else None
        tokens_match = None
        if genai is not None:
            tokens_match = {str(n): [a == b for a, b in zip(timed["deskfleet"][n][0].tokens,
                                                             timed["genai"][n][0].tokens, strict=True)]
                            for n in counts}
    finally:
        deskfleet.close()
        if genai is not None:
            genai.close()
    kv_token = kv_bytes_per_token(manifest, compiled.get("KV_CACHE_PRECISION"))
    meta: dict[str, Any] = {
        "model": str(model),
        "genai_model": str(genai_model) if genai_model is not None else None,
        "model_spec": {"layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
                       "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab_size,
                       "weights": manifest.weight_format.value},
        "core": core,
        "compiled_properties": compiled,
        "genai": genai_meta,
        "host": host_report(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "kv_bytes_per_stream": {"per_token": kv_token,
                                "at_full_length_mb": round(kv_token * (prompt_tokens + new_tokens) / 2**20, 3),
                                "kv_cache_precision": compiled.get("KV_CACHE_PRECISION")},
        "greedy_tokens_match_genai_per_user": tokens_match,
    }
    report = build_report(timed, memory, meta)
    report["bench_s"] = round(time.perf_counter() - started, 1)
    return report


# Sides

class DeskfleetUsers:
    """N users as N streams of one Engine run on a 1-stage LocalPipeline (reused between runs)."""

    def __init__(self, model: Path, manifest: Manifest, settings: CompileSettings, max_rows: int,
                 new_tokens: int) -> None:
        from deskfleet.controller.pipeline import LocalPipeline

        self.manifest = manifest
        self.pipeline = LocalPipeline(model, 1, settings, manifest)
        self.max_rows = max_rows
        self.new_tokens = new_tokens
        stage = self.pipeline.stages[0]  # the compiled stage, for its settings only
        self.compiled_properties = _read_properties(stage.compiled)

    def run(self, prompts: list[list[int]]) -> UsersRun:
        from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest

        _reset_peak_rss()
        engine = Engine(self.pipeline, self.manifest.spec, None, EngineOptions(max_rows=self.max_rows,
                                                                               micro_batches=1))
        for prompt in prompts:
            engine.add(StreamRequest(list(prompt), max_new_tokens=self.new_tokens, ignore_eos=True))
        started = time.perf_counter()
        results = engine.run()
        wall = time.perf_counter() - started
        ordered = [results[index] for index in range(len(prompts))]
        return UsersRun([result.tokens for result in ordered], wall, [result.first_token_s for result in ordered],
                        _peak_rss())

    def close(self) -> None:
        self.pipeline.close()


class GenAIUsers:
    """ContinuousBatchingPipeline in a subprocess of the GenAI venv, pinned to the same cores."""

    def __init__(self, model: Path, python: Path | None, device: str, properties: dict[str, str],
                 new_tokens: int, cores: set[int]) -> None:
        if not model.is_dir():
            raise FileNotFoundError(f"GenAI model folder {model} not found")
        environment = allocator.system_environment()  # GenAI as it ships: glibc's malloc
        environment["DESKFLEET_BENCH_CORES"] = ",".join(str(core) for core in sorted(cores))
        self.runner = RunnerProcess(GENAI_CB_RUNNER, python, environment)
        ready = self.runner.start(json.dumps({"model": str(model), "device": device, "properties": properties,
                                              "new_tokens": new_tokens}))
        self.meta: dict[str, Any] = {"properties": properties, "load_s": round(ready.get("load_s", 0.0), 2),
                                     "affinity": ready.get("affinity"), "versions": ready.get("versions"),
                                     "python": self.runner.python}

    def run(self, prompts: list[list[int]]) -> UsersRun:
        self.runner.send_line(json.dumps({"run": prompts}))
        reply = self.runner.receive()
        return UsersRun(reply["tokens"], float(reply["wall_s"]), [float(t) for t in reply["first_token_s"]],
                        int(reply["peak_rss_bytes"]))

    def close(self) -> None:
        self.runner.close(json.dumps("quit"))


# Private methods

def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
