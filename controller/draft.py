"""Drafters beside the driver, and the draft model: proposes K tokens per speculative row of a micro-batch.

`Drafter` is what the engine calls; `DraftModel` (a small model of the same tokenizer),
`PromptLookupDraft` (controller/prompt_lookup.py: copies from the stream's own context) and
`LookupFirstDraft` (controller/lookup_first.py: copies where it can, the draft model elsewhere) implement it.

The draft model prefills each stream alone, then holds every running stream as a row of ONE batched state (its
pool), whatever micro-batch the stream runs in on the target: a round's proposals for the rows of several
micro-batches are one call of the draft model per token. Over a fleet the driver runs a micro-batch per PC, a row
each, and drafted them one micro-batch at a time: the controller spent 52-71% of the wall drafting on 2-4 PCs
with the demo pair (run S5), against 34% on 1 PC, whose one micro-batch drafts all rows at once. Per stream it
remembers how many confirmed tokens its KV cache holds; each round feeds the confirmed tokens it has not seen
(one, or two after a fully accepted round), then its own proposals one at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from deskfleet.agent.stage import CompileSettings, LayerRange, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.kv_ledger import CompactionPolicy
from deskfleet.common.model_spec import ManifestError, ModelSpec, load_manifest
from deskfleet.common.speculative import SamplingParams, sample, sampling_probs
from deskfleet.common.wire import ForwardResult

from .batch_track import BatchTrack


@dataclass(frozen=True)
class DraftRow:
    stream_id: int
    confirmed: list[int]  # prompt + generated so far; its last token is not in any cache yet
    k: int
    sampling: SamplingParams | None  # None: greedy
    seed: int


@dataclass(frozen=True)
class Proposal:
    tokens: dict[int, list[int]]  # by stream id: its draft tokens
    probs: dict[int, npt.NDArray[np.float32]]  # by stream id, sampled rows only: q [k, V]
    seconds: float
    one_hot: bool = False  # tokens chosen deterministically: q is 1 at each token, `probs` stays empty


def check_draft_spec(draft: ModelSpec, target: ModelSpec) -> None:
    """ValueError unless a draft model of spec `draft` can draft for `target` (read from the manifests alone)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) differs from the target's "
                         f"({target.vocab_size}): they must share a tokenizer")
    if draft.max_context < target.max_context:
        raise ValueError(f"the draft's context ({draft.max_context} positions) is shorter than the "
                         f"target's ({target.max_context}): a stream would outgrow the draft mid-generation; "
                         f"export the draft with --max-context {target.max_context}")


