"""Drafters beside the driver, and the draft model: proposes K tokens per speculative row of a micro-batch.

`Drafter` is what the engine calls; `DraftModel` (a small model of the same tokenizer),
`PromptLookupDraft` (controller/prompt_lookup.py: copies from the stream's own context) and
`LookupFirstDraft` (controller/lookup_first.py: copies where it can, the draft model elsewhere) implement it.

Its micro-batches mirror the target's by stream id (only speculative streams have a draft row). Per
stream it remembers how many confirmed tokens its KV cache holds; each round feeds the confirmed tokens
it has not seen (one, or two after a fully accepted round), then its own proposals one at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from deskfleet.agent.stage import CompileSettings, LayerRange, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.kv_ledger import CompactionPolicy
from deskfleet.common.model_spec import Manifest, ManifestError, ModelSpec, load_manifest
from deskfleet.common.speculative import DEFAULT_PRIOR_ACCEPTANCE, SamplingParams, sample, sampling_probs
from deskfleet.common.wire import ForwardResult

from .batch_track import BatchTrack

log = logging.getLogger(__name__)


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


def check_draft_for(draft_dir: Path, draft: Manifest, target_dir: Path, target: Manifest) -> None:
    """ValueError unless the draft export in `draft_dir` can draft for the target export in `target_dir`: their
    specs (check_draft_spec) and their tokenizers (check_draft_tokenizer)."""
    check_draft_spec(draft.spec, target.spec)
    check_draft_tokenizer(draft_dir, draft, target_dir, target)


# A draft whose tokenizer names more than this share of the target's ids otherwise is refused; fewer are warned of:
# releases of one tokenizer rename a few reserved special tokens (Llama 3.2's drafts for Llama 3's targets), which
# ordinary text never meets.
MAX_DIFFERING_TOKEN_SHARE = 0.01


def check_draft_tokenizer(draft_dir: Path, draft: Manifest, target_dir: Path, target: Manifest) -> None:
    """ValueError where the draft's tokenizer gives token ids to other tokens than the target's does, for more than
    MAX_DIFFERING_TOKEN_SHARE of the target's ids (a warning for fewer): a draft of another tokenizer of the same
    vocabulary size passed check_draft_spec, and drafted text the target never accepted (mean accepted 0.0), slower
    than no drafting, without a word. Two exports of one tokenizer have the same tokenizer.json (its sha256 in the
    manifests); where the files differ, their vocabularies (added tokens too) are compared. An export without a
    tokenizer.json is not checked."""
    name = "tokenizer.json"
    if name not in draft.files or name not in target.files or draft.files[name].sha256 == target.files[name].sha256:
        return
    from tokenizers import Tokenizer

    def ids_to_tokens(folder: Path, which: str) -> dict[int, str]:
        try:
            vocabulary = Tokenizer.from_file(str(folder / name)).get_vocab(with_added_tokens=True)
        except Exception as error:  # the library's own error type, unnamed: a missing or broken file
            raise ValueError(f"the {which}'s {folder / name} cannot be read as a tokenizer: {error}") from None
        return {token_id: token for token, token_id in vocabulary.items()}

    drafts, targets = ids_to_tokens(draft_dir, "draft"), ids_to_tokens(target_dir, "target")
    differing = sorted(token_id for token_id in drafts.keys() | targets.keys()
                       if drafts.get(token_id) != targets.get(token_id))
    if not differing:
        return
    first = differing[0]
    said = (f"{len(differing):,} of the {len(targets):,} token ids of the target's tokenizer name other tokens in "
            f"the draft's (id {first}: {drafts.get(first)!r} in the draft, {targets.get(first)!r} in the target)")
    if len(differing) <= MAX_DIFFERING_TOKEN_SHARE * len(targets):
        log.warning("--draft: %s; drafting goes on: text that never meets those tokens drafts as with the target's "
                    "own tokenizer", said)
        return
    raise ValueError(f"the draft's tokenizer is not the target's: {said}, so the target would accept almost none of "
                     "its proposals; give a draft model exported with the target's tokenizer")


def _warn_if_not_smaller(draft: ModelSpec, target: ModelSpec) -> None:
    """Warn where the draft model multiplies as many weights a token as the target, or more (the target given as
    its own draft, or the two swapped): every round then costs more than the tokens it can save, and the run went
    on slower than plain decoding without a word."""
    def weights(spec: ModelSpec) -> int:
        return spec.num_layers * spec.layer_parameters + spec.head_parameters

    if weights(draft) >= weights(target):
        log.warning("--draft is not smaller than the target (%.0fM against %.0fM weights a token): drafting with it "
                    "is slower than decoding plainly; give a much smaller draft model (the same tokenizer), or "
                    "--prompt-lookup", weights(draft) / 1e6, weights(target) / 1e6)


def mix_seed(seed: int, position: int, salt: int) -> int:
    """A per-(stream, position) seed, so a stream's draws do not depend on its micro-batch."""
    return int(np.random.SeedSequence([seed, position, salt]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class Drafter(Protocol):
    """What the engine asks of a drafter. Micro-batches mirror the target's by stream id (only speculative
    streams have a draft row); calls come from the driver's thread.

    `prior_acceptance`: the chance that one of its draft tokens is accepted, as adaptive K assumes it until the
    rounds have measured it (AdaptiveK's prior_alpha); it sets the K of a stream's first rounds."""

    prior_acceptance: float

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

    def holds(self, micro_batch_id: int) -> bool:
        """Whether it still holds state under this id, its own or as the source of an admission not stepped yet (a
        draft model frees a merged prefill at its next step on the micro-batch it joined): a new micro-batch of
        that id must wait (the prefix cache's entries keep the ids of the prefills they were)."""

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        """Up to row.k draft tokens per row. A drafter with state of its own (DraftModel) proposes exactly
        row.k; a stateless one may propose fewer or none: the engine then calls after_verify with k = the
        number proposed, and not at all for a row that proposed nothing."""

    def after_verify(self, micro_batch_id: int, stream_id: int, confirmed_before: int, k: int,
                     accepted: int) -> None:
        """The target accepted `accepted` of the k tokens proposed for the stream."""

    def drop(self, micro_batch_id: int, stream_ids: set[int]) -> None: ...

    def release(self, micro_batch_id: int) -> None: ...

    def compact(self, micro_batch_id: int, policy: CompactionPolicy) -> None: ...


class DraftModel:
    """A one-stage model run in this process. Not thread-safe: the driver's thread calls it."""

    prior_acceptance = DEFAULT_PRIOR_ACCEPTANCE

    def __init__(self, model_dir: Path, settings: CompileSettings | None = None) -> None:
        manifest = load_manifest(Path(model_dir))
        self.spec = manifest.spec
        stage = Stage(Path(model_dir), manifest, LayerRange(0, self.spec.num_layers, self.spec.num_layers), settings)
        self._executor = StageExecutor(stage, self.spec.max_context)
        self._tracks: dict[int, BatchTrack] = {}
        self._seen: dict[int, int] = {}

    def check_compatible(self, target: ModelSpec) -> None:
        check_draft_spec(self.spec, target)

    # Public methods

    def prefill(self, micro_batch_id: int, stream_id: int, prompt: list[int]) -> None:
        """Fill a new one-row micro-batch with the prompt, or its first chunk (its output token is not needed)."""
        track = self._tracks[micro_batch_id] = BatchTrack(micro_batch_id, self.spec.max_context)
        track.add_row(stream_id)
        self._executor.run(track.step([prompt]))
        self._seen[stream_id] = len(prompt)

    def extend(self, micro_batch_id: int, stream_id: int, tokens: list[int]) -> None:
        """Feed the next chunk of the prompt of a one-row micro-batch that prefill() began."""
        track = self._tracks.get(micro_batch_id)
        if track is None or track.stream_ids != [stream_id]:
            raise ValueError(f"micro-batch {micro_batch_id} is not the one-row prefill of stream {stream_id}")
        self._executor.run(track.step([tokens]))
        self._seen[stream_id] += len(tokens)

    def merge(self, target_batch: int, stream_id: int, source_batch: int) -> None:
        """Queue the admission of a prefilled one-row micro-batch into `target_batch`."""
        source = self._tracks.pop(source_batch)
        track = self._tracks.get(target_batch)
        if track is None:
            track = self._tracks[target_batch] = BatchTrack(target_batch, self.spec.max_context)
        track.admit(stream_id, source_batch, int(source.ledger.next_positions[0]))

    def has_batch(self, micro_batch_id: int) -> bool:
        return micro_batch_id in self._tracks

    def holds(self, micro_batch_id: int) -> bool:
        return micro_batch_id in self._executor.micro_batch_ids() or \
            any(micro_batch_id in track.admit_from for track in self._tracks.values())

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        """k draft tokens for each row (rows in the draft track's order, a subset of the target's)."""
        started = time.perf_counter()
        track = self._tracks[micro_batch_id]
        by_stream = {row.stream_id: row for row in rows}
        if not set(by_stream) <= set(track.stream_ids):
            raise ValueError("draft rows name streams the draft micro-batch does not hold")
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
            message = track.step(feed)
            try:
                result = self._executor.run(message, return_logits=probs is not None)
            except BaseException:  # the step took its admitted sources off the track: free them here
                for source in message.admit_from:
                    self._executor.release(source)
                raise
            if not isinstance(result, ForwardResult):
                raise TypeError("the draft model's single stage must return a ForwardResult")
            self._take(result, ordered, feed, tokens, probs, step, track)
        sampled = {row.stream_id: probs[index, : row.k] for index, row in enumerate(ordered)
                   if probs is not None and row.sampling is not None}
        return Proposal(tokens={row.stream_id: tokens[index] for index, row in enumerate(ordered)
                                if row.stream_id in by_stream},
                        probs=sampled, seconds=time.perf_counter() - started)

    def after_verify(self, micro_batch_id: int, stream_id: int, confirmed_before: int, k: int, accepted: int) -> None:
        """Roll back the draft tokens the target rejected (the draft fed its first k-1 proposals)."""
        kept = min(accepted, k - 1)
        self._tracks[micro_batch_id].reject(stream_id, (k - 1) - kept)
        self._seen[stream_id] = confirmed_before + kept

    def drop(self, micro_batch_id: int, stream_ids: set[int]) -> None:
        track = self._tracks.get(micro_batch_id)
        if track is None:
            return
        track.drop(stream_ids)
        for stream in stream_ids:
            self._seen.pop(stream, None)
        if track.rows == 0:
            self.release(micro_batch_id)

    def release(self, micro_batch_id: int) -> None:
        track = self._tracks.pop(micro_batch_id, None)
        if track is not None:
            for stream in track.stream_ids:  # a finished keep_kv stream's micro-batch is released, not dropped
                self._seen.pop(stream, None)
            for source in track.admit_from:  # merged streams whose admission never stepped: their prefill
                self._executor.release(source)
        self._executor.release(micro_batch_id)

    def compact(self, micro_batch_id: int, policy: CompactionPolicy) -> None:
        track = self._tracks.get(micro_batch_id)
        if track is not None:
            track.compact(policy)

    # Private methods

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
                 target: Path | None = None, over_fleet: bool = False) -> Drafter | None:
    """The drafter a command asked for: a draft model's export folder, prompt lookup, both (prompt lookup
    first, the draft model where the context has no match: controller/lookup_first.py), or none.

    With `target` (the target's export folder), a draft model that cannot draft for it is refused (ValueError)
    from the manifests and tokenizers, before it compiles. `over_fleet`: the target runs on a chain of PCs, where
    prompt lookup alone also proposes from a 1-token match (controller/prompt_lookup.py says why); prompt lookup
    first keeps its own minimum (2) there: a row with no longer match gets the draft model's proposal, not a 1-token
    guess (chosen, not measured over a fleet)."""
    if draft is not None:
        try:  # named as the draft's: with --model beside it, the folder alone may not say which one is wrong
            manifest = load_manifest(Path(draft))
        except ManifestError as error:
            raise ManifestError(f"--draft: {error}") from None
        if target is not None:
            target_manifest = load_manifest(target)
            check_draft_for(Path(draft), manifest, target, target_manifest)
            _warn_if_not_smaller(manifest.spec, target_manifest.spec)
    if prompt_lookup:
        from .prompt_lookup import DEFAULT_MIN_NGRAM, FLEET_MIN_NGRAM, PromptLookupDraft

        if draft is None:
            return PromptLookupDraft(min_ngram=FLEET_MIN_NGRAM if over_fleet else DEFAULT_MIN_NGRAM)
        from .lookup_first import LookupFirstDraft

        return LookupFirstDraft(_draft_model(draft, settings))
    return _draft_model(draft, settings) if draft is not None else None


def _draft_model(draft: Path, settings: CompileSettings | None) -> DraftModel:
    """DraftModel(draft, settings), a damaged file (a truncated .bin) named as the draft's, as its manifest is."""
    try:
        return DraftModel(draft, settings)
    except ManifestError as error:
        raise ManifestError(f"--draft: {error}") from None
