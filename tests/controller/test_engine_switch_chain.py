"""Engine.switch_chain: a feed moves a running engine onto another chain (a busy server taking back a PC). The steps
in flight are collected first, nothing more goes to the old chain, and every stream's tokens equal an uninterrupted
run (f32; greedy, drafted or sampled); where no chain is given the run goes on where it was, its streams prefilled
again there."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import SamplingParams
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.draft import Drafter, DraftModel
from deskfleet.controller.engine import ChainBroken, Engine, EngineOptions, StageChain
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft

from .test_engine_failover import F32, PROMPTS, BreakingChain, _requests


class CountingChain(BreakingChain):
    """A local pipeline that counts its steps (and may break at its `break_at`-th collect)."""

    def __init__(self, pipeline: LocalPipeline, break_at: int | None = None) -> None:
        super().__init__(pipeline, break_at)
        self.submitted = 0
        self.sealed = False  # set once the run left it: a step then is a bug

    def submit(self, message: Forward) -> None:
        assert not self.sealed, "a step went to the chain the run moved off"
        super().submit(message)
        self.submitted += 1

    def collect(self, timeout: float | None = None) -> ForwardResult:
        assert not self.sealed, "a result was awaited from the chain the run moved off"
        return super().collect(timeout)

    @property
    def in_flight(self) -> int:
        return self.submitted - self.collected


def _run(model: Path, switch_at: int, give_chain: bool = True, drafter: Drafter | None = None,
         speculative: bool = False, sampling: SamplingParams | None = None, break_in_drain: bool = False,
         options: EngineOptions | None = None) -> tuple[list[list[int]], Engine, dict[str, object]]:
    """Run the failover tests' staggered streams on 2 stages; at the feed's `switch_at`-th call, ask to move onto a
    fresh 1-stage pipeline (or, without `give_chain`, be told there is none; with `break_in_drain`, the old chain
    breaks at its next collect). What it saw: the old chain's steps in flight when the move was asked and when the
    new chain was, both chains, the recoveries."""
    manifest = load_manifest(model)
    seen: dict[str, object] = {"recovered": 0}
    with ExitStack() as pipelines:
        def pipeline(stages: int) -> LocalPipeline:
            return pipelines.enter_context(LocalPipeline(model, stages, F32, manifest))

        old = CountingChain(pipeline(2))
        seen["old"] = old
        engine = Engine(old, manifest.spec, drafter, options or EngineOptions(max_rows=2, micro_batches=2))
        for request in _requests(speculative, sampling):
            engine.add(request)

        def open_new() -> StageChain | None:
            seen["in_flight_at_open"] = old.in_flight
            seen["unfinished_at_open"] = engine._unfinished
            if not give_chain:
                return None
            old.sealed = True
            new = seen["new"] = CountingChain(pipeline(1))
            return new

        def recover(error: ChainBroken) -> StageChain:
            seen["recovered"] = int(seen["recovered"]) + 1  # type: ignore[call-overload]
            return CountingChain(pipeline(1))

        calls = 0

        def feed(idle: bool) -> bool:
            nonlocal calls
            calls += 1
            if calls == switch_at:
                seen["in_flight_at_ask"] = old.in_flight
                if break_in_drain:
                    old.break_at = old.collected
                engine.switch_chain(open_new, "a PC was taken back")
            return not idle

        results = engine.run(recover=recover, feed=feed)
    return [results[index].tokens for index in range(len(PROMPTS))], engine, seen


@pytest.fixture(scope="module")
def uninterrupted(target: Path) -> list[list[int]]:
    tokens, engine, _ = _run(target, switch_at=0)
    assert not engine.failovers
    return tokens


@pytest.mark.parametrize("switch_at", [4, 10, 30])
def test_streams_move_onto_the_new_chain_with_the_same_tokens(target: Path, uninterrupted: list[list[int]],
                                                              switch_at: int) -> None:
    tokens, engine, seen = _run(target, switch_at)
    assert tokens == uninterrupted
    assert int(seen["in_flight_at_ask"]) > 0 and seen["in_flight_at_open"] == 0  # type: ignore[call-overload]  # every step in flight was collected before the re-plan began
    (moved,) = engine.failovers
    assert moved.switched and moved.error == "a PC was taken back" and moved.resumed_streams > 0
    assert seen["recovered"] == 0
    new = seen["new"]
    assert isinstance(new, CountingChain) and new.submitted > 0  # the resumed streams ran there
    assert engine.chain is new


@pytest.mark.parametrize("drafter_kind", ["draft model", "prompt lookup"])
def test_drafted_streams_move_with_the_same_tokens(target: Path, other_draft: Path, uninterrupted: list[list[int]],
                                                   drafter_kind: str) -> None:
    drafter: Drafter = DraftModel(other_draft, F32) if drafter_kind == "draft model" else PromptLookupDraft()
    tokens, engine, seen = _run(target, 8, drafter=drafter, speculative=True,
                                options=EngineOptions(max_rows=2, micro_batches=2, fixed_k=3))
    assert tokens == uninterrupted
    assert [failover.switched for failover in engine.failovers] == [True] and seen["in_flight_at_open"] == 0


def test_sampled_streams_move_with_the_draws_of_an_uninterrupted_run(target: Path) -> None:
    sampling = SamplingParams(temperature=1.5)
    uninterrupted, _, _ = _run(target, 0, sampling=sampling)
    tokens, engine, _ = _run(target, 9, sampling=sampling)
    assert len(engine.failovers) == 1 and tokens == uninterrupted


def test_no_chain_given_leaves_the_run_where_it_was(target: Path, uninterrupted: list[list[int]]) -> None:
    tokens, engine, seen = _run(target, 10, give_chain=False)
    assert tokens == uninterrupted and engine.failovers == []
    assert seen["in_flight_at_open"] == 0 and int(seen["unfinished_at_open"]) > 0  # type: ignore[call-overload]
    assert engine.chain is seen["old"]


def test_a_chain_that_breaks_while_its_steps_are_collected_goes_to_recover(
        target: Path, uninterrupted: list[list[int]]) -> None:
    tokens, engine, seen = _run(target, 10, break_in_drain=True)
    assert int(seen["in_flight_at_ask"]) > 0  # type: ignore[call-overload]  # the drain had steps to collect
    assert tokens == uninterrupted
    assert seen["recovered"] == 1 and "in_flight_at_open" not in seen  # the break's re-plan is the move
    assert [failover.switched for failover in engine.failovers] == [False]

