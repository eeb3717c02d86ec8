"""Log-probabilities of generated tokens, as the OpenAI API's `logprobs` reports them (pure, no I/O).

The last stage computes them from its logits for the rows that ask (wire_messages.Forward.logprobs): the chosen
token's log-probability and the `top` most likely tokens with theirs, under the model's own distribution (the raw
logits' softmax: before temperature, top-k or top-p, as OpenAI's are). Only these numbers travel back, never the
logits (top-1 compression stays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MAX_TOP_LOGPROBS = 20  # the most alternatives a token reports (the OpenAI API's top_logprobs limit)
# Scoring a prompt takes the logits of every fed position: a call's [B, T, V] float32 logits at most this big (a
# 128k vocabulary's 2,048-token prompt would be 1 GiB on the last stage's PC). The driver feeds a scored prompt in
# chunks that fit (SCORED_LOGITS_BYTES // 4V tokens a row), and a last stage refuses a call that would not.
SCORED_LOGITS_BYTES = 64 << 20


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the `top` alternatives (token, log-probability), most likely
    first (ties: the lower token id first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """log(softmax) over the last axis, in float64 (a token far below the maximum keeps a finite value)."""
    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def chosen_and_top(logits: npt.NDArray[np.floating], tokens: npt.NDArray[np.int64], top: int
                   ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """For logits [T, V] and the token chosen at each of the T positions: each chosen token's log-probability [T],
    and the `top` most likely tokens [T, top] with their log-probabilities [T, top], most likely first (ties: the
    lower id first). ValueError for a token outside the vocabulary or `top` outside 0..MAX_TOP_LOGPROBS."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top must be 0-{MAX_TOP_LOGPROBS}, not {top}")
    rows = np.asarray(logits)
    if rows.ndim != 2:
        raise ValueError(f"logits must be [T, V], not of shape {list(rows.shape)}")
    chosen = np.asarray(tokens, dtype=np.int64).reshape(-1)
    positions, vocab = rows.shape
    if chosen.shape[0] != positions:
        raise ValueError(f"{chosen.shape[0]} chosen tokens for {positions} positions")
    if ((chosen < 0) | (chosen >= vocab)).any():
        raise ValueError(f"chosen tokens {chosen.tolist()} outside the vocabulary of {vocab}")
    count = min(top, vocab)
    picked = np.zeros(positions, dtype=np.float32)
    top_ids = np.zeros((positions, top), dtype=np.int64)
    top_logps = np.full((positions, top), -np.inf, dtype=np.float32)
    # log p = logit - logsumexp: one pass of exp over the vocabulary in the logits' own float32, summed in float64
    # (a float64 log-softmax of every token cost 1.4 ms a token of a 152k vocabulary, this a fraction), and only the
    # tokens reported subtract it. One position at a time: a scored prompt's [T, V] copies stay a position's.
    for at in range(positions):
        row = rows[at].astype(np.float32, copy=False)
        peak = row.max()
        total = np.exp(row - peak).sum(dtype=np.float64)
        logsumexp = float(peak) + math.log(total) if math.isfinite(peak) and total > 0 else math.nan
        picked[at] = float(row[chosen[at]]) - logsumexp
        if count:
            order = _most_likely(row, count)
            top_ids[at, :count] = order
            top_logps[at, :count] = row[order].astype(np.float64) - logsumexp
    return picked, top_ids, top_logps


def entries(tokens: list[int], chosen: npt.NDArray[np.floating], top_ids: npt.NDArray[np.integer],
            top_logps: npt.NDArray[np.floating], top: int) -> list[TokenLogprob]:
    """TokenLogprob for each of `tokens`, from a result's rows of chosen_and_top (the first `top` alternatives)."""
    return [TokenLogprob(int(token), float(chosen[at]),
                         tuple((int(top_ids[at, j]), float(top_logps[at, j])) for j in range(top)
                               if np.isfinite(top_logps[at, j])))
            for at, token in enumerate(tokens)]


# Private functions

def _most_likely(logp: npt.NDArray[np.floating], count: int) -> npt.NDArray[np.int64]:
    """The `count` most likely token ids of one position, most likely first, ties the lower id first. The value at
    rank `count` comes by partition (a full sort of a 150k vocabulary would cost milliseconds a token); every token
    at or above it is a candidate, so a tie across that rank keeps the lower ids."""
    threshold = np.partition(-logp, count - 1)[count - 1]
    candidates = np.flatnonzero(-logp <= threshold)
    # lexsort's last key is the primary one: descending log-probability, then ascending id
    return candidates[np.lexsort((candidates, -logp[candidates]))][:count]
