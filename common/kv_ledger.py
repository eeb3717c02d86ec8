"""The KV-slot ledger: which physical KV slots of a micro-batch are live, and at which logical positions.

A stage's KV cache is one stateful tensor per layer, state: [B, kv_heads, slots, head_dim]. Every infer
call appends T slots to every row; rows that had fewer tokens this call, and draft tokens the target
rejected, leave DEAD slots behind, hidden by attention_mask: [B, slots]. The driver owns a `Ledger`; each
stage owns a `Mirror`. The driver sends only the deltas its ledger returned (never the whole mask), and
the mirror applies them to reproduce the very same mask.

Deltas, in the order the driver produced them:
- `AppendSlots`: the infer call itself. Row r's first `live_counts[r]` new slots are live, the rest pad.
- `InvalidateSlots`: zero a slot range of one row (rejected draft tokens); its next position rolls back.
- `ReorderRows`: new row i is old row `source_rows[i]` (or a new empty row): add, drop, fork, reorder.
  The stage feeds it as beam_idx at its next call (the in-graph Gather), so no state is copied.
- `AdmitRow`: a stream prefilled alone (B=1) is merged as a new last row (host-side set_state).
- `Compact`: physical trim of dead slots (host-side query_state, gather, set_state).
- `CopyRow`: a row's live slots copied into a new one-row micro-batch (a finished stream's state kept for later
  requests while its micro-batch runs on); this micro-batch's table is unchanged.

Invariant kept by every delta: row r's live slots, in physical order, hold its accepted tokens in order,
at logical positions 0..next_positions[r]-1. Physical order of older slots never matters to attention;
only the tokens of one call must be causal among themselves, and they are always the last T slots.

Pure code: numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

NEW_ROW = -1  # in ReorderRows.source_rows: an empty row (all slots dead, next position 0)

SlotRuns = tuple[tuple[int, int], ...]  # half-open [start, stop) ranges of old slots, in new order


class LedgerError(ValueError):
    """A delta does not fit the ledger it was applied to (wrong row, range, shape or desync)."""


# Deltas


@dataclass(frozen=True)
class AppendSlots:
    """One infer call: every row gets `count` new slots; row r's first `live_counts[r]` are live."""

    count: int  # T of the call
    live_counts: tuple[int, ...]  # [B]
    first_positions: tuple[int, ...]  # [B] logical position of each row's first new token (desync check)

    @property
    def full(self) -> bool:
        """Every new slot is live (plain decoding, prompts of one length): no pad slots."""
        return all(count == self.count for count in self.live_counts)


@dataclass(frozen=True)
class InvalidateSlots:
    """Zero row `row`'s mask over slots [start, stop); they must be the row's LAST live slots."""

    row: int
    start: int
    stop: int


@dataclass(frozen=True)
class ReorderRows:
    """New row i is old row source_rows[i], or a new empty row where it is NEW_ROW.

    Rows left out are dropped; a row named twice is forked. The stage does not touch its state: it feeds
    `beam_idx()` at its next infer call (see Mirror.take_beam_idx, which composes several reorders).
    """

    source_rows: tuple[int, ...]  # [B_new]

    def beam_idx(self) -> npt.NDArray[np.int64]:
        """beam_idx: [B_new]; new empty rows gather row 0, whose content their dead mask hides."""
        return np.array([max(row, 0) for row in self.source_rows], dtype=np.int64)


@dataclass(frozen=True)
class AdmitRow:
    """Merge a stream prefilled alone as the new LAST row, with `live_slots` live slots.

    The stage builds state: [B+1, kv_heads, max(slots, live_slots), head_dim] on the host: old rows keep
    their slots (zero padding after them if the batch grew), the new row's state fills slots
    [0, live_slots). Its next logical position is live_slots.
    """

    live_slots: int


