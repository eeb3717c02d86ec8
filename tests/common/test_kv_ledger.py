from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.common.kv_ledger import (
    NEW_ROW,
    AdmitRow,
    AppendSlots,
    Compact,
    CompactionMode,
    CompactionPolicy,
    CopyRow,
    InvalidateSlots,
    Ledger,
    LedgerError,
    Mirror,
    ReorderRows,
    SlotDelta,
    plan_compaction,
    position_ids,
)

Entry = tuple[int, int]  # what a simulated KV slot holds: (token, logical position it was written at)
PAD: Entry = (-1, -1)


class StageSim:
    """A stage that follows the Mirror protocol over a fake KV state holding (token, position) per slot."""

    def __init__(self) -> None:
        self.mirror = Mirror()
        self.state: list[list[Entry]] = []  # state: [B][slots]

    def _gather_rows(self) -> None:
        if self.mirror.rows_pending():
            beam = self.mirror.take_beam_idx()
            self.state = [list(self.state[b]) if self.state else [] for b in beam]

    def receive(self, delta: SlotDelta, tokens: list[list[int]] | None = None,
                prefill: list[int] | None = None) -> None:
        if isinstance(delta, AdmitRow | Compact):
            self._gather_rows()
        self.mirror.apply(delta)
        if isinstance(delta, AppendSlots):
            assert tokens is not None
            beam = self.mirror.take_beam_idx()
            old = self.state
            self.state = [list(old[b]) if old else [] for b in beam]
            positions = position_ids(delta)  # [B, T]
            for r, row in enumerate(self.state):
                for i in range(delta.count):
                    live = i < delta.live_counts[r]
                    row.append((tokens[r][i], int(positions[r, i])) if live else PAD)
        elif isinstance(delta, AdmitRow):
            assert prefill is not None
            slots = self.mirror.slots
            for row in self.state:
                row.extend([PAD] * (slots - len(row)))
            self.state.append([(t, i) for i, t in enumerate(prefill)] + [PAD] * (slots - len(prefill)))
        elif isinstance(delta, Compact):
            index = delta.gather_index()
            self.state = [[row[j] for j in index[r]] for r, row in enumerate(self.state)]


def check(ledger: Ledger, stage: StageSim, accepted: list[list[int]]) -> None:
    assert np.array_equal(ledger.mask, stage.mirror.mask)
    assert np.array_equal(ledger.next_positions, stage.mirror.next_positions)
    assert ledger.rows == len(accepted)
    for r, tokens in enumerate(accepted):
        assert ledger.next_positions[r] == len(tokens)
        if stage.mirror.rows_pending():
            continue  # the stage's state rows are still in the old order until its next call
        live = [stage.state[r][s] for s in np.flatnonzero(ledger.mask[r])]
        assert live == [(t, i) for i, t in enumerate(tokens)]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_any_sequence_keeps_ledger_mirror_and_tokens_identical(data: st.DataObject) -> None:
    ledger, stage = Ledger(), StageSim()
    accepted: list[list[int]] = []
    next_token = iter(range(10**6))
    for _ in range(data.draw(st.integers(1, 30), label="ops")):
        op = data.draw(st.sampled_from(["append", "append", "reject", "reorder", "admit", "compact"]))
        if op == "append" and ledger.rows:
            t = data.draw(st.integers(1, 5))
            live = [data.draw(st.integers(0, t)) for _ in range(ledger.rows)]
            tokens = [[next(next_token) for _ in range(t)] for _ in range(ledger.rows)]
            stage.receive(ledger.append(live, count=t), tokens=tokens)
            for r in range(ledger.rows):
                accepted[r].extend(tokens[r][: live[r]])
        elif op == "reject" and ledger.rows:
            row = data.draw(st.integers(0, ledger.rows - 1))
            count = data.draw(st.integers(0, len(accepted[row])))
            delta = ledger.reject(row, count)
            if delta is not None:
                stage.receive(delta)
            del accepted[row][len(accepted[row]) - count :]
        elif op == "reorder":
            sources = data.draw(st.lists(st.integers(NEW_ROW, ledger.rows - 1), max_size=6))
            stage.receive(ledger.reorder(sources))
            accepted = [list(accepted[s]) if s != NEW_ROW else [] for s in sources]
        elif op == "admit":
            prefill = [next(next_token) for _ in range(data.draw(st.integers(1, 12)))]
            stage.receive(ledger.admit(len(prefill)), prefill=prefill)
            accepted.append(prefill)
        elif op == "compact":
            policy = CompactionPolicy(min_dead_slots=data.draw(st.integers(0, 4)), min_dead_fraction=0.0,
                                      mode=data.draw(st.sampled_from(list(CompactionMode))))
            slots_before = ledger.slots
            delta = ledger.compact(policy)
            if delta is not None:
                stage.receive(delta)
                assert ledger.slots < slots_before
        check(ledger, stage, accepted)
    # one last call gathers any pending reorder, so the full content check always runs at the end
    if ledger.rows:
        stage.receive(ledger.append([0] * ledger.rows, count=1), tokens=[[0]] * ledger.rows)
        check(ledger, stage, accepted)


