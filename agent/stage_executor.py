"""Runs Forward messages on a stage: per micro-batch a KV-slot Mirror and a session of the stage.

The driver never sends a mask. Each Forward carries the ledger deltas since the micro-batch's previous
step, ending with the AppendSlots of this call; the executor replays them on its Mirror (editing the KV
state on the host where a delta needs it: admitting a prefilled stream, compacting dead slots), then runs
the stage with the mask, positions and beam_idx the mirror gives. The last stage verifies draft tokens
(greedy or exact rejection sampling) and returns only the next token and the accepted count per row (and, for
the rows that ask, the log-probabilities of the tokens it returns: common/logprobs.py).

No torch here: this runs on every employee PC and, in-process, in the controller's local pipeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from deskfleet.common.kv_ledger import (
    AdmitRow,
    AppendSlots,
    Compact,
    CopyRow,
    InvalidateSlots,
    LedgerError,
    Mirror,
    ReorderRows,
    SlotDelta,
    position_ids,
)
from deskfleet.common.logits_adjust import adjusted_logits
from deskfleet.common.logprobs import SCORED_LOGITS_BYTES, chosen_and_top
from deskfleet.common.speculative import (
    SamplingParams,
    greedy_accept,
    sample,
    sampling_probs,
    speculative_accept,
)
from deskfleet.common.wire import DraftInfo, Forward, ForwardResult, LogitsAdjust, SamplingInfo

from .kv_memory_guard import SLOT_GROWTH, KvGrowth, KvMemoryGuard, KvMemoryRefused
from .stage import Stage, StageSession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """What the mirror says the stage must be fed for one call (the attention mask is the mirror's
    `attention_mask()` after the replay: only the stage needs it, the driver does not build it)."""

    append: AppendSlots
    beam_idx: npt.NDArray[np.int64]  # [B]
    position_ids: npt.NDArray[np.int64]  # [B, T]


def replay_deltas(mirror: Mirror, deltas: tuple[SlotDelta, ...],
                  gather_rows: Callable[[npt.NDArray[np.int64]], None] | None = None,
                  admit: Callable[[AdmitRow, int], None] | None = None,
                  compact: Callable[[Compact], None] | None = None,
                  copy: Callable[[CopyRow, int, npt.NDArray[np.bool_]], None] | None = None) -> StepInputs:
    """Apply one step's deltas to `mirror` in order and return what to feed the stage.

    The callbacks edit the KV state on the host where the mirror's contract asks for it: `gather_rows` with a
    pending beam_idx before an AdmitRow, Compact or CopyRow; `admit(delta, ordinal)` and `compact(delta)` right
    after the mirror took those deltas; `copy(delta, ordinal, live)` with the copied row's mask. The driver
    computes the beam_idx and positions it sends from its ledger and a RowOrder (controller/batch_track.py); the
    stage checks them against this.
    """
    if not deltas or not isinstance(deltas[-1], AppendSlots):
        raise LedgerError("a step's deltas must end with the AppendSlots of its call")
    admitted = copied = 0
    for delta in deltas:
        if isinstance(delta, AdmitRow | Compact | CopyRow) and mirror.rows_pending():
            pending = mirror.take_beam_idx()
            if gather_rows is not None:
                gather_rows(pending)
        mirror.apply(delta)
        if isinstance(delta, AdmitRow):
            if admit is not None:
                admit(delta, admitted)
            admitted += 1
        elif isinstance(delta, Compact) and compact is not None:
            compact(delta)
        elif isinstance(delta, CopyRow):
            if copy is not None:
                copy(delta, copied, mirror.mask[delta.row])
            copied += 1
        elif isinstance(delta, AppendSlots) and delta is not deltas[-1]:
            raise LedgerError("AppendSlots must be the last delta of a step")
        elif not isinstance(delta, AppendSlots | ReorderRows | InvalidateSlots | AdmitRow | Compact | CopyRow):
            raise LedgerError(f"unknown slot delta {type(delta).__name__}")
    append = deltas[-1]
    assert isinstance(append, AppendSlots)
    return StepInputs(append=append, beam_idx=mirror.take_beam_idx(), position_ids=position_ids(append))


@dataclass
class _MicroBatch:
    mirror: Mirror
    session: StageSession
    steps: int = field(default=0)
    last_step_id: int = field(default=-1)  # the driver numbers a micro-batch's steps upwards
    last_used: float = field(default_factory=time.monotonic)


class StageExecutor:
    """One stage's micro-batches. Not thread-safe: one worker calls run() and release()."""

    def __init__(self, stage: Stage, max_positions: int, memory_guard: KvMemoryGuard | None = None,
                 kv_bytes_per_slot: int = 0, scratch_bytes_per_token: int = 0) -> None:
        """`memory_guard` (an agent's): asked before a step grows the KV cache, at `kv_bytes_per_slot` (one row's
        token in every layer of the stage) a slot, or makes a call larger than any its micro-batch's request ran,
        at `scratch_bytes_per_token` a token of the call more (common/prefill_scratch.py); a step it refuses
        raises KvMemoryRefused and changes nothing."""
        self.stage = stage
        self.max_positions = max_positions
        self.memory_guard = memory_guard
        self.kv_bytes_per_slot = kv_bytes_per_slot
        self.scratch_bytes_per_token = scratch_bytes_per_token
        self._batches: dict[int, _MicroBatch] = {}
        self._last_step = time.monotonic()  # when a step last ran (or the stage was built)
        self._trimmed = True  # nothing ran since the stage was built, or since its memory was trimmed

    @property
    def micro_batches(self) -> int:
        return len(self._batches)

    def micro_batch_ids(self) -> list[int]:
        """The micro-batches this stage holds state of."""
        return list(self._batches)

    # Public methods

    def run(self, message: Forward, return_logits: bool = False) -> Forward | ForwardResult:
        """Advance one micro-batch by one call; returns the Forward for the next stage, or the result.

        return_logits (last stage, in-process callers such as the draft model): also return the logits
        [B, N, V] at the positions `logits_positions` chose; over the network no logits travel.

        A refused step (LedgerError naming the fault: deltas out of sync, inputs of the wrong shape or out
        of range; KvMemoryRefused: the PC has no memory for the KV cache it would grow) changes nothing: the
        micro-batch, its mirror and KV state, and any micro-batch it would have admitted stay as they were. A
        step whose infer call fails drops its micro-batch (its KV state is then unknown) and says so.
        """
        batch = self._batches.get(message.micro_batch_id)
        created = batch is None
        if batch is None:
            batch = _MicroBatch(Mirror(self.max_positions), self.stage.open_session())
        before = batch.mirror.fork()
        try:
            payload, inputs, copies_dropped = self._prepare(batch, message)
        except LedgerError as error:
            batch.mirror = before
            if created:
                self.stage.recycle(batch.session)
                if message.step_id > 0:  # "append for 1 rows, the micro-batch has 0" alone read as a bad message
                    raise LedgerError(f"{error}: this stage holds nothing of micro-batch {message.micro_batch_id}, "
                                      f"whose step {message.step_id} is not its first (the stage was assigned anew, "
                                      "by a deploy or a re-plan, or rebuilt since its earlier steps, or it freed the "
                                      "micro-batch as idle)") from None
            raise
        except KvMemoryRefused:  # asked before any KV state was edited
            batch.mirror = before
            if created:
                self.stage.recycle(batch.session)
            raise
        except Exception as error:  # the plugin failed while editing the KV state: it is unknown now
            if created:
                self.stage.recycle(batch.session)
            else:
                self.release(message.micro_batch_id)
            raise RuntimeError(f"micro-batch {message.micro_batch_id} step {message.step_id}: {error} (the "
                               "micro-batch was dropped)") from error
        if created:
            self._batches[message.micro_batch_id] = batch
        batch.last_used = self._last_step = time.monotonic()
        self._trimmed = False
        sampled = message.sampling is not None and any(t > 0 for t in message.sampling.temperatures)
        asks_logprobs = message.logprobs is not None and any(top >= 0 for top in message.logprobs)
        scores = message.scored_ids is not None and bool((np.asarray(message.scored_ids, dtype=np.int64) >= 0).any())
        positions = logits_positions(inputs.append, message.draft, every=scores) if self.stage.layers.is_last \
            else None
        try:
            # the mirror's bool mask as it is: the request's int64 input tensor takes it in one casting copy
            output = batch.session.forward(payload, batch.mirror.mask, inputs.position_ids, inputs.beam_idx,
                                           want_logits=sampled or return_logits or asks_logprobs
                                           or message.adjust is not None,
                                           logits_positions=positions)
        except RuntimeError as error:
            self.release(message.micro_batch_id)
            raise RuntimeError(f"{error} (micro-batch {message.micro_batch_id} was dropped: its KV state is "
                               "unknown after a failed call)") from None
        batch.steps += 1
        batch.last_step_id = message.step_id
        if output.hidden is not None:
            return replace(message, input_ids=None, hidden_states=output.hidden, layer_start=self.stage.layers.stop,
                           copies_dropped=copies_dropped)
        assert output.next_tokens is not None
        live = _live_positions(inputs.append, output.next_tokens.shape[1])
        outside = live & ((output.next_tokens < 0) | (output.next_tokens >= self.stage.vocab_size))
        if outside.any():
            raise RuntimeError(f"micro-batch {message.micro_batch_id} step {message.step_id}: the stage chose "
                               f"tokens {output.next_tokens[outside].tolist()} outside the vocabulary of "
                               f"{self.stage.vocab_size} at (row, position) {np.argwhere(outside).tolist()} of a "
                               f"call with live counts {list(inputs.append.live_counts)} (its logits were not "
                               "finite)")
        logits, argmax = output.logits, output.next_tokens
        if message.adjust is not None:
            assert logits is not None
            logits, argmax = adjusted(inputs.append, logits, argmax, message.draft, message.adjust)
        next_tokens, accepted = verify(inputs.append, argmax, logits, message.draft, message.sampling, every=scores)
        result = ForwardResult(micro_batch_id=message.micro_batch_id, step_id=message.step_id,
                               next_token_ids=next_tokens, accepted_counts=accepted,
                               logits=output.logits if return_logits else None, copies_dropped=copies_dropped)
        if asks_logprobs:
            assert message.logprobs is not None and output.logits is not None
            chosen, top_ids, top_logps = returned_logprobs(inputs.append, output.logits, message.draft, next_tokens,
                                                           accepted, message.logprobs, every=scores)
            result = replace(result, token_logprobs=chosen, top_logprob_ids=top_ids, top_logprobs=top_logps)
        if scores:
            assert message.logprobs is not None and message.scored_ids is not None and output.logits is not None
            scored, scored_ids, scored_logps = scored_logprobs(
                output.logits, np.asarray(message.scored_ids, dtype=np.int64), message.logprobs)
            result = replace(result, scored_logprobs=scored, scored_top_ids=scored_ids,
                             scored_top_logprobs=scored_logps)
        return result

    def release(self, micro_batch_id: int) -> None:
        batch = self._batches.pop(micro_batch_id, None)
        if batch is not None:
            self.stage.recycle(batch.session)

    def release_idle(self, max_idle_s: float, now: float | None = None) -> list[int]:
        """Free the micro-batches no step has used for `max_idle_s` (their driver vanished without a
        ReleaseMicroBatch: it crashed, or its chain broke and it re-planned); returns their ids."""
        now = time.monotonic() if now is None else now
        idle = [batch_id for batch_id, batch in self._batches.items() if now - batch.last_used > max_idle_s]
        for batch_id in idle:
            self.stage.recycle(self._batches.pop(batch_id).session)
        return idle

    def trim_if_idle(self, min_idle_s: float, now: float | None = None) -> bool:
        """Give back the memory of the calls the stage ran (Stage.trim_idle_memory) where it holds no micro-batch, has
        run no step for `min_idle_s` and was not trimmed since its last step; returns whether it was. A burst of
        `serve --fleet` requests left an agent at 400-480 MB against 60 MB before it, for as long as it hosted the
        stage (from an exploratory soak test)."""
        now = time.monotonic() if now is None else now
        if self._batches or self._trimmed or now - self._last_step < min_idle_s:
            return False
        self.stage.trim_idle_memory()
        self._trimmed = True
        return True

    # Private methods

    def _prepare(self, batch: _MicroBatch, message: Forward) -> tuple[np.ndarray, StepInputs, bool]:
        """Replay the step's deltas on the batch (editing its KV state where they say) and check the step
        against the result; returns the payload to feed, the call's inputs, and whether the step's row copies
        (CopyRow) were left out. LedgerError for a refusal, raised before any KV state is edited: a step that
        admits or compacts is first rehearsed on a copy of the mirror, and the micro-batches it admits are taken
        only after that. The copies are the driver's option (its prefix cache): a step the memory guard admits
        only without them runs without them (as it does where a stage before this one left them out), rather than
        being refused, which would cost the PC its place in the chain."""
        if message.step_id <= batch.last_step_id:
            raise LedgerError(f"micro-batch {message.micro_batch_id} step {message.step_id} came after step "
                              f"{batch.last_step_id}: a duplicate or out of order")
        layers = self.stage.layers
        if message.layer_start != layers.start:
            raise LedgerError(f"micro-batch {message.micro_batch_id} step {message.step_id} is for the stage from "
                              f"layer {message.layer_start}, this stage runs layers [{layers.start}:{layers.stop}]: "
                              "the chain's stages do not follow each other")
        if layers.is_first != (message.input_ids is not None):
            raise LedgerError("the first stage takes input_ids, later stages hidden_states")
        call = message.slot_deltas[-1] if message.slot_deltas else None
        if isinstance(call, AppendSlots) and message.position_ids.shape != (len(call.live_counts), call.count):
            # before any delta is replayed: a step's size is the tensors it carries, not a count it claims
            raise LedgerError(f"position_ids of shape {list(message.position_ids.shape)} for an append of "
                              f"{len(call.live_counts)} rows x {call.count} slots")
        admits = sum(isinstance(delta, AdmitRow) for delta in message.slot_deltas)
        if admits != len(message.admit_from):
            raise LedgerError(f"{admits} AdmitRow deltas for {len(message.admit_from)} micro-batches to admit")
        copies = sum(isinstance(delta, CopyRow) for delta in message.slot_deltas)
        if copies != len(message.copy_into):
            raise LedgerError(f"{copies} CopyRow deltas for {len(message.copy_into)} new micro-batches")
        for target in message.copy_into:
            if target in self._batches or target == message.micro_batch_id:
                raise LedgerError(f"a row copied into micro-batch {target}, which this stage holds already")
        rehearsed: Mirror | None = None
        copied_slots: list[int] = []
        if admits or copies or any(isinstance(delta, Compact) for delta in message.slot_deltas):
            self._check_sources(message)
            rehearsed = batch.mirror.fork()
            self._checked_step(message, replay_deltas(
                rehearsed, message.slot_deltas,
                copy=lambda delta, ordinal, live: copied_slots.append(int(live.sum()))))
        copies_dropped = message.copies_dropped
        if isinstance(call, AppendSlots) and self.memory_guard is not None:
            # after the rehearsal, where there was one: an admitted row pads every row to its slots (8 rows of 100
            # slots admitting a 2,000-slot stream grow by 17,209 slots, where rows x (slots + new ones) said 109)
            growth = KvGrowth(rehearsed.rows, rehearsed.slots, batch.mirror.rows, batch.mirror.slots) \
                if rehearsed is not None else \
                KvGrowth(len(call.live_counts), batch.mirror.slots + call.count, batch.mirror.rows, batch.mirror.slots)
            copying = 0 if copies_dropped else sum(copied_slots)
            # the CPU plugin keeps a request's largest call's buffers: 16 prompts of 1,000 tokens in one call grew
            # the demo target's stage by 722 MiB, where its u8 KV cache was counted at 70 (now 801 in all). A step
            # whose micro-batch adopts an admitted row's session runs on that session: counted against this one
            # (the call after an admission is about a token a row)
            call_tokens = message.position_ids.size
            scratch = max(0, call_tokens - batch.session.largest_call_tokens) * self.scratch_bytes_per_token

            def what(copied: int) -> str:
                return (f"micro-batch {message.micro_batch_id} step {message.step_id} ({growth.rows} rows x "
                        f"{growth.slots} slots" + (f", {copied} copied" if copied else "") +
                        (f"; a call of {call_tokens} tokens" if scratch else "") + ")")

            try:
                self.memory_guard.admit((growth.slot_count + copying) * self.kv_bytes_per_slot * SLOT_GROWTH +
                                        scratch, lambda: what(copying))
            except KvMemoryRefused:
                if not copying:
                    raise
                self.memory_guard.admit(growth.slot_count * self.kv_bytes_per_slot * SLOT_GROWTH + scratch,
                                        lambda: what(0))
                log.info("micro-batch %d step %d runs without its %d row copies: this PC has no memory for them",
                         message.micro_batch_id, message.step_id, len(message.copy_into))
                copies_dropped = True
        keeps = message.keep_sources or (False,) * len(message.admit_from)
        sources = [self._batches[source] if keep else self._batches.pop(source)
                   for source, keep in zip(message.admit_from, keeps, strict=True)]
        inputs = replay_deltas(
            batch.mirror, message.slot_deltas,
            gather_rows=lambda rows: _edit_state(batch.session, lambda state: state[rows]),
            admit=lambda delta, ordinal: self._admit(batch, sources[ordinal], delta, keep=keeps[ordinal]),
            compact=lambda delta: _edit_state(batch.session, lambda state: _gather_slots(state, delta)),
            copy=(lambda delta, ordinal, live: None) if copies_dropped else
            lambda delta, ordinal, live: self._copy(batch, delta, live, message.copy_into[ordinal]))
        return self._checked_step(message, inputs), inputs, copies_dropped

    def _checked_step(self, message: Forward, inputs: StepInputs) -> np.ndarray:
        """Everything about the step that the mirror's inputs let us check; returns the payload to feed."""
        _check_agrees(message, inputs)
        payload = self._checked_payload(message, inputs)
        if self.stage.layers.is_last:
            self._check_verification(message, inputs)
        return payload

    def _checked_payload(self, message: Forward, inputs: StepInputs) -> np.ndarray:
        """The step's input_ids [B, T] or hidden_states [B, T, H], checked against the call's shape, the
        stage's width and vocabulary: the plugin would take out-of-range ids and NaNs without a word."""
        rows, count = len(inputs.append.live_counts), inputs.append.count
        if message.input_ids is not None:
            ids = np.asarray(message.input_ids)
            if ids.shape != (rows, count):
                raise LedgerError(f"input_ids of shape {list(ids.shape)} for a call of {rows} rows x {count} tokens")
            if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < self.stage.vocab_size:
                raise LedgerError(f"input_ids outside the vocabulary of {self.stage.vocab_size} tokens")
            return ids
        assert message.hidden_states is not None
        hidden = np.asarray(message.hidden_states)
        if hidden.shape != (rows, count, self.stage.hidden_size):
            raise LedgerError(f"hidden_states of shape {list(hidden.shape)} for a call of {rows} rows x {count} "
                              f"tokens x hidden size {self.stage.hidden_size}")
        # a row with no live slot at all (idle in this step) attends to nothing: its positions are NaN
        if not np.isfinite(hidden[_live_positions(inputs.append, count)]).all():
            raise LedgerError("hidden_states hold NaN or infinite values")
        return hidden

    def _check_verification(self, message: Forward, inputs: StepInputs) -> None:
        """What the last stage verifies and samples must fit the call: checked before the call, so that a
        refusal leaves the KV state as it was."""
        rows = len(inputs.append.live_counts)
        if message.sampling is not None and len(message.sampling.temperatures) != rows:
            raise LedgerError(f"sampling for {len(message.sampling.temperatures)} rows, the call has {rows}")
        if message.adjust is not None:
            if len(message.adjust.presence) != rows:
                raise LedgerError(f"logits adjustments for {len(message.adjust.presence)} rows, the call has {rows}")
            ids = np.concatenate([np.asarray(message.adjust.counted)[0], np.asarray(message.adjust.bias_ids)])
            if ids.size and int(ids.max()) >= self.stage.vocab_size:
                raise LedgerError(f"penalized or biased tokens outside the vocabulary of {self.stage.vocab_size} "
                                  "tokens")
        if message.scored_ids is not None:
            self._check_scored(np.asarray(message.scored_ids, dtype=np.int64), inputs.append.live_counts)
        draft = message.draft
        if draft is None:
            return
        if len(draft.counts) != rows:
            raise LedgerError(f"draft tokens for {len(draft.counts)} rows, the call has {rows}")
        for row, (k, live) in enumerate(zip(draft.counts, inputs.append.live_counts, strict=True)):
            if k and k + 1 != live:
                raise LedgerError(f"row {row} fed {live} tokens for {k} draft tokens (needs {k + 1})")
        ids = np.asarray(draft.draft_token_ids)
        if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < self.stage.vocab_size:
            raise LedgerError(f"draft tokens outside the vocabulary of {self.stage.vocab_size} tokens")
        if draft.draft_probs is not None and np.asarray(draft.draft_probs).shape[-1] != self.stage.vocab_size:
            raise LedgerError(f"draft probabilities over {np.asarray(draft.draft_probs).shape[-1]} tokens, the "
                              f"vocabulary has {self.stage.vocab_size}")
        _check_sampled_drafts(draft, message.sampling)

    def _check_scored(self, scored: npt.NDArray[np.int64], live_counts: tuple[int, ...]) -> None:
        """Forward.scored_ids must name tokens of the vocabulary at fed positions, and their logits fit
        SCORED_LOGITS_BYTES."""
        if scored.size and int(scored.max()) >= self.stage.vocab_size:
            raise LedgerError(f"scored tokens outside the vocabulary of {self.stage.vocab_size} tokens")
        fed = np.arange(scored.shape[1])[None, :] < np.array(live_counts)[:, None]
        if ((scored >= 0) & ~fed).any():
            raise LedgerError("scored tokens at positions the call does not feed (past a row's live tokens)")
        logits_bytes = scored.size * self.stage.vocab_size * 4
        if logits_bytes > SCORED_LOGITS_BYTES:
            raise LedgerError(f"a call that scores {scored.shape[1]} positions of {scored.shape[0]} row(s) would take "
                              f"{logits_bytes / 2**20:.1f} MiB of logits, past the "
                              f"{SCORED_LOGITS_BYTES / 2**20:.1f} MiB a scored call may take: feed the prompt in "
                              "smaller chunks")

    def _copy(self, batch: _MicroBatch, delta: CopyRow, live: npt.NDArray[np.bool_], target: int) -> None:
        """A new one-row micro-batch `target` holding the batch row's live slots, in order (CopyRow)."""
        slots = np.flatnonzero(live)
        state = batch.session.query_state()
        session = self.stage.open_session()
        try:
            session.set_state({name: np.ascontiguousarray(tensor[delta.row: delta.row + 1][:, :, slots])
                               for name, tensor in state.items()})
        except BaseException:
            self.stage.recycle(session)
            raise
        mirror = Mirror(self.max_positions)
        mirror.apply(AdmitRow(live_slots=int(slots.size)))
        self._batches[target] = _MicroBatch(mirror, session)

    def _check_sources(self, message: Forward) -> None:
        """Each AdmitRow's source must be a micro-batch this stage holds, of one row whose live slots are its first
        `live_slots` and no others (the row is copied as those slots: a row with dead slots among them, or live ones
        past them, would be merged wrong without a word)."""
        admits = [delta for delta in message.slot_deltas if isinstance(delta, AdmitRow)]
        for micro_batch_id, delta in zip(message.admit_from, admits, strict=True):
            source = self._batches.get(micro_batch_id)
            if source is None:
                raise LedgerError(f"admission from micro-batch {micro_batch_id}, which this stage does not hold")
            if source.mirror.rows != 1:
                raise LedgerError(f"admission from micro-batch {micro_batch_id} of {source.mirror.rows} rows "
                                  "(needs 1)")
            if source.mirror.rows_pending():
                raise LedgerError(f"admission from micro-batch {micro_batch_id}, whose row reorder is not run yet")
            live = source.mirror.mask[0]
            if int(source.mirror.next_positions[0]) != delta.live_slots or not live[: delta.live_slots].all() \
                    or live[delta.live_slots:].any():
                raise LedgerError(f"admission of {delta.live_slots} slots from micro-batch {micro_batch_id}, whose "
                                  f"row holds {int(live.sum())} live slots of {live.size} at next position "
                                  f"{int(source.mirror.next_positions[0])}: it must hold exactly its first "
                                  f"{delta.live_slots} (compact it first)")

    def _admit(self, batch: _MicroBatch, source: _MicroBatch, delta: AdmitRow, keep: bool = False) -> None:
        """Append the source's single row to the batch state (the mirror already holds the new row); the source is
        freed, or with `keep` left as it was (Forward.keep_sources)."""
        if keep:
            source.last_used = time.monotonic()
        elif batch.steps == 0 and batch.mirror.rows == 1:
            unused, batch.session = batch.session, source.session  # an empty batch adopts the prefilled session
            batch.steps = source.steps
            self.stage.recycle(unused)
            return
        incoming = source.session.query_state()
        current = batch.session.query_state()
        merged = {}
        for name, state in current.items():
            row = incoming[name]  # [1, KV, L, D]
            slots = max(state.shape[2], delta.live_slots)
            grown = np.zeros((state.shape[0] + 1, state.shape[1], slots, state.shape[3]), dtype=state.dtype)
            grown[:-1, :, : state.shape[2]] = state
            grown[-1, :, : delta.live_slots] = row[0, :, : delta.live_slots]
            merged[name] = grown
        batch.session.set_state(merged)
        if not keep:
            self.stage.recycle(source.session)