@dataclass(frozen=True)
class Compact:
    """Physical trim: row b's new slot j is old slot `gather_index()[b, j]`.

    `keep[b]` lists the old slots row b keeps (as runs, ascending); past their total the row is padding
    (dead). The stage gathers every state tensor on the host: np.take_along_axis on the slot axis, or the
    cheaper np.take when `shared_columns()` is not None, then set_state.
    """

    new_slots: int
    keep: tuple[SlotRuns, ...]  # [B]

    def gather_index(self) -> npt.NDArray[np.int64]:
        """index: [B, new_slots] of old slots; padding slots gather old slot 0 (masked anyway)."""
        index = np.zeros((len(self.keep), self.new_slots), dtype=np.int64)
        for row, runs in enumerate(self.keep):
            kept = _expand_runs(runs)
            index[row, : len(kept)] = kept
        return index

    def shared_columns(self) -> npt.NDArray[np.int64] | None:
        """The kept old slots when every row keeps the same ones and none pads, else None."""
        if not self.keep or any(runs != self.keep[0] for runs in self.keep):
            return None
        columns = _expand_runs(self.keep[0])
        return columns if len(columns) == self.new_slots else None


@dataclass(frozen=True)
class CopyRow:
    """Copy row `row`'s live slots, in order, into a new one-row micro-batch whose id the step names
    (Forward.copy_into): its next position is the row's, its slots exactly its live ones. This table is unchanged
    (the row is usually dropped right after, by a ReorderRows)."""

    row: int


SlotDelta = AppendSlots | InvalidateSlots | ReorderRows | AdmitRow | Compact | CopyRow


# Compaction policy


class CompactionMode(str, Enum):
    COLUMNS = "columns"  # drop slots dead in EVERY row: one shared column list
    PACK_ROWS = "pack_rows"  # each row keeps only its live slots; rows shorter than the longest pad


@dataclass(frozen=True)
class CompactionPolicy:
    """Compact when at least `min_dead_slots` slots per row AND `min_dead_fraction` of them can go.

    Dead slots cost attention time at every step (+16% at 200 per row on the probe machine); a compaction
    costs one query_state/set_state per layer, so it only pays past a threshold.
    """

    min_dead_slots: int = 64
    min_dead_fraction: float = 0.25
    mode: CompactionMode = CompactionMode.PACK_ROWS


def plan_compaction(mask: npt.NDArray[np.bool_], policy: CompactionPolicy) -> Compact | None:
    """The Compact delta the policy asks for on mask: [B, slots], or None when it does not pay."""
    rows, slots = mask.shape
    if rows == 0 or slots == 0:
        return None
    # Count first (cheap, every step); build the runs only when compaction pays.
    if policy.mode is CompactionMode.COLUMNS:
        alive = mask.any(axis=0)
        new_slots = int(alive.sum())
    else:
        new_slots = int(mask.sum(axis=1).max())
    freed = slots - new_slots
    if freed < max(policy.min_dead_slots, 1) or freed < policy.min_dead_fraction * slots:
        return None
    if policy.mode is CompactionMode.COLUMNS:
        columns = _runs(np.flatnonzero(alive))
        keep = tuple(columns for _ in range(rows))
    else:
        keep = tuple(_runs(np.flatnonzero(mask[row])) for row in range(rows))
    return Compact(new_slots=new_slots, keep=keep)


# Slot tables


