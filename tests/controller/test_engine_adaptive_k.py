"""Adaptive K over a chain with several micro-batches in flight: the driver drafts for all of them, so K is
chosen with its share of the round, and the chain's round trip is timed to the result's arrival, not to when
the busy driver got round to it. Against a chain with a known latency and a drafter with a known cost a token."""

from __future__ import annotations

import heapq
import itertools
import time
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.draft import DraftModel, DraftRow, Proposal
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline

F32 = CompileSettings(precision=Precision.F32)
PROMPTS = [[1, 17, 99, 230, 5], [1, 8, 8, 3], [1, 77, 78, 79], [1, 300, 301, 302]]


class LatentChain:
    """A LocalPipeline (one stage, computed at submit) whose each result arrives `latency_s` after its step was
    sent, as over a network: collect() waits for the earliest due and stamps `last_arrival_s` with when it
    became due, however late the driver collects it."""

    def __init__(self, pipeline: LocalPipeline, latency_s: float) -> None:
        self.pipeline = pipeline
        self.latency_s = latency_s
        self.last_arrival_s = 0.0
        self._due: list[tuple[float, int, ForwardResult]] = []
        self._order = itertools.count()

    def submit(self, message: Forward) -> None:
        self.pipeline.submit(message)
        result = self.pipeline.collect()
        heapq.heappush(self._due, (time.perf_counter() + self.latency_s, next(self._order), result))

    def collect(self, timeout: float | None = None) -> ForwardResult:
        due, _, result = heapq.heappop(self._due)
        time.sleep(max(due - time.perf_counter(), 0.0))
        self.last_arrival_s = due
        return result

    def release(self, batch_id: int) -> None:
        self.pipeline.release(batch_id)


class CostlyDraft(DraftModel):
    """The target drafting for itself (every token accepted), at `seconds_per_token` of the driver's time a token."""

    def __init__(self, model_dir: Path, seconds_per_token: float) -> None:
        super().__init__(model_dir, F32)
        self.seconds_per_token = seconds_per_token

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        started = time.perf_counter()
        proposal = super().propose(micro_batch_id, rows)
        time.sleep(max(self.seconds_per_token * max(row.k for row in rows) - (time.perf_counter() - started), 0.0))
        return Proposal(proposal.tokens, proposal.probs, time.perf_counter() - started, proposal.one_hot)


def final_k(target: Path, streams: int, latency_s: float, draft_s: float) -> tuple[int, float]:
    """K at the end of a run of `streams` one-row micro-batches, and the mean measured round trip."""
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(LatentChain(pipeline, latency_s), manifest.spec, CostlyDraft(target, draft_s),
                        EngineOptions(max_rows=1, micro_batches=streams, k_min=1, k_max=8))
        for prompt in PROMPTS[:streams]:
            engine.add(StreamRequest(prompt, max_new_tokens=60, ignore_eos=True))
        engine.run()
    timings = engine.timings
    return engine.k_policy.k, timings.round_trip_seconds / max(timings.drafted_rounds, 1)


def test_a_driver_drafting_for_four_micro_batches_keeps_k_short(target: Path) -> None:
    # Four micro-batches over a fast chain (5 ms) with drafting dear (4 ms a token): every unit of K costs each
    # round four draft steps of the one driver, so a long K only slows everyone; by the latency alone (a
    # result waiting for the driver read as a slow chain) K ran to its bound.
    k, round_trip = final_k(target, streams=4, latency_s=0.005, draft_s=0.004)
    assert k <= 2
    assert round_trip < 0.012  # the chain's 5 ms (plus the host's noise), not the wait for the busy driver


def test_one_micro_batch_over_a_slow_chain_still_drafts_long(target: Path) -> None:
    # One micro-batch, a 60 ms chain, cheap drafting (0.5 ms a token), every token accepted: the latency bound
    # holds and a long K pays.
    k, round_trip = final_k(target, streams=1, latency_s=0.06, draft_s=0.0005)
    assert k == 8
    assert round_trip == pytest.approx(0.06, abs=0.02)