def test_speculative_round_rejects_per_row_and_positions_continue() -> None:
    ledger = Ledger()
    ledger.admit(3)
    ledger.admit(5)  # rows of different lengths: row 0 pads slots 3..4
    assert ledger.attention_mask().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    verify = ledger.append([4, 4])  # K=3 drafts + the last accepted token, both rows
    assert position_ids(verify).tolist() == [[3, 4, 5, 6], [5, 6, 7, 8]]
    assert ledger.reject(0, 2) == InvalidateSlots(row=0, start=7, stop=9)
    assert ledger.reject(1, 0) is None
    assert ledger.next_positions.tolist() == [5, 9]
    assert ledger.attention_mask().tolist() == [[1, 1, 1, 0, 0, 1, 1, 0, 0], [1] * 9]
    nxt = ledger.append([1, 1])
    assert nxt.first_positions == (5, 9)
    assert position_ids(nxt).tolist() == [[5], [9]]


def test_reject_spans_padding_inside_the_range() -> None:
    ledger = Ledger()
    ledger.admit(1)
    ledger.append([2], count=4)  # slots: live live live pad pad
    ledger.append([1])
    assert ledger.reject(0, 2) == InvalidateSlots(row=0, start=2, stop=6)
    assert ledger.mask.tolist() == [[True, True, False, False, False, False]]
    assert ledger.next_positions.tolist() == [2]


def test_position_ids_pad_slots_stay_inside_the_row() -> None:
    delta = AppendSlots(count=4, live_counts=(2, 0, 4, 0), first_positions=(10, 7, 0, 0))
    assert position_ids(delta).tolist() == [[10, 11, 11, 11], [6, 6, 6, 6], [0, 1, 2, 3], [0, 0, 0, 0]]


def test_invalidating_a_slot_before_live_ones_is_refused_and_changes_nothing() -> None:
    ledger = Ledger()
    ledger.admit(4)
    before = ledger.mask.copy()
    with pytest.raises(LedgerError, match="only a row's last tokens"):
        ledger.apply(InvalidateSlots(row=0, start=1, stop=2))
    assert np.array_equal(ledger.mask, before)
    assert ledger.next_positions.tolist() == [4]


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        (AppendSlots(count=0, live_counts=(0,), first_positions=(2,)), "at least one"),
        (AppendSlots(count=2, live_counts=(3,), first_positions=(2,)), "outside"),
        (AppendSlots(count=2, live_counts=(1, 1), first_positions=(2, 0)), "rows"),
        (AppendSlots(count=2, live_counts=(1,), first_positions=(5,)), "desync"),
        (InvalidateSlots(row=3, start=0, stop=1), "row 3"),
        (InvalidateSlots(row=0, start=1, stop=9), "outside"),
        (ReorderRows(source_rows=(0, 1)), "names rows"),
        (AdmitRow(live_slots=0), "at least one"),
        (Compact(new_slots=2, keep=(((0, 1),), ((0, 1),))), "rows"),
        (Compact(new_slots=1, keep=(((0, 2),),)), "more than"),
        (Compact(new_slots=2, keep=(((1, 2), (0, 1)),)), "ascending"),
        (Compact(new_slots=1, keep=(((0, 1),),)), "drop live"),
        (Compact(new_slots=3, keep=(((0, 2),),)), "compaction to 3"),
        (CopyRow(row=1), "copy of row 1"),
    ],
)
def test_bad_deltas_name_the_problem(delta: SlotDelta, message: str) -> None:
    mirror = Mirror()
    mirror.apply(AdmitRow(live_slots=2))
    with pytest.raises(LedgerError, match=message):
        mirror.apply(delta)
    assert mirror.mask.tolist() == [[True, True]]


