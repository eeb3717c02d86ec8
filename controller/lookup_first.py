"""The draft model with prompt lookup first: copied tokens where the context repeats itself, drafted ones
elsewhere.

Each round, for each speculative row, the longest suffix of the row's tokens that occurred earlier (at
least `min_ngram` tokens: a 1-token match is a guess) is looked up (controller/prompt_lookup.py). A match
gives k copied tokens and the row skips the draft model this round: those proposals cost microseconds
instead of k draft calls. The other rows are drafted by the model as usual, in one batched call per
token. A row that skipped the model catches up on its confirmed tokens at its next drafted round (one
wider draft call; the draft model's cache never holds copied proposals, so nothing needs rolling back).

Sampled rows stay exact: a copied proposal's q is one-hot at each token, and the row's [k, V] q says so.
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt

from deskfleet.common.kv_ledger import CompactionPolicy
from deskfleet.common.model_spec import ModelSpec

from .draft import DraftModel, DraftRow, Proposal
from .prompt_lookup import DEFAULT_MAX_NGRAM, check_ngrams, lookup_continuation

DEFAULT_MIN_NGRAM = 2  # 279M code target, adaptive K, one round each: min 1 / 2 / 3 gave 1.82 / 1.89 / 1.86x


class LookupFirstDraft:
    """A Drafter: prompt lookup where it finds a match of `min_ngram` tokens or more, else `model`."""

    def __init__(self, model: DraftModel, max_ngram: int = DEFAULT_MAX_NGRAM,
                 min_ngram: int = DEFAULT_MIN_NGRAM) -> None:
        check_ngrams(max_ngram, min_ngram)
        self.model = model
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._copied: set[int] = set()  # streams whose last proposal was copied, not drafted
        self.copied_rounds = 0
        self.drafted_rounds = 0
        # the draft model's: until its rounds are measured, K suits the rounds it drafts, the dearer ones
        self.prior_acceptance = model.prior_acceptance

    # Public methods: the model's bookkeeping, unchanged

    def check_compatible(self, target: ModelSpec) -> None:
        self.model.check_compatible(target)

    def prefill(self, micro_batch_id: int, stream_id: int, prompt: list[int]) -> None:
        self.model.prefill(micro_batch_id, stream_id, prompt)

    def extend(self, micro_batch_id: int, stream_id: int, tokens: list[int]) -> None:
        self.model.extend(micro_batch_id, stream_id, tokens)

    def merge(self, target_batch: int, stream_id: int, source_batch: int) -> None:
        self.model.merge(target_batch, stream_id, source_batch)

    def has_batch(self, micro_batch_id: int) -> bool:
        return self.model.has_batch(micro_batch_id)

    def holds(self, micro_batch_id: int) -> bool:
        return self.model.holds(micro_batch_id)

    def drop(self, micro_batch_id: int, stream_ids: set[int]) -> None:
        self._copied -= stream_ids
        self.model.drop(micro_batch_id, stream_ids)

    def release(self, micro_batch_id: int) -> None:
        self.model.release(micro_batch_id)

    def compact(self, micro_batch_id: int, policy: CompactionPolicy) -> None:
        self.model.compact(micro_batch_id, policy)

    # Public methods: proposals

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        started = time.perf_counter()
        copied: dict[int, list[int]] = {}
        drafted: list[DraftRow] = []
        for row in rows:
            if copy := lookup_continuation(row.confirmed, row.k, self.max_ngram, self.min_ngram):
                copied[row.stream_id] = copy
            else:
                drafted.append(row)
        self._copied -= {row.stream_id for row in drafted}
        self._copied |= set(copied)
        self.copied_rounds += len(copied)
        self.drafted_rounds += len(drafted)
        tokens = dict(copied)
        probs: dict[int, npt.NDArray[np.float32]] = {}
        if drafted:
            proposal = self.model.propose(micro_batch_id, drafted)
            tokens.update(proposal.tokens)
            probs.update(proposal.probs)
        sampled_copies = any(row.sampling is not None for row in rows if row.stream_id in copied)
        if sampled_copies and not probs:
            # every sampled row was copied, so every q is one-hot: the last stage builds them itself, and no
            # [rows, K, vocabulary] tensor travels with the step (8 rows, K=8, 32k words: 8 MB a hop)
            return Proposal(tokens=tokens, probs={}, seconds=time.perf_counter() - started, one_hot=True)
        vocab = self.model.spec.vocab_size
        for row in rows:
            if row.stream_id in copied and row.sampling is not None:  # q one-hot at each copied token
                one_hot = np.zeros((row.k, vocab), dtype=np.float32)
                one_hot[np.arange(row.k), copied[row.stream_id]] = 1.0
                probs[row.stream_id] = one_hot
        return Proposal(tokens=tokens, probs=probs, seconds=time.perf_counter() - started)

    def after_verify(self, micro_batch_id: int, stream_id: int, confirmed_before: int, k: int,
                     accepted: int) -> None:
        if stream_id not in self._copied:  # the model fed its proposals: roll back the rejected ones
            self.model.after_verify(micro_batch_id, stream_id, confirmed_before, k, accepted)
