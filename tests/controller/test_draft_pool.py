"""The draft model's pool: every running stream is a row of one batched state, whatever micro-batch it runs in on
the target, so a round drafts the rows of several micro-batches in one call per token; and the engine drafts the
micro-batches whose results came together in one such call (f32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward
from deskfleet.controller.draft import POOL_BATCH, DraftModel, DraftRow, Proposal
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline

F32 = CompileSettings(precision=Precision.F32)
CONTEXTS = {7: [1, 40, 41, 42, 43, 9], 8: [1, 70, 71, 72, 73], 9: [1, 5, 6]}


def record_calls(draft: DraftModel) -> list[tuple[int, tuple[int, ...]]]:
    """(micro-batch id, streams) of every call the draft model makes from now on."""
    calls: list[tuple[int, tuple[int, ...]]] = []
    run = draft._executor.run

    def recording(message: Forward, return_logits: bool = False) -> object:
        calls.append((message.micro_batch_id, message.stream_ids))
        return run(message, return_logits)

    draft._executor.run = recording  # type: ignore[method-assign,assignment]
    return calls


def reference(model: Path, context: list[int], k: int) -> list[int]:
    """What a draft model that holds this stream alone proposes."""
    alone = DraftModel(model, F32)
    alone.prefill(0, 0, context[:-1])
    return alone.propose(0, [DraftRow(0, context, k, None, 0)]).tokens[0]


def test_rows_of_several_micro_batches_draft_in_one_call_a_token(other_draft: Path) -> None:
    draft = DraftModel(other_draft, F32)
    for batch, stream in enumerate(CONTEXTS):  # each stream prefilled alone, in a micro-batch of its own
        draft.prefill(batch, stream, CONTEXTS[stream][:-1])
    calls = record_calls(draft)
    proposal = draft.propose(0, [DraftRow(stream, CONTEXTS[stream], 3, None, 0) for stream in CONTEXTS])
    assert calls == [(POOL_BATCH, (7, 8, 9))] * 3  # 3 tokens, every row in each call
    for stream, context in CONTEXTS.items():
        assert proposal.tokens[stream] == reference(other_draft, context, 3), f"stream {stream}"
    assert all(draft.has_batch(batch) for batch in range(3)) and not draft.has_batch(3)


def test_a_pooled_row_keeps_its_own_state_as_others_come_and_go(other_draft: Path) -> None:
    draft = DraftModel(other_draft, F32)
    contexts = {stream: list(context) for stream, context in CONTEXTS.items()}
    for batch, stream in enumerate(contexts):
        draft.prefill(batch, stream, contexts[stream][:-1])
    # stream 7 rounds with stream 8 (rejections rolled back), stream 9 sits them out
    for accepted in (1, 3, 0):
        proposal = draft.propose(0, [DraftRow(stream, contexts[stream], 3, None, 0) for stream in (7, 8)])
        for batch, stream in ((0, 7), (1, 8)):
            before = len(contexts[stream])
            draft.after_verify(batch, stream, before, 3, accepted)
            contexts[stream] += [*proposal.tokens[stream][:accepted], 100 + stream + accepted]
    draft.release(1)  # stream 8's micro-batch ends: its row goes, the others stay
    assert not draft.has_batch(1) and draft.has_batch(0) and draft.has_batch(2)
    proposal = draft.propose(2, [DraftRow(stream, contexts[stream], 4, None, 0) for stream in (7, 9)])
    for stream in (7, 9):
        assert proposal.tokens[stream] == reference(other_draft, contexts[stream], 4), f"stream {stream}"
    with pytest.raises(ValueError, match=r"does not hold: \[8\]"):
        draft.propose(0, [DraftRow(8, contexts[8], 2, None, 0)])
    draft.drop(0, {7})
    draft.drop(2, {9})
    assert not any(draft.has_batch(batch) for batch in range(3))
    assert draft._tracks == {}  # the emptied pool was released


def test_the_engine_drafts_the_micro_batches_that_wait_together(target: Path, other_draft: Path) -> None:
    # A micro-batch per stream, as over a fleet of as many PCs; one inline stage, so every step's result is
    # there at once: the driver takes them all, then drafts every waiting micro-batch's row in one call.
    prompts = [[1, 17, 99, 230, 5], [1, 8, 8, 3, 12, 40], [1, 300, 301]]
    manifest = load_manifest(target)
    solo = []
    for prompt in prompts:
        with LocalPipeline(target, 1, F32, manifest) as pipeline:
            engine = Engine(pipeline, manifest.spec)
            engine.add(StreamRequest(prompt, max_new_tokens=24, ignore_eos=True))
            solo.append(engine.run()[0].tokens)
    draft = DraftModel(other_draft, F32)
    proposals: list[set[int]] = []
    propose = draft.propose

    def recording(micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        proposals.append({row.stream_id for row in rows})
        return propose(micro_batch_id, rows)

    draft.propose = recording  # type: ignore[method-assign]
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, draft, EngineOptions(max_rows=1, micro_batches=3, fixed_k=3))
        for prompt in prompts:
            engine.add(StreamRequest(prompt, max_new_tokens=24, ignore_eos=True))
        results = engine.run()
    assert [results[index].tokens for index in range(3)] == solo  # greedy: what each makes alone
    assert engine.timings.drafted_rounds > 0
    assert max(len(streams) for streams in proposals) == 3  # the three micro-batches' rows in one call