def test_context_limit() -> None:
    ledger = Ledger(max_positions=8)
    ledger.admit(7)
    ledger.append([1])
    with pytest.raises(LedgerError, match="context of 8"):
        ledger.append([1])


def test_mirror_composes_reorders_into_one_beam_idx() -> None:
    ledger, mirror = Ledger(), Mirror()
    for n in (1, 2, 3):
        mirror.apply(ledger.admit(n))
    mirror.apply(ledger.reorder([2, 0, 1]))
    mirror.apply(ledger.drop_rows([1]))  # drops old row 0
    mirror.apply(ledger.add_rows(1))
    mirror.apply(ledger.reorder([0, 0, 1, 2]))  # fork
    assert mirror.rows_pending()
    assert mirror.take_beam_idx().tolist() == [2, 2, 1, 0]  # the new empty row gathers row 0
    assert not mirror.rows_pending()
    assert mirror.next_positions.tolist() == [3, 3, 2, 0]
    assert not mirror.mask[3].any()


def test_mirror_refuses_host_edits_while_a_reorder_is_pending() -> None:
    mirror = Mirror()
    mirror.apply(AdmitRow(live_slots=1))
    mirror.apply(AdmitRow(live_slots=1))
    mirror.apply(ReorderRows(source_rows=(1, 0)))
    with pytest.raises(LedgerError, match="take_beam_idx"):
        mirror.apply(AdmitRow(live_slots=1))
    mirror.take_beam_idx()
    mirror.apply(AdmitRow(live_slots=1))
    assert mirror.rows == 3


def test_a_copied_row_leaves_the_table_as_it_was_and_waits_for_a_pending_reorder() -> None:
    ledger, mirror = Ledger(), Mirror()
    for count in (2, 3):
        mirror.apply(ledger.admit(count))
    before = ledger.mask.copy()
    mirror.apply(ledger.copy_row(1))
    assert np.array_equal(ledger.mask, before) and np.array_equal(mirror.mask, before)
    mirror.apply(ledger.reorder([1, 0]))
    with pytest.raises(LedgerError, match="take_beam_idx"):
        mirror.apply(CopyRow(row=0))
    mirror.take_beam_idx()
    mirror.apply(CopyRow(row=0))
    assert mirror.next_positions.tolist() == [3, 2]


def test_reorder_beam_idx_maps_new_rows_to_row_zero() -> None:
    assert ReorderRows(source_rows=(2, NEW_ROW, 0)).beam_idx().tolist() == [2, 0, 0]


def _staggered_ledger() -> Ledger:
    """Two rows whose rejected drafts leave dead slots in different columns."""
    ledger = Ledger()
    ledger.admit(4)
    ledger.admit(4)
    for rejected in ((3, 1), (1, 3), (2, 2)):
        ledger.append([4, 4])
        for row, count in enumerate(rejected):
            ledger.reject(row, count)
    return ledger


def test_column_compaction_keeps_columns_live_in_any_row() -> None:
    ledger = _staggered_ledger()
    policy = CompactionPolicy(min_dead_slots=1, min_dead_fraction=0.0, mode=CompactionMode.COLUMNS)
    delta = plan_compaction(np.asarray(ledger.mask), policy)
    assert delta is not None
    columns = delta.shared_columns()
    assert columns is not None
    assert columns.tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 13]  # 7, 11, 14, 15 are dead in both
    assert np.array_equal(delta.gather_index(), np.stack([columns, columns]))