class SlotTable:
    """The mask and next logical positions of one micro-batch; applies deltas.

    A delta that does not fit raises LedgerError and leaves the table unchanged.
    """

    def __init__(self, max_positions: int | None = None) -> None:
        self._mask: npt.NDArray[np.bool_] = np.zeros((0, 0), dtype=bool)  # mask: [B, slots]
        self._next: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)  # next positions: [B]
        self.max_positions = max_positions

    # Public methods

    @property
    def rows(self) -> int:
        return int(self._mask.shape[0])

    @property
    def slots(self) -> int:
        return int(self._mask.shape[1])

    @property
    def mask(self) -> npt.NDArray[np.bool_]:
        """A read-only view, mask: [B, slots]."""
        view = self._mask.view()
        view.flags.writeable = False
        return view

    @property
    def next_positions(self) -> npt.NDArray[np.int64]:
        """A copy, next positions: [B]; equals the live slot count of each row."""
        return self._next.copy()

    def attention_mask(self) -> npt.NDArray[np.int64]:
        """attention_mask: [B, slots] int64 for the infer call whose AppendSlots was just applied."""
        return self._mask.astype(np.int64)

    def dead_slots(self) -> int:
        """Dead slots summed over rows."""
        return int(self._mask.size - self._mask.sum())

    def apply(self, delta: SlotDelta) -> None:
        if isinstance(delta, AppendSlots):
            self._append(delta)
        elif isinstance(delta, InvalidateSlots):
            self._invalidate(delta)
        elif isinstance(delta, ReorderRows):
            self._reorder(delta)
        elif isinstance(delta, AdmitRow):
            self._admit(delta)
        elif isinstance(delta, Compact):
            self._compact(delta)
        elif isinstance(delta, CopyRow):
            if not 0 <= delta.row < self.rows:
                raise LedgerError(f"copy of row {delta.row}: the micro-batch has {self.rows} rows")
        else:
            raise LedgerError(f"unknown slot delta {type(delta).__name__}")

    # Private methods

    def _check_positions(self, positions: Iterable[int]) -> None:
        """Plain Python: a handful of rows, every step, on three tables (ledger and two mirrors)."""
        if self.max_positions is not None and max(positions, default=0) > self.max_positions:
            raise LedgerError(f"a row would pass the context of {self.max_positions} positions")

    def _append(self, delta: AppendSlots) -> None:
        if delta.count < 1:
            raise LedgerError(f"append of {delta.count} slots: an infer call appends at least one")
        if self.max_positions is not None and delta.count > self.max_positions:  # before allocating anything
            raise LedgerError(f"append of {delta.count} slots: a call feeds at most the context of "
                              f"{self.max_positions} positions")
        if len(delta.live_counts) != self.rows or len(delta.first_positions) != self.rows:
            raise LedgerError(f"append for {len(delta.live_counts)} rows, the micro-batch has {self.rows}")
        # Plain-Python checks: a handful of rows, every step, on three tables (ledger and two mirrors).
        if any(not 0 <= count <= delta.count for count in delta.live_counts):
            raise LedgerError(f"live counts {delta.live_counts} outside 0..{delta.count}")
        nexts = self._next.tolist()
        if nexts != list(delta.first_positions):
            raise LedgerError(f"desync: append starts rows at {delta.first_positions}, mirror has {nexts}")
        self._check_positions(start + count for start, count in zip(nexts, delta.live_counts, strict=True))
        live = np.array(delta.live_counts, dtype=np.int64).reshape(-1)
        if delta.full:
            new = np.ones((self.rows, delta.count), dtype=bool)  # new: [B, T]
        else:
            new = np.arange(delta.count)[None, :] < live[:, None]
        self._mask = np.concatenate([self._mask, new], axis=1)
        self._next = self._next + live

    def _invalidate(self, delta: InvalidateSlots) -> None:
        if not 0 <= delta.row < self.rows:
            raise LedgerError(f"invalidate row {delta.row}: the micro-batch has {self.rows} rows")
        if not 0 <= delta.start <= delta.stop <= self.slots:
            raise LedgerError(f"invalidate slots [{delta.start}, {delta.stop}) outside 0..{self.slots}")
        row = self._mask[delta.row]
        if row[delta.stop :].any():
            raise LedgerError(
                f"invalidate row {delta.row} [{delta.start}, {delta.stop}): live slots follow the range, "
                "only a row's last tokens can be rejected")
        removed = int(row[delta.start : delta.stop].sum())
        self._mask = self._mask.copy()
        self._mask[delta.row, delta.start : delta.stop] = False
        self._next = self._next.copy()
        self._next[delta.row] -= removed

    def _reorder(self, delta: ReorderRows) -> None:
        sources = np.array(delta.source_rows, dtype=np.int64).reshape(-1)
        if sources.size and (sources.min() < NEW_ROW or sources.max() >= self.rows):
            raise LedgerError(f"reorder names rows {delta.source_rows}; the micro-batch has {self.rows}")
        fresh = sources == NEW_ROW
        mask = self._mask[np.maximum(sources, 0)] if self.rows else np.zeros((sources.size, self.slots), bool)
        nexts = self._next[np.maximum(sources, 0)] if self.rows else np.zeros(sources.size, np.int64)
        mask[fresh] = False
        nexts[fresh] = 0
        self._mask, self._next = mask, nexts

    def _admit(self, delta: AdmitRow) -> None:
        if delta.live_slots < 1:
            raise LedgerError(f"admitted row with {delta.live_slots} live slots; a prefill has at least one")
        self._check_positions((delta.live_slots,))
        slots = max(self.slots, delta.live_slots)
        mask = np.zeros((self.rows + 1, slots), dtype=bool)
        mask[: self.rows, : self.slots] = self._mask
        mask[self.rows, : delta.live_slots] = True
        self._mask = mask
        self._next = np.append(self._next, np.int64(delta.live_slots))

    def _compact(self, delta: Compact) -> None:
        if len(delta.keep) != self.rows:
            raise LedgerError(f"compaction plan for {len(delta.keep)} rows, the micro-batch has {self.rows}")
        if not 0 <= delta.new_slots <= self.slots:
            raise LedgerError(f"compaction to {delta.new_slots} slots; the micro-batch has {self.slots}")
        for row, runs in enumerate(delta.keep):  # bounds first: a run is expanded into an array below
            if any(not 0 <= start < stop <= self.slots for start, stop in runs) or \
                    sum(stop - start for start, stop in runs) > delta.new_slots:
                raise LedgerError(f"row {row} keeps slot runs {list(runs)[:4]} outside 0..{self.slots} or more "
                                  f"than {delta.new_slots} slots")
        mask = np.zeros((self.rows, delta.new_slots), dtype=bool)
        for row, runs in enumerate(delta.keep):
            kept = _expand_runs(runs)
            if len(kept) > delta.new_slots:
                raise LedgerError(f"row {row} keeps {len(kept)} slots, more than {delta.new_slots}")
            if kept.size and (kept.min() < 0 or kept.max() >= self.slots or (np.diff(kept) <= 0).any()):
                raise LedgerError(f"row {row} keeps slots that are not ascending inside 0..{self.slots}")
            if int(self._mask[row, kept].sum()) != int(self._mask[row].sum()):
                raise LedgerError(f"compaction would drop live slots of row {row}")
            mask[row, : len(kept)] = self._mask[row, kept]
        self._mask = mask


