"""adjusted_logits against a plain loop: each column's logits less frequency x count + presence for every token
counted so far (the generated tokens, then the drafts before the column), plus the bias."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from deskfleet.common.logits_adjust import RowAdjust, adjusted_logits

VOCAB = 7


@given(st.lists(st.integers(0, VOCAB - 1), max_size=12), st.lists(st.integers(0, VOCAB - 1), max_size=4),
       st.floats(-2, 2), st.floats(-2, 2), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100)),
       st.integers(0, 2**32 - 1))
def test_each_column_counts_the_generated_tokens_and_the_drafts_before_it(
        generated: list[int], drafts: list[int], presence: float, frequency: float, bias: dict[int, float],
        seed: int) -> None:
    logits = np.random.default_rng(seed).standard_normal((len(drafts) + 1, VOCAB)).astype(np.float32)
    counted = Counter(generated)
    adjust = RowAdjust(presence, frequency, np.array(sorted(counted), dtype=np.int64),
                       np.array([counted[token] for token in sorted(counted)], dtype=np.int64),
                       np.array(list(bias), dtype=np.int64), np.array(list(bias.values()), dtype=np.float32))
    out = adjusted_logits(logits, adjust, np.array(drafts, dtype=np.int64))
    for column in range(len(drafts) + 1):
        counts = Counter(generated + drafts[:column])
        expected = logits[column].astype(np.float64)
        for token, times in counts.items():
            expected[token] -= frequency * times + presence
        for token, value in bias.items():
            expected[token] += np.float32(value)
        np.testing.assert_allclose(out[column], expected, rtol=1e-5, atol=1e-4)
    assert out is not logits


def test_no_penalty_and_no_bias_leave_the_logits_as_they_were() -> None:
    logits = np.arange(14, dtype=np.float32).reshape(2, VOCAB)
    empty = np.zeros(0, dtype=np.int64)
    adjust = RowAdjust(0.0, 0.0, np.array([1]), np.array([3]), empty, np.zeros(0, dtype=np.float32))
    assert not adjust.penalizes
    np.testing.assert_array_equal(adjusted_logits(logits, adjust, np.array([2])), logits)