def test_pack_compaction_frees_staggered_dead_slots() -> None:
    ledger = _staggered_ledger()
    live_before = ledger.mask.sum(axis=1).tolist()
    delta = ledger.compact(CompactionPolicy(min_dead_slots=1, min_dead_fraction=0.0))
    assert delta is not None and delta.shared_columns() is None
    assert ledger.slots == max(live_before) == 10
    assert ledger.mask.sum(axis=1).tolist() == live_before
    assert delta.keep[0] == ((0, 5), (8, 11), (12, 14))


def test_compaction_policy_thresholds() -> None:
    mask = np.ones((2, 100), dtype=bool)
    mask[:, 60:] = False  # 40 columns dead in every row
    assert plan_compaction(mask, CompactionPolicy(min_dead_slots=41, min_dead_fraction=0.0)) is None
    assert plan_compaction(mask, CompactionPolicy(min_dead_slots=1, min_dead_fraction=0.5)) is None
    delta = plan_compaction(mask, CompactionPolicy(min_dead_slots=40, min_dead_fraction=0.4))
    assert delta is not None and delta.new_slots == 60 and delta.keep == (((0, 60),), ((0, 60),))
    assert plan_compaction(np.ones((2, 5), dtype=bool), CompactionPolicy(min_dead_slots=0)) is None
    assert plan_compaction(np.zeros((0, 0), dtype=bool), CompactionPolicy()) is None


def test_empty_rows_are_prefilled_inside_the_batch() -> None:
    ledger = Ledger()
    ledger.add_rows(2)
    prefill = ledger.append([3, 5])
    assert position_ids(prefill).tolist() == [[0, 1, 2, 2, 2], [0, 1, 2, 3, 4]]
    assert ledger.dead_slots() == 2
    assert ledger.attention_mask().dtype == np.int64


def test_a_forked_mirror_moves_on_its_own() -> None:
    mirror = Mirror(64)
    mirror.apply(AdmitRow(3))
    mirror.apply(AdmitRow(5))
    mirror.take_beam_idx()
    twin = mirror.fork()
    twin.apply(ReorderRows((1, 0)))
    twin.apply(AppendSlots(2, (2, 1), (5, 3)))
    twin.apply(InvalidateSlots(0, 6, 7))
    assert mirror.rows_pending() is False and mirror.next_positions.tolist() == [3, 5]
    assert mirror.mask.sum(axis=1).tolist() == [3, 5] and mirror.slots == 5
    assert twin.take_beam_idx().tolist() == [1, 0] and twin.next_positions.tolist() == [6, 4]


def test_an_append_wider_than_the_context_is_refused_before_anything_is_allocated() -> None:
    # One small message claiming a huge call must not make a stage allocate its mask (a peer's DoS).
    mirror = Mirror(max_positions=8)
    mirror.apply(AdmitRow(live_slots=2))
    with pytest.raises(LedgerError, match="at most the context of 8"):
        mirror.apply(AppendSlots(count=10**12, live_counts=(0,), first_positions=(2,)))
    assert mirror.slots == 2
    mirror.apply(AppendSlots(count=6, live_counts=(6,), first_positions=(2,)))  # the whole context still fits


def test_a_compaction_keeping_runs_outside_the_slots_is_refused_before_expanding_them() -> None:
    mirror = Mirror()
    mirror.apply(AdmitRow(live_slots=3))
    with pytest.raises(LedgerError, match=r"outside 0\.\.3"):
        mirror.apply(Compact(new_slots=3, keep=(((0, 10**12),),)))
    with pytest.raises(LedgerError, match="more than 2 slots"):
        mirror.apply(Compact(new_slots=2, keep=(((0, 3),),)))
    assert mirror.mask.tolist() == [[True, True, True]]
