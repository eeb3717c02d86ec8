"""EngineTimings: where a run's driver thread spent its time (what `bench fleet` reports beside each
configuration's tok/s), measured against a chain that takes a known time per step."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.bench.fleet import _driver_times
from deskfleet.controller.engine import Engine, EngineOptions, EngineTimings, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft

F32 = CompileSettings(precision=Precision.F32)
STEP_DELAY_S = 0.01
# repeats itself, so prompt lookup proposes in most rounds
PROMPT = [1, 17, 99, 230, 5, 17, 99, 230, 5, 17, 99, 230, 5, 17, 99]


class SlowChain:
    """A LocalPipeline whose every result comes STEP_DELAY_S after it is asked for."""

    def __init__(self, pipeline: LocalPipeline) -> None:
        self.pipeline = pipeline
        self.steps = 0

    def submit(self, message: Forward) -> None:
        self.steps += 1
        self.pipeline.submit(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        time.sleep(STEP_DELAY_S)
        return self.pipeline.collect(timeout)

    def release(self, batch_id: int) -> None:
        self.pipeline.release(batch_id)

    def renumber(self) -> None:
        self.pipeline.renumber()


def run(target: Path, drafted: bool) -> tuple[Engine, SlowChain, float]:
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        chain = SlowChain(pipeline)
        engine = Engine(chain, manifest.spec, PromptLookupDraft(min_ngram=1) if drafted else None,
                        EngineOptions(fixed_k=3))
        engine.add(StreamRequest(PROMPT, max_new_tokens=24, ignore_eos=True))
        started = time.perf_counter()
        engine.run()
        return engine, chain, time.perf_counter() - started


def test_a_drafted_run_counts_its_rounds_waits_and_proposals(target: Path) -> None:
    engine, chain, wall = run(target, drafted=True)
    timings = engine.timings
    histogram = engine.accepted_histogram()
    assert timings.drafted_rounds == sum(histogram.values()) > 0  # one stream: every verified round
    assert timings.wait_seconds >= chain.steps * STEP_DELAY_S  # every collect slept that long
    assert timings.wait_seconds <= wall
    assert timings.round_trip_seconds >= timings.drafted_rounds * STEP_DELAY_S
    assert 0.0 < timings.draft_seconds < wall


def test_a_plain_run_drafts_nothing(target: Path) -> None:
    engine, chain, wall = run(target, drafted=False)
    assert engine.timings.drafted_rounds == 0 and engine.timings.draft_seconds == 0.0
    assert engine.timings.round_trip_seconds == 0.0
    assert chain.steps * STEP_DELAY_S <= engine.timings.wait_seconds <= wall


def test_the_bench_reports_shares_of_the_wall_over_all_engines() -> None:
    engines = [SimpleNamespace(timings=EngineTimings(draft_seconds=0.5, wait_seconds=1.0, drafted_rounds=10,
                                                     round_trip_seconds=0.2)),
               SimpleNamespace(timings=EngineTimings(draft_seconds=0.5, wait_seconds=2.0, drafted_rounds=30,
                                                     round_trip_seconds=0.6))]
    assert _driver_times(engines, 4.0) == pytest.approx(
        {"draft_share": 0.25, "wait_share": 0.75, "round_trip_ms": 20.0})
    plain = [SimpleNamespace(timings=EngineTimings())]
    assert _driver_times(plain, 1.0) == {"draft_share": 0.0, "wait_share": 0.0,
                                         "round_trip_ms": 0.0}
    assert _driver_times(plain, 0.0)["wait_share"] == 0.0
