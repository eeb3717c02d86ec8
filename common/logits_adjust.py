"""What the OpenAI API's `presence_penalty`, `frequency_penalty` and `logit_bias` do to a row's logits: pure code.

At each position the row picks or samples a token from, every token t the row has generated so far (`count` times;
the prompt's tokens are not counted, as vLLM counts them) loses `frequency x count + presence` from its logit, and
then each token in the bias gains its bias. A drafted row verifies K+1 positions in one call: position j follows the
draft tokens before it, so they are counted there as if generated (the tokens a plain step would have counted had it
taken them), which keeps a drafted run's tokens those of a plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MAX_PENALTY = 2.0  # the API's range for presence_penalty and frequency_penalty: -2 to 2
MAX_BIAS = 100.0  # the API's range for a logit_bias value: -100 to 100
MAX_BIASED_TOKENS = 300  # the API's limit on logit_bias's entries


@dataclass(frozen=True)
class RowAdjust:
    """One row's adjustment: penalties over the tokens it generated (`counted_ids` each `counts` times) and a bias."""

    presence: float
    frequency: float
    counted_ids: npt.NDArray[np.int64]  # [N] distinct token ids
    counts: npt.NDArray[np.int64]  # [N], each at least 1
    bias_ids: npt.NDArray[np.int64]  # [M] distinct token ids
    biases: npt.NDArray[np.float32]  # [M]

    @property
    def penalizes(self) -> bool:
        return bool(self.presence or self.frequency)


def adjusted_logits(logits: npt.NDArray[np.float32], adjust: RowAdjust,
                    drafts: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.float32]:
    """logits: [C, V] of one row's positions, column j following the row's generated tokens and drafts[:j] (a
    drafted row's verification; without drafts every column follows the generated tokens alone) -> the adjusted
    [C, V], a new float32 array. Only the counted and biased tokens' logits are touched: the work grows with them,
    not with the vocabulary."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if adjust.penalizes:
        counts = dict(zip(adjust.counted_ids.tolist(), adjust.counts.tolist(), strict=True))
        extra = drafts.tolist() if drafts is not None else []
        for column in range(out.shape[0]):
            if 0 < column <= len(extra):  # the draft token before this position counts from here on
                token = extra[column - 1]
                counts[token] = counts.get(token, 0) + 1
            if counts:
                ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
                times = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
                out[column, ids] -= (adjust.frequency * times + adjust.presence).astype(np.float32)
    if adjust.bias_ids.size:
        out[:, adjust.bias_ids] += adjust.biases
    return out
