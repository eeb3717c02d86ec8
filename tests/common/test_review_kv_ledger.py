"""Review fuzz of the KV ledger: any delta a peer could send either fits or is refused without a trace."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deskfleet.common.kv_ledger import (
    AdmitRow,
    AppendSlots,
    Compact,
    InvalidateSlots,
    LedgerError,
    Mirror,
    ReorderRows,
    SlotDelta,
)

_SMALL = st.integers(-3, 12)
_ANY = st.one_of(_SMALL, _SMALL, _SMALL, st.integers(-2**63, 2**63 - 1))
_ROWS = st.lists(_ANY, max_size=4).map(tuple)
_DELTAS = st.one_of(
    st.builds(AppendSlots, _ANY, _ROWS, _ROWS),
    st.builds(InvalidateSlots, _ANY, _ANY, _ANY),
    st.builds(ReorderRows, _ROWS),
    st.builds(AdmitRow, _ANY),
    st.builds(Compact, _ANY, st.lists(st.lists(st.tuples(_ANY, _ANY), max_size=3).map(tuple), max_size=4).map(tuple)))


def _fitting_append(mirror: Mirror, delta: AppendSlots, data: st.DataObject) -> AppendSlots:
    """The drawn call width with live counts and first positions that fit the mirror, so appends get through."""
    width = min(max(delta.count, 1), 8)
    live = tuple(data.draw(st.integers(0, width)) for _ in range(mirror.rows))
    return AppendSlots(width, live, tuple(mirror.next_positions.tolist()))


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_DELTAS, max_size=25), st.sampled_from([16, 1000]), st.data())
def test_any_delta_fits_and_keeps_the_invariants_or_is_refused_leaving_the_mirror_unchanged(
        deltas: list[SlotDelta], context: int, data: st.DataObject) -> None:
    mirror = Mirror(context)
    for delta in deltas:
        if isinstance(delta, AppendSlots) and data.draw(st.booleans()):
            delta = _fitting_append(mirror, delta, data)
        if mirror.rows_pending() and data.draw(st.booleans()):
            mirror.take_beam_idx()
        mask, positions, pending = mirror.mask.copy(), mirror.next_positions, mirror.rows_pending()
        try:
            mirror.apply(delta)
        except LedgerError:
            assert np.array_equal(mirror.mask, mask) and np.array_equal(mirror.next_positions, positions)
            assert mirror.rows_pending() == pending
            continue
        assert mirror.mask.shape == (mirror.rows, mirror.slots)
        assert mirror.next_positions.tolist() == mirror.mask.sum(axis=1).tolist()  # positions 0..next-1 are live
        assert int(mirror.next_positions.max(initial=0)) <= context
