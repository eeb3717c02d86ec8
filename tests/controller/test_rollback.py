"""Mask rollback is exact: after any sequence of appends and rejections, a stage chain gives the same
logits as a chain that never saw the rejected tokens (f32, within 1e-4, same argmax), for 1-4 stages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deskfleet.agent.stage import CompileSettings, Precision, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.kv_ledger import CompactionPolicy
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.batch_track import BatchTrack
from deskfleet.controller.pipeline import split_layers

F32 = CompileSettings(precision=Precision.F32)


class InlineChain:
    """k stage executors called in turn on this thread (no queues): logits come back from the last one."""

    def __init__(self, model: Path, stages: int) -> None:
        manifest = load_manifest(model)
        self.context = manifest.spec.max_context
        self.executors = [StageExecutor(Stage(model, manifest, layers, F32), self.context)
                          for layers in split_layers(manifest.spec.num_layers, stages)]

    def run(self, message: Forward) -> ForwardResult:
        for executor in self.executors[:-1]:
            forwarded = executor.run(message)
            assert isinstance(forwarded, Forward)
            message = forwarded
        result = self.executors[-1].run(message, return_logits=True)
        assert isinstance(result, ForwardResult)
        return result

    def release(self, batch_id: int) -> None:
        for executor in self.executors:
            executor.release(batch_id)


@pytest.fixture(scope="module")
def chains(checkpoint_factory: Callable[..., Path],
           export_factory: Callable[[Path, str], Path]) -> dict[int, InlineChain]:
    model = export_factory(checkpoint_factory("rollback", num_hidden_layers=4), "f32")
    return {stages: InlineChain(model, stages) for stages in (1, 2, 3, 4)}


def last_logits(result: ForwardResult) -> np.ndarray:
    """Logits at the row's last live position: without drafts the last stage computes only those."""
    assert result.logits is not None and np.asarray(result.logits).shape[1] == 1
    return np.asarray(result.logits)[0, 0]


# Each round appends 1..5 tokens, then rejects 0..(that many - 1) of them; compaction sometimes runs.
rounds_strategy = st.lists(st.tuples(st.lists(st.integers(3, 500), min_size=1, max_size=5), st.integers(0, 4),
                                     st.booleans()), min_size=1, max_size=6)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(stages=st.sampled_from([1, 2, 3, 4]), prompt=st.lists(st.integers(3, 500), min_size=1, max_size=6),
       rounds=rounds_strategy)
def test_rejected_tokens_leave_no_trace(chains: dict[int, InlineChain], stages: int, prompt: list[int],
                                        rounds: list[tuple[list[int], int, bool]]) -> None:
    chain = chains[stages]
    track = BatchTrack(1, chain.context)
    track.add_row(0)
    chain.run(track.step([prompt]))
    accepted = list(prompt)
    for tokens, reject, compact in rounds:
        chain.run(track.step([tokens]))
        rejected = min(reject, len(tokens) - 1)
        accepted += tokens[: len(tokens) - rejected]
        track.reject(0, rejected)
        if compact:
            track.compact(CompactionPolicy(min_dead_slots=1, min_dead_fraction=0.0))
    probe = [7]
    rolled_back = last_logits(chain.run(track.step([probe])))
    chain.release(1)

    fresh = BatchTrack(2, chain.context)
    fresh.add_row(0)
    clean = last_logits(chain.run(fresh.step([[*accepted, *probe]])))
    chain.release(2)
    np.testing.assert_allclose(rolled_back, clean, atol=1e-4, rtol=0)
    assert int(np.argmax(rolled_back)) == int(np.argmax(clean))
