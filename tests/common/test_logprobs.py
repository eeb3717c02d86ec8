"""common/logprobs.py: log-softmax, the chosen token's log-probability and the top alternatives, in order."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from deskfleet.common.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, chosen_and_top, entries, log_softmax


def test_log_softmax_is_normalised_and_keeps_far_tokens_finite() -> None:
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    values = log_softmax(logits)
    assert np.exp(values).sum(axis=1) == pytest.approx([1.0, 1.0])
    assert values[0, 0] == pytest.approx(0.0)
    assert values[0, 2] == pytest.approx(-2000.0)  # exp(-2000) underflows; its log does not
    assert values[1].tolist() == pytest.approx([-math.log(3)] * 3)


@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(2, 40)),
              elements=st.floats(-30, 30, width=32)), st.integers(0, MAX_TOP_LOGPROBS), st.data())
def test_chosen_and_top_agree_with_a_full_sort(logits: np.ndarray, top: int, data: st.DataObject) -> None:
    positions, vocab = logits.shape
    tokens = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=positions, max_size=positions)))
    chosen, top_ids, top_logps = chosen_and_top(logits, tokens, top)
    reference = log_softmax(logits)
    assert chosen == pytest.approx(reference[np.arange(positions), tokens], abs=1e-5)
    assert top_ids.shape == top_logps.shape == (positions, top)
    for at in range(positions):
        # most likely first (by the logits themselves: their log-softmax can round two apart into a tie), ties: the
        # lower id first (stable on the negated values)
        expected = np.argsort(-logits[at].astype(np.float64), kind="stable")[:top]
        assert top_ids[at, : len(expected)].tolist() == expected.tolist()
        assert top_logps[at, : len(expected)] == pytest.approx(reference[at, expected], abs=1e-5)
        assert np.isneginf(top_logps[at, len(expected):]).all()  # more asked than the vocabulary holds


def test_ties_list_the_lower_id_first() -> None:
    logits = np.array([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0]], dtype=np.float32)
    _, top_ids, _ = chosen_and_top(logits, np.array([1]), 5)
    assert top_ids[0].tolist() == [1, 3, 4, 2, 5]


@pytest.mark.parametrize(("logits", "tokens", "top", "error"), [
    (np.zeros((1, 4)), [0], MAX_TOP_LOGPROBS + 1, "top must be 0-20, not 21"),
    (np.zeros((1, 4)), [0], -1, "top must be 0-20, not -1"),
    (np.zeros(4), [0], 1, r"logits must be \[T, V\], not of shape \[4\]"),
    (np.zeros((2, 4)), [0], 1, "1 chosen tokens for 2 positions"),
    (np.zeros((1, 4)), [4], 1, r"chosen tokens \[4\] outside the vocabulary of 4"),
])
def test_bad_arguments_are_named(logits: np.ndarray, tokens: list[int], top: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        chosen_and_top(logits, np.array(tokens), top)


def test_entries_take_the_first_top_alternatives_and_skip_padding() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=np.float32))
    chosen, top_ids, top_logps = chosen_and_top(logits, np.array([2, 1]), 5)
    made = entries([2, 1], chosen, top_ids, top_logps, 4)
    assert [entry.token for entry in made] == [2, 1]
    assert made[0].logprob == pytest.approx(math.log(0.2), abs=1e-6)
    assert [token for token, _ in made[0].top] == [0, 1, 2]  # 4 asked, 3 in the vocabulary: no padding entry
    assert made[1].top[0] == (1, pytest.approx(math.log(0.6), abs=1e-6))
    assert entries([2], chosen, top_ids, top_logps, 0) == [TokenLogprob(2, made[0].logprob, ())]


def test_a_large_vocabularys_figures_match_a_float64_log_softmax() -> None:
    """The logsumexp taken in the logits' float32 (summed in float64) agrees with a float64 log-softmax over a 152k
    vocabulary, and a token the model rules out (minus infinity) stays minus infinity."""
    logits = (np.random.default_rng(3).standard_normal((2, 151_936)) * 6).astype(np.float32)
    logits[1, 7] = -np.inf
    chosen, top_ids, top_logps = chosen_and_top(logits, np.array([11, 7]), 5)
    reference = log_softmax(logits)
    assert chosen[0] == pytest.approx(reference[0, 11], abs=1e-5) and chosen[1] == -np.inf
    assert top_logps == pytest.approx(np.take_along_axis(reference, top_ids, axis=1), abs=1e-5)
    assert top_ids[0].tolist() == np.argsort(-logits[0], kind="stable")[:5].tolist()
