"""Prompt lookup first, the draft model elsewhere: which rows each serves, and that the draft model's
cache stays right across rounds it sat out (f32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.speculative import SamplingParams
from deskfleet.controller.draft import DraftModel, DraftRow, open_drafter
from deskfleet.controller.lookup_first import LookupFirstDraft

F32 = CompileSettings(precision=Precision.F32)
REPEATING = [1, 40, 41, 42, 43, 9, 40, 41]  # "40 41" occurred before: lookup copies 42 43 9 ...
FRESH = [1, 70, 71, 72, 73]  # no 2-token suffix occurred before: the draft model proposes


def _reference(model: Path, context: list[int], k: int) -> list[int]:
    """What a draft model that saw every confirmed token, one stream alone, proposes."""
    fresh = DraftModel(model, F32)
    fresh.prefill(0, 0, context[:-1])
    return fresh.propose(0, [DraftRow(0, context, k, None, 0)]).tokens[0]


def test_a_repeating_row_copies_and_a_fresh_row_is_drafted(tiny_export: Path) -> None:
    drafter = LookupFirstDraft(DraftModel(tiny_export, F32))
    drafter.prefill(0, 7, REPEATING[:-1])
    drafter.prefill(1, 8, FRESH[:-1])
    drafter.merge(0, 8, 1)
    proposal = drafter.propose(0, [DraftRow(7, REPEATING, 3, None, 0), DraftRow(8, FRESH, 3, None, 0)])
    assert proposal.tokens[7] == [42, 43, 9]
    assert proposal.tokens[8] == _reference(tiny_export, FRESH, 3)
    assert (drafter.copied_rounds, drafter.drafted_rounds) == (1, 1)
    assert not proposal.one_hot and proposal.probs == {}  # greedy rows carry no q


def test_the_draft_model_catches_up_after_copied_rounds(tiny_export: Path) -> None:
    # Stream 7 copies for two rounds (the draft model sees none of it), then needs the model: its
    # proposal must equal that of a model that saw every confirmed token. Stream 8 is drafted all along,
    # in the same micro-batch, with rejections rolled back.
    drafter = LookupFirstDraft(DraftModel(tiny_export, F32))
    drafter.prefill(0, 7, REPEATING[:-1])
    drafter.prefill(1, 8, FRESH[:-1])
    drafter.merge(0, 8, 1)
    contexts = {7: list(REPEATING), 8: list(FRESH)}
    for accepted in (2, 0):
        rows = [DraftRow(stream, contexts[stream], 3, None, 0) for stream in (7, 8)]
        proposal = drafter.propose(0, rows)
        assert drafter.copied_rounds >= 1
        for stream in (7, 8):
            before = len(contexts[stream])
            drafter.after_verify(0, stream, before, 3, accepted)
            contexts[stream] += [*proposal.tokens[stream][:accepted], 200 + stream + accepted]
    contexts[7] += [90, 91, 92]  # a suffix seen nowhere before: no copy
    proposal = drafter.propose(0, [DraftRow(stream, contexts[stream], 4, None, 0) for stream in (7, 8)])
    assert drafter.drafted_rounds >= 3
    for stream in (7, 8):
        assert proposal.tokens[stream] == _reference(tiny_export, contexts[stream], 4), f"stream {stream}"


def test_a_copied_sampled_row_beside_a_drafted_one_gets_a_one_hot_q(tiny_export: Path) -> None:
    drafter = LookupFirstDraft(DraftModel(tiny_export, F32))
    drafter.prefill(0, 7, REPEATING[:-1])
    drafter.prefill(1, 8, FRESH[:-1])
    drafter.merge(0, 8, 1)
    sampled = SamplingParams(temperature=1.0)
    proposal = drafter.propose(0, [DraftRow(7, REPEATING, 3, sampled, 5), DraftRow(8, FRESH, 3, sampled, 6)])
    q = proposal.probs[7]
    vocab = drafter.model.spec.vocab_size
    assert q.shape == (3, vocab) and q.dtype == np.float32
    assert [int(index) for index in q.argmax(axis=1)] == [42, 43, 9] and np.all(q.sum(axis=1) == 1.0)
    assert proposal.probs[8].shape == (3, vocab) and not proposal.one_hot  # the drafted row's own q


def test_a_round_whose_sampled_rows_were_all_copied_sends_no_distributions(tiny_export: Path) -> None:
    # Every q is one-hot then: the last stage builds them (as for prompt lookup), no [B, K, V] tensor travels
    drafter = LookupFirstDraft(DraftModel(tiny_export, F32))
    drafter.prefill(0, 7, REPEATING[:-1])
    drafter.prefill(1, 8, FRESH[:-1])
    drafter.merge(0, 8, 1)
    proposal = drafter.propose(0, [DraftRow(7, REPEATING, 3, SamplingParams(temperature=1.0), 5),
                                   DraftRow(8, FRESH, 3, None, 0)])  # a greedy row drafted beside it
    assert proposal.one_hot and proposal.probs == {}
    assert proposal.tokens[7] == [42, 43, 9] and len(proposal.tokens[8]) == 3


def test_rows_must_belong_to_the_micro_batch(tiny_export: Path) -> None:
    drafter = LookupFirstDraft(DraftModel(tiny_export, F32))
    drafter.prefill(0, 7, FRESH[:-1])
    with pytest.raises(ValueError, match="does not hold"):
        drafter.propose(0, [DraftRow(9, FRESH, 2, None, 0)])
    with pytest.raises(ValueError, match="n-gram"):
        LookupFirstDraft(drafter.model, min_ngram=0)


def test_open_drafter_with_both_copies_first(tiny_export: Path) -> None:
    drafter = open_drafter(tiny_export, True, F32)
    assert isinstance(drafter, LookupFirstDraft) and isinstance(drafter.model, DraftModel)