class Ledger(SlotTable):
    """The driver's table: each method applies a delta to itself and returns it for the stages."""

    # Public methods

    def append(self, live_counts: tuple[int, ...] | list[int], count: int | None = None) -> AppendSlots:
        """Slots for one infer call of T = count (default: the largest live count) tokens per row."""
        counts = tuple(int(c) for c in live_counts)
        t = count if count is not None else max(counts, default=0)
        delta = AppendSlots(count=t, live_counts=counts, first_positions=tuple(self._next.tolist()))
        self.apply(delta)
        return delta

    def reject(self, row: int, count: int) -> InvalidateSlots | None:
        """Drop row's last `count` live tokens (rejected drafts); None when count is 0."""
        if not 0 <= row < self.rows:
            raise LedgerError(f"reject in row {row}: the micro-batch has {self.rows} rows")
        live = np.flatnonzero(self._mask[row])
        if not 0 <= count <= len(live):
            raise LedgerError(f"reject {count} tokens of row {row}, which has {len(live)}")
        if count == 0:
            return None
        delta = InvalidateSlots(row=row, start=int(live[-count]), stop=int(live[-1]) + 1)
        self.apply(delta)
        return delta

    def reorder(self, source_rows: tuple[int, ...] | list[int]) -> ReorderRows:
        """New row i is old row source_rows[i] (NEW_ROW: an empty row)."""
        delta = ReorderRows(source_rows=tuple(int(r) for r in source_rows))
        self.apply(delta)
        return delta

    def add_rows(self, count: int) -> ReorderRows:
        """Append `count` empty rows (they are then prefilled inside the batch by append)."""
        return self.reorder([*range(self.rows), *([NEW_ROW] * count)])

    def drop_rows(self, rows: set[int] | list[int]) -> ReorderRows:
        """Drop finished streams; the others keep their order."""
        return self.reorder([r for r in range(self.rows) if r not in set(rows)])

    def copy_row(self, row: int) -> CopyRow:
        """Row `row`'s live slots go into a new one-row micro-batch (this table is unchanged)."""
        delta = CopyRow(row=row)
        self.apply(delta)
        return delta

    def admit(self, live_slots: int) -> AdmitRow:
        """A stream prefilled alone with live_slots tokens becomes the last row."""
        delta = AdmitRow(live_slots=live_slots)
        self.apply(delta)
        return delta

    def compact(self, policy: CompactionPolicy) -> Compact | None:
        """Compact when the policy says it pays; None otherwise."""
        # Cheap bound first (this runs after every step): a row's live slots equal its next position, so
        # no mode can free more than slots - max(next) slots per row.
        most = self.slots - max(self._next.tolist(), default=0)
        if most < max(policy.min_dead_slots, 1) or most < policy.min_dead_fraction * self.slots:
            return None
        delta = plan_compaction(self._mask, policy)
        if delta is not None:
            self.apply(delta)
        return delta


