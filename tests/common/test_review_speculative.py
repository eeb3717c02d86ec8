"""Review findings on the speculative helpers: each test failed before its fix."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from deskfleet.common.speculative import SamplingParams, sample, sampling_probs, speculative_accept

GREEDY = SamplingParams(temperature=0.0)


def test_greedy_probs_of_a_real_vocabulary_take_one_row_not_a_vocabulary_squared() -> None:
    # np.eye(V)[argmax] built a V x V matrix first: 8 GB for V = 32000 (180 GB for Qwen's 151936)
    logits = np.zeros((2, 32_000), dtype=np.float32)
    logits[0, 7] = logits[1, 31_999] = 1.0
    tracemalloc.start()
    try:
        probs = sampling_probs(logits, GREEDY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    assert probs.shape == (2, 32_000) and probs.dtype == np.float64
    assert probs.sum(axis=-1).tolist() == [1.0, 1.0]
    assert probs[0, 7] == probs[1, 31_999] == 1.0


def test_greedy_probs_keep_the_logits_shape_and_the_first_maximum() -> None:
    assert sampling_probs(np.array([1.0, 3.0, 3.0]), GREEDY).tolist() == [0.0, 1.0, 0.0]
    batch = sampling_probs(np.array([[[0.0, 2.0], [5.0, 1.0]]]), GREEDY)
    assert batch.tolist() == [[[0.0, 1.0], [1.0, 0.0]]]


@pytest.mark.parametrize("probs", [[0.0, 0.0, 0.0], [0.2, np.nan, 0.3], [0.5, np.inf, 0.1], []],
                         ids=["all_zero", "nan", "inf", "empty"])
def test_sampling_from_no_distribution_is_refused(probs: list[float]) -> None:
    # it returned the last token (probability 0 or NaN) instead; NaN logits reach here as NaN probs
    with pytest.raises(ValueError, match="cannot sample from probabilities of total"):
        sample(np.array(probs, dtype=np.float64), np.random.default_rng(0))


def test_a_rejection_where_the_target_has_no_mass_is_refused_not_answered_with_a_zero_probability_token() -> None:
    draft_probs = np.array([[0.0, 1.0, 0.0]])
    target_probs = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # row 0 is no distribution
    with pytest.raises(ValueError, match="cannot sample"):
        speculative_accept([1], draft_probs, target_probs, np.random.default_rng(0))


def test_zero_probability_tokens_are_never_drawn_and_k_zero_samples_the_bonus() -> None:
    rng = np.random.default_rng(3)
    probs = np.array([0.0, 0.3, 0.0, 0.0, 0.7, 0.0])
    assert {sample(probs, rng) for _ in range(300)} == {1, 4}
    assert {sample(probs * 7.5, rng) for _ in range(300)} == {1, 4}  # need not sum to 1
    verdict = speculative_accept([], np.zeros((0, 3)), np.array([[0.0, 1.0, 0.0]]), rng)
    assert (verdict.accepted, verdict.next_token) == (0, 1)
