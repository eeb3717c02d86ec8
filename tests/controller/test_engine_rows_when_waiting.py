"""EngineOptions.rows_when_waiting: a stream prefilled ahead joins a full micro-batch past max_rows rather than stall
after its first token until a running stream ends (serve's 9th to 12th request on 8 rows: nothing for 5 s)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline

from .test_engine import F32, PROMPTS, run_streams

NEW_TOKENS = 24


def _timeline(model: Path, options: EngineOptions, prompts: list[list[int]]) -> tuple[list[int], dict[int, list[int]]]:
    """The stream of each token in the order they came, and each stream's tokens."""
    manifest = load_manifest(model)
    order: list[int] = []
    with LocalPipeline(model, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, None, options)
        for prompt in prompts:
            engine.add(StreamRequest(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True))
        results = engine.run(on_token=lambda stream_id, token: order.append(stream_id))
    return order, {stream_id: result.tokens for stream_id, result in results.items()}


def _longest_silence(order: list[int], stream_id: int) -> int:
    """The most tokens of other streams that came between two of this one's, after its first."""
    seen = [at for at, which in enumerate(order) if which == stream_id]
    return max(later - earlier - 1 for earlier, later in itertools.pairwise(seen))


@pytest.mark.parametrize("rows_when_waiting", [0, 4])
def test_streams_prefilled_ahead_run_at_once_past_max_rows_and_give_their_solo_tokens(target: Path,
                                                                                     rows_when_waiting: int) -> None:
    prompts = PROMPTS[:4]
    options = EngineOptions(max_rows=2, micro_batches=1, rows_when_waiting=rows_when_waiting)
    order, tokens = _timeline(target, options, prompts)
    for index, prompt in enumerate(prompts):
        assert tokens[index] == run_streams(target, [StreamRequest(prompt, max_new_tokens=NEW_TOKENS,
                                                                   ignore_eos=True)])[0]
    waited = max(_longest_silence(order, stream_id) for stream_id in range(len(prompts)))
    if rows_when_waiting:  # every stream goes on at every step once it has its first token
        assert waited <= 2 * len(prompts), order  # one step more while a newcomer is admitted
    else:  # two of them waited, prefilled, for the first two's whole replies
        assert waited >= NEW_TOKENS, order


@pytest.mark.parametrize("rows_when_waiting", [3, 9])
def test_rows_when_waiting_outside_max_rows_to_twice_it_is_refused(rows_when_waiting: int) -> None:
    # above twice max_rows it was taken and never reached: no more streams than that are prefilled ahead
    with pytest.raises(ValueError, match=r"rows_when_waiting must be 0 \(max_rows\) or from max_rows \(4\) to "
                                         r"twice it"):
        EngineOptions(max_rows=4, rows_when_waiting=rows_when_waiting)


def test_a_micro_batch_under_max_rows_whose_drafter_catches_up_is_waited_for_not_passed_over() -> None:
    # the micro-batch with a free row held a stream whose drafter still lacked part of its prompt, so the newcomer
    # joined a full one past max_rows, though the free row would take it within a few steps
    from types import SimpleNamespace

    engine = Engine.__new__(Engine)
    engine.options = EngineOptions(max_rows=2, micro_batches=2, rows_when_waiting=4)
    engine._streams = {stream_id: SimpleNamespace(keeps_own_batch=stream_id == 9) for stream_id in range(10)}
    full = SimpleNamespace(micro_batch_id=100, rows=2, stream_ids=[0, 1])
    free = SimpleNamespace(micro_batch_id=101, rows=1, stream_ids=[2])
    engine._tracks = {100: full, 101: free}
    engine._draft_unfed = {}
    assert engine._pick_target() is free
    engine._draft_unfed = {2: [5, 6]}
    assert engine._pick_target() is None  # wait for it to settle
    free.rows, free.stream_ids = 2, [2, 3]  # both full now: the wider limit, on the one that takes rows now
    assert engine._pick_target() is full
    engine._draft_unfed = {}
    full.rows, full.stream_ids = 4, [0, 1, 4, 5]
    assert engine._pick_target() is free
    free.stream_ids = [2, 9]  # a kept chat's micro-batch takes no one
    assert engine._pick_target() is None