def mix_seed(seed: int, position: int, salt: int) -> int:
    """A per-(stream, position) seed, so a stream's draws do not depend on its micro-batch."""
    return int(np.random.SeedSequence([seed, position, salt]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class Drafter(Protocol):
    """What the engine asks of a drafter. Micro-batches mirror the target's by stream id (only speculative
    streams have a draft row); calls come from the driver's thread."""

    def check_compatible(self, target: ModelSpec) -> None:
        """Refuse a target it cannot draft for (ValueError naming why)."""

    def prefill(self, micro_batch_id: int, stream_id: int, prompt: list[int]) -> None:
        """A new one-row micro-batch holding this stream's prompt (or its first chunk: extend() feeds the rest)."""

    def extend(self, micro_batch_id: int, stream_id: int, tokens: list[int]) -> None:
        """The next chunk of the prompt a prefill() began (the engine feeds a long prompt in chunks while
        other streams run, the draft model's share of it too)."""

    def merge(self, target_batch: int, stream_id: int, source_batch: int) -> None:
        """The stream of one-row `source_batch` joins `target_batch`."""

    def has_batch(self, micro_batch_id: int) -> bool: ...

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        """Up to row.k draft tokens per row. A drafter with state of its own (DraftModel) proposes exactly
        row.k; a stateless one may propose fewer or none: the engine then calls after_verify with k = the
        number proposed, and not at all for a row that proposed nothing. A drafter whose `pools_micro_batches`
        is true also takes, in one call, rows of several micro-batches (`micro_batch_id` names one of them)."""

    def after_verify(self, micro_batch_id: int, stream_id: int, confirmed_before: int, k: int,
                     accepted: int) -> None:
        """The target accepted `accepted` of the k tokens proposed for the stream."""

    def drop(self, micro_batch_id: int, stream_ids: set[int]) -> None: ...

    def release(self, micro_batch_id: int) -> None: ...

    def compact(self, micro_batch_id: int, policy: CompactionPolicy) -> None: ...


POOL_BATCH = 2**31 - 1  # the draft model's own id for its pool of running rows (the engine numbers up from 0)


class DraftModel:
    """A one-stage model run in this process. Not thread-safe: the driver's thread calls it.

    A stream is prefilled in a one-row micro-batch of its own (the target's prefill id), and joins the pool, one
    batched state of every running stream, when it is first asked to propose (or when the engine merges it into a
    running micro-batch): the pool's rows are streams of any of the target's micro-batches."""

    pools_micro_batches = True

    def __init__(self, model_dir: Path, settings: CompileSettings | None = None) -> None:
        manifest = load_manifest(Path(model_dir))
        self.spec = manifest.spec
        stage = Stage(Path(model_dir), manifest, LayerRange(0, self.spec.num_layers, self.spec.num_layers), settings)
        self._executor = StageExecutor(stage, self.spec.max_context)
        self._tracks: dict[int, BatchTrack] = {}  # POOL_BATCH, and one-row prefills by the target's micro-batch id
        self._seen: dict[int, int] = {}  # by stream: confirmed tokens its cache holds
        self._home: dict[int, int] = {}  # by stream: the track holding its row (its prefill's id, or POOL_BATCH)
        self._batch_of: dict[int, int] = {}  # by stream: the target's micro-batch it runs in

    def check_compatible(self, target: ModelSpec) -> None:
        check_draft_spec(self.spec, target)

    # Public methods

    def prefill(self, micro_batch_id: int, stream_id: int, prompt: list[int]) -> None:
        """Fill a new one-row micro-batch with the prompt, or its first chunk (its output token is not needed)."""
        if micro_batch_id == POOL_BATCH or micro_batch_id in self._tracks:
            raise ValueError(f"the draft model already holds micro-batch {micro_batch_id}")
        track = self._tracks[micro_batch_id] = BatchTrack(micro_batch_id, self.spec.max_context)
        track.add_row(stream_id)
        self._home[stream_id] = self._batch_of[stream_id] = micro_batch_id
        self._executor.run(track.step([prompt]))
        self._seen[stream_id] = len(prompt)

    def extend(self, micro_batch_id: int, stream_id: int, tokens: list[int]) -> None:
        """Feed the next chunk of the prompt of a stream that prefill() began (alone: the other rows of its track,
        if it is in the pool, feed nothing)."""
        if self._batch_of.get(stream_id) != micro_batch_id:
            raise ValueError(f"stream {stream_id} is not a prefill of micro-batch {micro_batch_id} in the draft model")
        track = self._tracks[self._home[stream_id]]
        self._run(track, [tokens if stream == stream_id else [] for stream in track.stream_ids])
        self._seen[stream_id] += len(tokens)

    def merge(self, target_batch: int, stream_id: int, source_batch: int) -> None:
        """The stream prefilled in `source_batch` runs in the target's `target_batch` now: it joins the pool."""
        if self._home.get(stream_id) != source_batch:
            raise ValueError(f"stream {stream_id} is not the prefill of micro-batch {source_batch} in the draft model")
        self._batch_of[stream_id] = target_batch
        self._join_pool(stream_id)

    def has_batch(self, micro_batch_id: int) -> bool:
        return micro_batch_id in self._batch_of.values()

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        """k draft tokens for each row: rows of any of the target's micro-batches, drafted together in the pool."""
        started = time.perf_counter()
        by_stream = {row.stream_id: row for row in rows}
        unknown = sorted(set(by_stream) - set(self._home))
        if unknown:
            raise ValueError(f"draft rows name streams the draft model does not hold: {unknown}")
        for stream in by_stream:
            self._join_pool(stream)
        track = self._tracks[POOL_BATCH]
        # A stream left out this round feeds nothing; it catches up on its confirmed tokens when next asked.
        ordered = [by_stream.get(stream, DraftRow(stream, [], 0, None, 0)) for stream in track.stream_ids]
        width = max((row.k for row in ordered), default=0)
        tokens: list[list[int]] = [[] for _ in ordered]
        probs = np.zeros((len(ordered), width, self.spec.vocab_size), dtype=np.float32) if any(
            row.sampling is not None for row in ordered) else None
        for step in range(width):
            feed: list[list[int]] = []
            for index, row in enumerate(ordered):
                if step >= row.k:
                    feed.append([])
                elif step == 0:
                    feed.append(row.confirmed[self._seen[row.stream_id]:])
                else:
                    feed.append([tokens[index][-1]])
            result = self._run(track, feed, return_logits=probs is not None)
            self._take(result, ordered, feed, tokens, probs, step, track)
        sampled = {row.stream_id: probs[index, : row.k] for index, row in enumerate(ordered)
                   if probs is not None and row.sampling is not None}
        return Proposal(tokens={row.stream_id: tokens[index] for index, row in enumerate(ordered)
                                if row.stream_id in by_stream},
                        probs=sampled, seconds=time.perf_counter() - started)

    def after_verify(self, micro_batch_id: int, stream_id: int, confirmed_before: int, k: int, accepted: int) -> None:
        """Roll back the draft tokens the target rejected (the draft fed its first k-1 proposals)."""
        kept = min(accepted, k - 1)
        self._tracks[self._home[stream_id]].reject(stream_id, (k - 1) - kept)
        self._seen[stream_id] = confirmed_before + kept

    def drop(self, micro_batch_id: int, stream_ids: set[int]) -> None:
        """The streams left the target's micro-batch: their rows go (a track left with none is released)."""
        by_track: dict[int, set[int]] = {}
        for stream in stream_ids:
            if self._batch_of.get(stream) == micro_batch_id:
                by_track.setdefault(self._home.pop(stream), set()).add(stream)
                del self._batch_of[stream]
                self._seen.pop(stream, None)
        for track_id, streams in by_track.items():
            track = self._tracks[track_id]
            track.drop(streams)
            if track.rows == 0:
                self._release_track(track_id)

    def release(self, micro_batch_id: int) -> None:
        """The target released the micro-batch: every row of its streams goes (a finished keep_kv stream's
        micro-batch is released, not dropped)."""
        self.drop(micro_batch_id, {stream for stream, batch in self._batch_of.items() if batch == micro_batch_id})

    def compact(self, micro_batch_id: int, policy: CompactionPolicy) -> None:
        """Compact the pool where the policy finds it pays, if it holds a stream of the micro-batch (only the pool's
        rows roll back: a prefill's track has no dead slots, and one compacted would join the pool out of step)."""
        pool = self._tracks.get(POOL_BATCH)
        if pool is not None and any(batch == micro_batch_id and self._home[stream] == POOL_BATCH
                                    for stream, batch in self._batch_of.items()):
            pool.compact(policy)

    # Private methods

    def _join_pool(self, stream_id: int) -> None:
        """Queue the admission of the stream's one-row prefill into the pool (done at the pool's next step)."""
        source_id = self._home[stream_id]
        if source_id == POOL_BATCH:
            return
        source = self._tracks[source_id]
        if source.pending:  # its state would not be what its ledger says (nothing queues deltas on a prefill)
            raise RuntimeError(f"the draft model's prefill of stream {stream_id} has deltas it never ran")
        del self._tracks[source_id]
        pool = self._tracks.get(POOL_BATCH)
        if pool is None:
            pool = self._tracks[POOL_BATCH] = BatchTrack(POOL_BATCH, self.spec.max_context)
        pool.admit(stream_id, source_id, int(source.ledger.next_positions[0]))
        self._home[stream_id] = POOL_BATCH

    def _run(self, track: BatchTrack, feed: list[list[int]], return_logits: bool = False) -> ForwardResult:
        message = track.step(feed)
        try:
            result = self._executor.run(message, return_logits=return_logits)
        except BaseException:  # the step took its admitted sources off the track: free them here
            for source in message.admit_from:
                self._executor.release(source)
            raise
        if not isinstance(result, ForwardResult):
            raise TypeError("the draft model's single stage must return a ForwardResult")
        return result

    def _release_track(self, track_id: int) -> None:
        track = self._tracks.pop(track_id)
        for source in track.admit_from:  # admissions the track never stepped: their prefills
            self._executor.release(source)
        self._executor.release(track_id)

    def _take(self, result: ForwardResult, ordered: list[DraftRow], feed: list[list[int]],
              tokens: list[list[int]], probs: npt.NDArray[np.float32] | None, step: int, track: BatchTrack) -> None:
        for index, row in enumerate(ordered):
            if not feed[index]:
                continue
            if row.sampling is None:
                tokens[index].append(int(result.next_token_ids[index]))
                continue
            assert probs is not None and result.logits is not None
            logits = np.asarray(result.logits)[index, 0]  # the row's last live position (no draft: N = 1)
            q = sampling_probs(logits[None, :], row.sampling)[0]
            position = track.next_position(row.stream_id)
            try:
                tokens[index].append(sample(q, np.random.default_rng(mix_seed(row.seed, position, 1))))
            except ValueError as error:  # NaN or inf logits: nothing to draw from
                raise ValueError(f"the draft model gave stream {row.stream_id} no distribution to sample its "
                                 f"token at position {position} from ({error}): its logits hold NaN or inf, as "
                                 "a lower precision can give on some devices; run with --precision f32, or "
                                 "without --draft") from None
            probs[index, step] = q


def target_settings(settings: CompileSettings, draft: Path | None, prompt_lookup: bool) -> CompileSettings:
    """The settings to compile a run's target stages (and draft model) with: those for drafting
    (`CompileSettings.for_drafting`) when the run drafts with either drafter."""
    return settings.for_drafting() if draft is not None or prompt_lookup else settings


def open_drafter(draft: Path | None, prompt_lookup: bool, settings: CompileSettings | None = None,
                 target: ModelSpec | None = None, over_fleet: bool = False) -> Drafter | None:
    """The drafter a command asked for: a draft model's export folder, prompt lookup, both (prompt lookup
    first, the draft model where the context has no match: controller/lookup_first.py), or none.

    With `target`, a draft model that cannot draft for it is refused (ValueError) from its manifest, before
    it compiles. `over_fleet`: the target runs on a chain of PCs, where prompt lookup alone also proposes from a
    1-token match (controller/prompt_lookup.py says why); prompt lookup first keeps its own minimum (2) there:
    a row with no longer match gets the draft model's proposal, not a 1-token guess (chosen, not measured over
    a fleet)."""
    if draft is not None:
        try:  # named as the draft's: with --model beside it, the folder alone may not say which one is wrong
            manifest = load_manifest(Path(draft))
        except ManifestError as error:
            raise ManifestError(f"--draft: {error}") from None
        if target is not None:
            check_draft_spec(manifest.spec, target)
    if prompt_lookup:
        from .prompt_lookup import DEFAULT_MIN_NGRAM, FLEET_MIN_NGRAM, PromptLookupDraft

        if draft is None:
            return PromptLookupDraft(min_ngram=FLEET_MIN_NGRAM if over_fleet else DEFAULT_MIN_NGRAM)
        from .lookup_first import LookupFirstDraft

        return LookupFirstDraft(DraftModel(draft, settings))
    return DraftModel(draft, settings) if draft is not None else None
