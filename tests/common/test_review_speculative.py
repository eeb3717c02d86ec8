"""Review findings on the speculative helpers: each test failed before its fix."""

from __future__ import annotations

import tracemalloc

import numpy as np

from deskfleet.common.speculative import SamplingParams, sampling_probs

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
