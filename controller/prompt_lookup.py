"""Prompt-lookup drafting: draft tokens copied from the stream's own context, with no draft model.

For each speculative row, the longest suffix of the row's tokens (prompt + generated, `max_ngram` down to
`min_ngram` tokens) that occurred earlier in them is looked up; the tokens that followed its most recent
earlier occurrence are the proposal (up to k; when the copy runs into the end of the context it repeats
the period it found). No match: no proposal, and the row takes a plain step. Code, structured text and a
model that repeats itself all give long matches; the proposals cost microseconds instead of a model call
per token.

The draft distribution is one-hot at each proposed token, so speculative sampling stays exact: the last
stage accepts token x with probability p(x) and otherwise samples from p without x, renormalised. The
proposal says so (`one_hot`) and no [K, V] distribution travels: the last stage builds q itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from deskfleet.common.kv_ledger import CompactionPolicy
from deskfleet.common.model_spec import ModelSpec

from .draft import DraftRow, Proposal

DEFAULT_MAX_NGRAM = 4
# The shortest match worth a verification depends on what a verification costs against a plain step. On one
# PC a 1-token match is mostly a guess whose verification costs ~2.5 plain calls plus the width changes around
# it: 60 held-out prompts of the demo pair, two A/B runs, lookup K=8 1.36 / 1.35x with 1-token matches
# proposed against 1.51 / 1.50x without (adaptive K 1.42 / 1.42x -> 1.51 / 1.53x; the 12 bench prompts
# level), and the 279M code target's lookup first measured its best at 2 as well (1.82 / 1.89 / 1.86x for
# 1 / 2 / 3). Over the fleet a verification costs little more than a step, whose hops dominate: 2 PCs, 2
# streams, demo target, 5 interleaved pairs, 1.40-1.56x (median 1.52) with 1-token matches against 1.02-1.52x
# (median 1.48) without, 4 of the 5 pairs ahead. (A gate that weighed each run's measured step costs was
# tried: it opened on the adaptive variant's cheap small-K verifications and lost on one PC.)
DEFAULT_MIN_NGRAM = 2  # one PC
FLEET_MIN_NGRAM = 1  # a chain of PCs
# Adaptive K's prior for a copied token's acceptance. A match of two tokens or more mostly goes on as it went before:
# the demo target's 12 bench prompts, K fixed at 8, accepted 461 copied tokens against 39 rejections (0.92), and
# 48 of the 96 full proposals whole. From a draft model's prior (0.6) a stream's first rounds ran at K 3 and
# climbed: on the demo pair, one PC, three interleaved rounds, adaptive K made 1.73x of plain decoding against
# 1.83x with this prior (K fixed at 8: 1.85x); on 60 held-out prompts 1.69x against 1.83x (K=8 1.79x), ahead in
# every round.
LOOKUP_PRIOR_ACCEPTANCE = 0.9


def lookup_continuation(context: Sequence[int], k: int, max_ngram: int = DEFAULT_MAX_NGRAM,
                        min_ngram: int = DEFAULT_MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the context's longest matching
    suffix (lengths max_ngram down to min_ngram); [] when no suffix occurred before."""
    check_ngrams(max_ngram, min_ngram)
    tokens = np.asarray(context, dtype=np.int64)
    total = len(tokens)
    if k <= 0 or total < 2:
        return []
    # Every earlier position holding the last token ends a 1-token match (the last position itself is
    # excluded, so a token always follows); grow the matches backwards one token at a time.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best_end = -1
    for n in range(1, min(max_ngram, total - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[total - n]]
        if ends.size == 0:
            break
        if n >= min_ngram:
            best_end = int(ends[-1])  # the most recent of the longest matches so far
    if best_end < 0:
        return []
    follow = best_end + 1
    proposal: list[int] = []
    for index in range(follow, follow + k):
        proposal.append(int(tokens[index]) if index < total else proposal[index - total])
    return proposal


def check_ngrams(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"n-gram lengths must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")


class PromptLookupDraft:
    """A Drafter with no model: proposals come from each stream's confirmed tokens."""

    prior_acceptance = LOOKUP_PRIOR_ACCEPTANCE

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM) -> None:
        check_ngrams(max_ngram, min_ngram)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._batches: dict[int, set[int]] = {}  # micro-batch -> its speculative streams

    def check_compatible(self, target: ModelSpec) -> None:
        pass  # any target: the proposals are its own tokens

    # Public methods: micro-batch bookkeeping (there is no draft state to keep)

    def prefill(self, micro_batch_id: int, stream_id: int, prompt: list[int]) -> None:
        self._batches[micro_batch_id] = {stream_id}

    def extend(self, micro_batch_id: int, stream_id: int, tokens: list[int]) -> None:
        pass  # proposals are looked up in the confirmed tokens, which the engine passes

    def merge(self, target_batch: int, stream_id: int, source_batch: int) -> None:
        self._batches.pop(source_batch, None)
        self._batches.setdefault(target_batch, set()).add(stream_id)

    def has_batch(self, micro_batch_id: int) -> bool:
        return micro_batch_id in self._batches

    def holds(self, micro_batch_id: int) -> bool:
        return micro_batch_id in self._batches  # bookkeeping only, freed at once

    def drop(self, micro_batch_id: int, stream_ids: set[int]) -> None:
        streams = self._batches.get(micro_batch_id)
        if streams is None:
            return
        streams -= stream_ids
        if not streams:
            self.release(micro_batch_id)

    def release(self, micro_batch_id: int) -> None:
        self._batches.pop(micro_batch_id, None)

    def compact(self, micro_batch_id: int, policy: CompactionPolicy) -> None:
        pass  # no KV cache of its own

    def after_verify(self, micro_batch_id: int, stream_id: int, confirmed_before: int, k: int,
                     accepted: int) -> None:
        pass  # the next proposal is looked up in the confirmed tokens afresh

    # Public methods: proposals

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        started = time.perf_counter()
        if micro_batch_id not in self._batches:
            raise ValueError(f"micro-batch {micro_batch_id} has no speculative streams")
        tokens = {row.stream_id: lookup_continuation(row.confirmed, row.k, self.max_ngram, self.min_ngram)
                  for row in rows}
        return Proposal(tokens=tokens, probs={}, seconds=time.perf_counter() - started, one_hot=True)
