"""A chain that breaks mid-run: with `recover`, every stream resumes on the new chain and its tokens equal an
uninterrupted run (f32, greedy; drafted or not, staggered arrivals, several micro-batches); without it, or
when recovery gives up, the error reaches the caller."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import SamplingParams
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.draft import Drafter, DraftModel
from deskfleet.controller.engine import ChainBroken, Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft
from tests.controller.test_engine import PROMPTS as ENGINE_PROMPTS

F32 = CompileSettings(precision=Precision.F32)
PROMPTS = ENGINE_PROMPTS[:6]
LENGTHS = [30, 12, 30, 5, 24, 30]


class BreakingChain:
    """A local pipeline that breaks (like a fleet whose PC died) at its `break_at`-th collect."""

    def __init__(self, pipeline: LocalPipeline, break_at: int | None) -> None:
        self.pipeline = pipeline
        self.break_at = break_at
        self.collected = 0
        self.broken = False

    def submit(self, message: Forward) -> None:
        if self.broken:
            raise ChainBroken("the chain is broken")
        self.pipeline.submit(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        if self.broken or self.collected == self.break_at:
            self.broken = True
            raise ChainBroken(f"stage 1 stopped answering after {self.collected} steps")
        self.collected += 1
        return self.pipeline.collect(timeout)

    def release(self, batch_id: int) -> None:
        if not self.broken:
            self.pipeline.release(batch_id)

    def renumber(self) -> None:
        self.pipeline.renumber()


def _requests(speculative: bool = False, sampling: SamplingParams | None = None) -> list[StreamRequest]:
    return [StreamRequest(prompt, max_new_tokens=LENGTHS[index], ignore_eos=True, speculative=speculative,
                          arrival_step=2 * index, sampling=sampling or SamplingParams(temperature=0.0),
                          seed=100 + index)
            for index, prompt in enumerate(PROMPTS)]


def _run(model: Path, break_at: list[int | None], drafter: Drafter | None = None, speculative: bool = False,
         options: EngineOptions | None = None, sampling: SamplingParams | None = None
         ) -> tuple[list[list[int]], Engine]:
    """Run on 2 stages; each time the chain breaks, resume on a fresh pipeline of 1, then 3, ... stages
    that breaks at the next entry of `break_at`."""
    manifest = load_manifest(model)
    breaks: Iterator[int | None] = iter(break_at)
    stages = iter([2, 1, 3, 2])
    with ExitStack() as pipelines:
        def chain() -> BreakingChain:
            pipeline = pipelines.enter_context(LocalPipeline(model, next(stages), F32, manifest))
            return BreakingChain(pipeline, next(breaks, None))

        engine = Engine(chain(), manifest.spec, drafter, options or EngineOptions(max_rows=2, micro_batches=2))
        for request in _requests(speculative, sampling):
            engine.add(request)
        results = engine.run(recover=lambda error: chain())
    return [results[index].tokens for index in range(len(PROMPTS))], engine


@pytest.fixture(scope="module")
def uninterrupted(target: Path) -> list[list[int]]:
    tokens, engine = _run(target, [None])
    assert not engine.failovers
    return tokens


@pytest.mark.parametrize("break_at", [[1], [9], [25], [9, 4]])
def test_streams_resume_on_the_new_chain_with_the_same_tokens(target: Path, uninterrupted: list[list[int]],
                                                              break_at: list[int]) -> None:
    tokens, engine = _run(target, break_at)
    assert tokens == uninterrupted
    assert [failover.after_steps for failover in engine.failovers] == list(itertools.accumulate(break_at))
    assert all(failover.resumed_streams > 0 for failover in engine.failovers)
    assert "stopped answering" in engine.failovers[0].error


@pytest.mark.parametrize("drafter_kind", ["draft model", "prompt lookup"])
def test_drafted_streams_resume_with_the_same_tokens(target: Path, other_draft: Path, uninterrupted: list[list[int]],
                                                     drafter_kind: str) -> None:
    drafter: Drafter = DraftModel(other_draft, F32) if drafter_kind == "draft model" else PromptLookupDraft()
    tokens, engine = _run(target, [7], drafter, speculative=True, options=EngineOptions(max_rows=2, micro_batches=2,
                                                                                         fixed_k=3))
    assert tokens == uninterrupted
    assert len(engine.failovers) == 1


@pytest.mark.parametrize("break_at", [[3], [9, 4]])
def test_sampled_streams_resume_with_the_draws_of_an_uninterrupted_run(target: Path, break_at: list[int]) -> None:
    # Seeds follow the position sampled, so the resumed prefill draws what the lost step would have drawn
    # (keyed by the micro-batch's position, it drew again what the stream's first token had drawn).
    sampling = SamplingParams(temperature=1.5)
    uninterrupted, _ = _run(target, [None], sampling=sampling)
    tokens, engine = _run(target, break_at, sampling=sampling)
    assert len(engine.failovers) == len(break_at)
    assert tokens == uninterrupted


def test_without_recover_the_break_reaches_the_caller(target: Path) -> None:
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(BreakingChain(pipeline, 3), manifest.spec)
        engine.add(StreamRequest(PROMPTS[0], max_new_tokens=10, ignore_eos=True))
        with pytest.raises(ChainBroken, match="after 3 steps"):
            engine.run()


def test_a_recovery_that_gives_up_reaches_the_caller(target: Path) -> None:
    manifest = load_manifest(target)

    def give_up(error: ChainBroken) -> BreakingChain:
        raise RuntimeError(f"no agent left to re-plan on ({error})")

    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(BreakingChain(pipeline, 3), manifest.spec)
        engine.add(StreamRequest(PROMPTS[0], max_new_tokens=10, ignore_eos=True))
        with pytest.raises(RuntimeError, match=r"no agent left to re-plan on .*after 3 steps"):
            engine.run(recover=give_up)