def adjusted(append: AppendSlots, logits: npt.NDArray[np.float32], argmax: npt.NDArray[np.int64],
             draft: DraftInfo | None, adjust: LogitsAdjust) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The logits [B, N, V] and their argmax [B, N] after each row's penalties and logit bias (Forward.adjust;
    common/logits_adjust.py), for verify(): a drafting row's column j follows its draft tokens before j, which count
    as generated there. Rows without an adjustment, and the log-probabilities (taken from the raw logits), are left
    as they were."""
    out_logits, out_argmax = logits, argmax
    for row, live in enumerate(append.live_counts):
        row_adjust = adjust.row(row)
        if row_adjust is None or live == 0:
            continue
        if out_logits is logits:  # copies, once: the plugin's buffers, and the raw logits the log-probabilities read
            out_logits, out_argmax = np.array(logits, dtype=np.float32), np.array(argmax, dtype=np.int64)
        k = draft.counts[row] if draft is not None else 0
        drafts = np.asarray(draft.draft_token_ids[row, :k], dtype=np.int64) if draft is not None and k else None
        out_logits[row] = adjusted_logits(logits[row], row_adjust, drafts)
        out_argmax[row] = out_logits[row].argmax(axis=-1)  # the first maximum, as the in-graph argmax takes it
    return out_logits, out_argmax


def logits_positions(append: AppendSlots, draft: DraftInfo | None, every: bool = False) -> npt.NDArray[np.int64]:
    """logits_positions: [B, N] for the last stage: all T positions when the step verifies drafts or scores its fed
    tokens (`every`: Forward.scored_ids), else only each row's last live one (N = 1), so a prompt's other positions
    skip the vocabulary projection."""
    live = np.array(append.live_counts, dtype=np.int64)  # [B]
    if draft is not None or every:
        return np.broadcast_to(np.arange(append.count, dtype=np.int64), (len(live), append.count))
    return np.maximum(live - 1, 0)[:, None]


def verify(append: AppendSlots, next_tokens: npt.NDArray[np.int64], logits: npt.NDArray[np.float32] | None,
           draft: DraftInfo | None, sampling: SamplingInfo | None, every: bool = False
           ) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The next token of every row and, when drafting, how many draft tokens each row accepted.

    A drafting row fed live_counts[r] = k+1 tokens: its last accepted token and k draft tokens; any other
    row fed its prompt or last token, and its next token follows its last live position. next_tokens
    [B, N] is the in-graph argmax and logits [B, N, V] (only needed by sampled rows), at the positions
    `logits_positions` chose: all T with a draft or `every`, else the last live one alone (column 0).
    """
    rows = len(append.live_counts)
    last_only = draft is None and not every
    if last_only and (sampling is None or not any(sampling.temperatures)):  # plain greedy: every row's argmax
        return tuple(token if live else 0 for token, live in zip(next_tokens[:, 0].tolist(), append.live_counts,
                                                                  strict=True)), None
    chosen: list[int] = []
    accepted: list[int] = []
    for row in range(rows):
        live = append.live_counts[row]
        k = draft.counts[row] if draft is not None else 0
        if live == 0:  # an idle row this step
            chosen.append(0)
            accepted.append(0)
            continue
        if k and k + 1 != live:
            raise LedgerError(f"row {row} fed {live} tokens for {k} draft tokens (needs {k + 1})")
        params = _row_params(sampling, row)
        if params is None:
            if k:
                assert draft is not None
                verdict = greedy_accept(draft.draft_token_ids[row, :k], next_tokens[row, : k + 1])
                chosen.append(verdict.next_token)
                accepted.append(verdict.accepted)
            else:
                chosen.append(int(next_tokens[row, 0 if last_only else live - 1]))
                accepted.append(0)
            continue
        if logits is None:
            raise LedgerError("sampled rows need the stage's logits")
        assert sampling is not None
        rng = np.random.default_rng(sampling.seeds[row])
        if k:
            target = sampling_probs(logits[row, : k + 1], params)  # [k+1, V]
            assert draft is not None
            if draft.one_hot:
                q = np.zeros_like(target[:k])  # [k, V]: all of q's mass on each draft token
                q[np.arange(k), draft.draft_token_ids[row, :k]] = 1.0
            elif draft.draft_probs is None:
                raise LedgerError(f"row {row} samples with draft tokens but no draft probabilities")
            else:
                q = np.asarray(draft.draft_probs[row, :k], dtype=np.float64)  # [k, V]
            verdict = speculative_accept(draft.draft_token_ids[row, :k], q, target, rng)
            chosen.append(verdict.next_token)
            accepted.append(verdict.accepted)
        else:
            last = 0 if last_only else live - 1
            chosen.append(sample(sampling_probs(logits[row, last: last + 1], params)[0], rng))
            accepted.append(0)
    return tuple(chosen), (tuple(accepted) if draft is not None else None)