class RowOrder:
    """Which row of the state tensor each row reads at the next call (beam_idx), composed over every
    ReorderRows since the last take. A stage's Mirror keeps one beside its mask; the driver keeps one
    beside its ledger, to know the beam_idx the stages will feed without keeping a second mask."""

    def __init__(self) -> None:
        self._pending: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)  # beam_idx since last take: [B]
        self._state_rows = 0  # rows of the stage's state tensor, until the pending gather runs

    # Public methods

    def pending(self, rows: int) -> bool:
        """True while a reorder waits to be gathered into a state of `rows` rows."""
        return self._state_rows != rows or not np.array_equal(self._pending, np.arange(rows))

    def take(self, rows: int) -> npt.NDArray[np.int64]:
        """beam_idx: [B] composing every reorder since the last take (new rows gather row 0); afterwards
        the state has `rows` rows in order."""
        taken = np.maximum(self._pending, 0)
        self.gathered(rows)
        return taken

    def reorder(self, source_rows: tuple[int, ...]) -> None:
        sources = np.array(source_rows, dtype=np.int64).reshape(-1)
        pending = self._pending[np.maximum(sources, 0)] if self._pending.size else sources.copy()
        pending[sources == NEW_ROW] = NEW_ROW
        self._pending = pending

    def gathered(self, rows: int) -> None:
        """The state now holds `rows` rows in order (taken, or a row was appended on the host)."""
        self._pending = np.arange(rows, dtype=np.int64)
        self._state_rows = rows


class Mirror(SlotTable):
    """A stage's copy of the ledger, rebuilt from deltas alone.

    The caller (the stage) must, for each delta in order: on ReorderRows, only apply it (the gather is
    deferred to the next call); on AdmitRow, Compact or CopyRow, first gather its state rows on the host with
    `take_beam_idx()` when `rows_pending()`, then apply, then edit the state; on AppendSlots, apply, then
    run the call with `take_beam_idx()`, `attention_mask()` and `position_ids(delta)`.
    """

    def __init__(self, max_positions: int | None = None) -> None:
        super().__init__(max_positions)
        self._order = RowOrder()

    # Public methods

    def fork(self) -> Mirror:
        """An independent copy, for a rehearsal or to restore after a refused step. Cheap: every delta
        replaces the arrays it changes instead of editing them, so the copy can share them."""
        twin = Mirror(self.max_positions)
        twin._mask, twin._next = self._mask, self._next
        twin._order._pending, twin._order._state_rows = self._order._pending, self._order._state_rows
        return twin

    def rows_pending(self) -> bool:
        """True while a reorder waits to be gathered into the state."""
        return self._order.pending(self.rows)

    def take_beam_idx(self) -> npt.NDArray[np.int64]:
        """beam_idx: [B] composing every reorder since the last take (new rows gather row 0)."""
        return self._order.take(self.rows)

    def apply(self, delta: SlotDelta) -> None:
        if isinstance(delta, AdmitRow | Compact | CopyRow) and self.rows_pending():
            raise LedgerError(f"{type(delta).__name__} with a row reorder pending: take_beam_idx() first")
        super().apply(delta)
        if isinstance(delta, ReorderRows):
            self._order.reorder(delta.source_rows)
        elif isinstance(delta, AdmitRow):
            self._order.gathered(self.rows)


def position_ids(delta: AppendSlots) -> npt.NDArray[np.int64]:
    """position_ids: [B, T] for the call; pad slots repeat a valid position of their row (masked)."""
    first = np.array(delta.first_positions, dtype=np.int64).reshape(-1, 1)  # [B, 1]
    if delta.full:  # no pad slots: nothing to clamp
        return first + np.arange(delta.count, dtype=np.int64)[None, :]
    live = np.array(delta.live_counts, dtype=np.int64).reshape(-1, 1)  # [B, 1]
    last_valid = np.where(live > 0, first + live - 1, np.maximum(first - 1, 0))
    return np.minimum(first + np.arange(delta.count)[None, :], last_valid)


def _runs(indices: npt.NDArray[np.int64]) -> SlotRuns:
    if indices.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [indices.size]])
    return tuple((int(indices[a]), int(indices[b - 1]) + 1) for a, b in zip(starts, stops, strict=True))


def _expand_runs(runs: SlotRuns) -> npt.NDArray[np.int64]:
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in runs])
