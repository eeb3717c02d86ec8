"""The stage executor's pure parts: which logits the last stage computes, and verification."""

from __future__ import annotations

import numpy as np
import pytest

from deskfleet.agent.stage_executor import logits_positions, replay_deltas, verify
from deskfleet.common.kv_ledger import AppendSlots, Ledger, LedgerError, Mirror
from deskfleet.common.wire import DraftInfo, SamplingInfo


def test_positions_are_the_last_live_ones_without_a_draft_and_all_with_one() -> None:
    append = AppendSlots(count=5, live_counts=(5, 2, 0), first_positions=(0, 0, 0))
    assert logits_positions(append, None).tolist() == [[4], [1], [0]]
    draft = DraftInfo((4, 1, 0), np.zeros((3, 4), dtype=np.int64))
    assert logits_positions(append, draft).tolist() == [[0, 1, 2, 3, 4]] * 3


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    append = AppendSlots(count=4, live_counts=(4, 1), first_positions=(10, 3))
    draft = DraftInfo((3, 0), np.array([[7, 8, 9], [0, 0, 0]], dtype=np.int64))
    argmax = np.array([[7, 8, 5, 6], [42, 0, 0, 0]], dtype=np.int64)  # row 0: 7, 8 accepted, 9 rejected
    tokens, accepted = verify(append, argmax, None, draft, None)
    assert tokens == (5, 42) and accepted == (2, 0)


def test_without_a_draft_the_next_token_is_column_zero() -> None:
    append = AppendSlots(count=3, live_counts=(3, 1), first_positions=(0, 0))
    tokens, accepted = verify(append, np.array([[11], [12]], dtype=np.int64), None, None, None)
    assert tokens == (11, 12) and accepted is None


def test_sampled_rows_need_logits_and_draft_probabilities() -> None:
    append = AppendSlots(count=2, live_counts=(2,), first_positions=(0,))
    sampling = SamplingInfo((1.0,), (0,), (1.0,), (5,))
    draft = DraftInfo((1,), np.array([[3]], dtype=np.int64))
    with pytest.raises(LedgerError, match="need the stage's logits"):
        verify(append, np.zeros((1, 2), dtype=np.int64), None, draft, sampling)
    with pytest.raises(LedgerError, match="no draft probabilities"):
        verify(append, np.zeros((1, 2), dtype=np.int64), np.zeros((1, 2, 8), np.float32), draft, sampling)


def test_one_hot_drafts_verify_like_their_dense_distributions() -> None:
    # Prompt lookup sends no q: the last stage builds the one-hot q itself. Same seed, same verdicts as a
    # dense one-hot q, over many seeds (both acceptances and rejections occur).
    append = AppendSlots(count=3, live_counts=(3,), first_positions=(0,))
    ids = np.array([[2, 5]], dtype=np.int64)
    dense = np.zeros((1, 2, 8), np.float32)
    dense[0, [0, 1], [2, 5]] = 1.0
    logits = np.random.default_rng(0).normal(size=(1, 3, 8)).astype(np.float32)
    outcomes = set()
    for seed in range(40):
        sampling = SamplingInfo((1.0,), (0,), (1.0,), (seed,))
        one_hot = verify(append, np.zeros((1, 3), dtype=np.int64), logits, DraftInfo((2,), ids, one_hot=True),
                         sampling)
        assert one_hot == verify(append, np.zeros((1, 3), dtype=np.int64), logits, DraftInfo((2,), ids, dense),
                                 sampling)
        outcomes.add(one_hot[1])
    assert len(outcomes) > 1
    with pytest.raises(ValueError, match="one-hot drafts carry no draft probabilities"):
        DraftInfo((2,), ids, dense, one_hot=True)


def test_a_row_that_fed_the_wrong_number_of_tokens_is_a_desync() -> None:
    append = AppendSlots(count=3, live_counts=(3,), first_positions=(0,))
    draft = DraftInfo((1,), np.array([[3]], dtype=np.int64))
    with pytest.raises(LedgerError, match="fed 3 tokens for 1 draft tokens"):
        verify(append, np.zeros((1, 3), dtype=np.int64), None, draft, None)


def test_replay_needs_the_append_last() -> None:
    ledger = Ledger(100)
    add = ledger.add_rows(1)
    append = ledger.append([2])
    with pytest.raises(LedgerError, match="must end with the AppendSlots"):
        replay_deltas(Mirror(100), (append, add))
    mirror = Mirror(100)
    inputs = replay_deltas(mirror, (add, append))
    assert mirror.attention_mask().tolist() == [[1, 1]] and inputs.position_ids.tolist() == [[0, 1]]