def returned_logprobs(append: AppendSlots, logits: npt.NDArray[np.float32], draft: DraftInfo | None,
                     next_tokens: tuple[int, ...], accepted: tuple[int, ...] | None, asked: tuple[int, ...],
                     every: bool = False
                     ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """ForwardResult's token_logprobs [B, T], top_logprob_ids and top_logprobs [B, T, N]: for each row that asks
    (asked[r] >= 0), the log-probabilities of the tokens the step returns it, its accepted draft tokens then its next
    token, in columns 0.. (N: the most alternatives any row asked). A drafting row's token i follows its fed token i
    (logits column i); any other row's one token follows its last live position (column 0 without a draft or
    `every` (logits_positions), where the logits are that position's alone)."""
    picks: list[_Pick] = []
    for row, live in enumerate(append.live_counts):
        if asked[row] < 0 or live == 0:
            continue
        k = draft.counts[row] if draft is not None else 0
        kept = accepted[row] if accepted is not None else 0
        assert draft is not None or kept == 0
        tokens = [*(draft.draft_token_ids[row, :kept].tolist() if draft is not None else []), next_tokens[row]]
        first = live - 1 - k if draft is not None or every else 0
        picks.append(_Pick(row, np.arange(first, first + len(tokens)), np.array(tokens), np.arange(len(tokens))))
    return _logprob_tensors(logits, picks, len(append.live_counts), 1 + max(accepted or (0,)), max(asked))


def scored_logprobs(logits: npt.NDArray[np.float32], scored_ids: npt.NDArray[np.int64], asked: tuple[int, ...]
                    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """ForwardResult's scored_logprobs [B, T], scored_top_ids and scored_top_logprobs [B, T, N]: at each fed
    position whose scored_ids names a token (a prompt's next one), that token's log-probability and the asked[r]
    most likely tokens' (logits [B, T, V] at every position: logits_positions with `every`)."""
    rows, width = scored_ids.shape
    picks = [_Pick(row, columns, scored_ids[row, columns], columns)
             for row, columns in enumerate(np.flatnonzero(row_ids >= 0) for row_ids in scored_ids) if len(columns)]
    return _logprob_tensors(logits, picks, rows, width, max(asked))


# Private functions

@dataclass(frozen=True)
class _Pick:
    """One row's tokens to report: the logits columns they follow, and the result columns they go to."""

    row: int
    columns: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]
    out: npt.NDArray[np.int64]


def _logprob_tensors(logits: npt.NDArray[np.float32], picks: list[_Pick], rows: int, width: int, top: int
                     ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """[rows, width] log-probabilities and [rows, width, top] most likely tokens and theirs, each pick's at its
    result columns (chosen_and_top of its logits columns); 0 elsewhere."""
    chosen = np.zeros((rows, width), dtype=np.float32)
    top_ids = np.zeros((rows, width, top), dtype=np.int64)
    top_logps = np.zeros((rows, width, top), dtype=np.float32)
    for pick in picks:
        picked, ids, logps = chosen_and_top(logits[pick.row, pick.columns], pick.tokens, top)
        chosen[pick.row, pick.out] = picked
        top_ids[pick.row, pick.out] = ids
        top_logps[pick.row, pick.out] = logps
    return chosen, top_ids, top_logps


def _row_params(sampling: SamplingInfo | None, row: int) -> SamplingParams | None:
    if sampling is None or sampling.temperatures[row] == 0.0:
        return None
    return SamplingParams(temperature=sampling.temperatures[row], top_k=sampling.top_ks[row],
                          top_p=sampling.top_ps[row])


def _live_positions(append: AppendSlots, width: int) -> npt.NDArray[np.bool_]:
    """[B, width]: True at the positions that carry a row's own tokens in this call (its live ones),
    False at pad positions and in rows that feed nothing. With width 1 (the last stage without a draft:
    each row's last live position alone) True for every row that fed a token."""
    live = np.array(append.live_counts, dtype=np.int64)[:, None]  # [B, 1]
    if width == 1:
        return live > 0
    return np.arange(width)[None, :] < live


def _check_sampled_drafts(draft: DraftInfo, sampling: SamplingInfo | None) -> None:
    """What rejection sampling reads of q, checked before the call: a sampled row's draft tokens need their
    draft probabilities (or one-hot drafts), finite and not negative, and above 0 at each draft token.
    Found only in `verify`, after the call, such a step failed with its KV state and mirror advanced, and
    the driver's correct resend was refused as a duplicate; a NaN q chose a token silently."""
    rows = [row for row, k in enumerate(draft.counts) if k and sampling is not None and sampling.temperatures[row]]
    if not rows or draft.one_hot:
        return
    if draft.draft_probs is None:
        raise LedgerError(f"row {rows[0]} samples with draft tokens but no draft probabilities")
    for row in rows:
        k = draft.counts[row]
        q = np.asarray(draft.draft_probs[row, :k], dtype=np.float64)  # [k, V]
        if not (np.isfinite(q).all() and (q >= 0).all()):
            raise LedgerError(f"row {row}'s draft probabilities hold NaN, infinite or negative values")
        chosen: npt.NDArray[np.float64] = q[np.arange(k), np.asarray(draft.draft_token_ids[row, :k])]
        if (chosen <= 0).any():
            position = int(np.argmax(chosen <= 0))
            raise LedgerError(f"row {row}'s draft token {int(draft.draft_token_ids[row, position])} at position "
                              f"{position} has draft probability 0: draft tokens are sampled from their probabilities")


def _check_agrees(message: Forward, inputs: StepInputs) -> None:
    # As lists: a handful of numbers every step, where np.array_equal's machinery costs more than the compare.
    if np.asarray(message.beam_idx).tolist() != inputs.beam_idx.tolist() or \
            np.asarray(message.position_ids).tolist() != inputs.position_ids.tolist():
        raise LedgerError(f"micro-batch {message.micro_batch_id} step {message.step_id}: the driver's beam_idx "
                          "or position_ids disagree with this stage's mirror (desync)")


def _edit_state(session: StageSession, edit: Callable[[np.ndarray], np.ndarray]) -> None:
    session.set_state({name: np.ascontiguousarray(edit(state)) for name, state in session.query_state().items()})


def _gather_slots(state: np.ndarray, delta: Compact) -> np.ndarray:
    # state: [B, KV, S, D] -> [B, KV, new_slots, D]
    columns = delta.shared_columns()
    if columns is not None:
        return np.take(state, columns, axis=2)
    index = delta.gather_index()  # [B, new_slots]
    return np.take_along_axis(state, index[:, None, :, None], axis=2)
