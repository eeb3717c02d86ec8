"""Prompt-lookup drafting: what it proposes, and its micro-batch bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from deskfleet.common.speculative import SamplingParams
from deskfleet.controller.draft import DraftRow, open_drafter
from deskfleet.controller.prompt_lookup import PromptLookupDraft, lookup_continuation


def test_the_longest_suffix_picks_the_continuation() -> None:
    # "7 8" occurred before followed by 9 10; "8" alone occurred later followed by 5: the longer match wins.
    context = [7, 8, 9, 10, 8, 5, 6, 7, 8]
    assert lookup_continuation(context, 2) == [9, 10]
    assert lookup_continuation(context, 2, max_ngram=1) == [5, 6]


def test_the_most_recent_occurrence_wins() -> None:
    assert lookup_continuation([3, 1, 3, 2, 3], 1) == [2]


def test_a_copy_that_reaches_the_end_repeats_the_period() -> None:
    assert lookup_continuation([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert lookup_continuation([4, 4], 3) == [4, 4, 4]


@pytest.mark.parametrize("context", [[], [5], [1, 2, 3, 4]])
def test_no_earlier_occurrence_no_proposal(context: list[int]) -> None:
    assert lookup_continuation(context, 4) == []


def test_k_and_ngram_bounds() -> None:
    assert lookup_continuation([1, 2, 1, 2], 0) == []
    assert lookup_continuation([9, 1, 2, 9, 1, 2], 2, max_ngram=3, min_ngram=3) == [9, 1]
    assert lookup_continuation([5, 1, 2, 7, 2], 2, min_ngram=2) == []  # only a 1-token match exists
    with pytest.raises(ValueError, match="n-gram"):
        lookup_continuation([1, 2], 1, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="n-gram"):
        PromptLookupDraft(min_ngram=0)


def test_proposals_are_one_hot_for_sampled_rows_only() -> None:
    drafter = PromptLookupDraft()
    drafter.check_compatible(16)
    drafter.prefill(0, 10, [1, 2, 3])
    drafter.prefill(1, 11, [1, 5])
    drafter.merge(0, 11, 1)
    assert drafter.has_batch(0) and not drafter.has_batch(1)
    rows = [DraftRow(10, [1, 2, 3, 1, 2], 3, None, 0),
            DraftRow(11, [1, 5, 1, 5], 2, SamplingParams(temperature=1.0), 0)]
    proposal = drafter.propose(0, rows)
    assert proposal.tokens == {10: [3, 1, 2], 11: [1, 5]}
    assert set(proposal.probs) == {11}
    assert np.array_equal(proposal.probs[11], np.eye(16, dtype=np.float32)[[1, 5]])
    drafter.drop(0, {10})
    assert drafter.has_batch(0)
    drafter.drop(0, {11})
    assert not drafter.has_batch(0)
    with pytest.raises(ValueError, match="micro-batch 0"):
        drafter.propose(0, rows)


def test_open_drafter_takes_one_kind() -> None:
    assert open_drafter(None, False) is None
    assert isinstance(open_drafter(None, True), PromptLookupDraft)
    with pytest.raises(ValueError, match="choose one drafter"):
        open_drafter(__import__("pathlib").Path("draft"), True)
