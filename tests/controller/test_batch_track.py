"""The driver's BatchTrack: the beam_idx and position_ids it sends are exactly what a stage's mirror
computes when it replays the same deltas (the driver keeps no mirror of its own)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.agent.stage_executor import replay_deltas
from deskfleet.common.kv_ledger import CompactionMode, CompactionPolicy, Mirror
from deskfleet.controller.batch_track import BatchTrack

EAGER = CompactionPolicy(min_dead_slots=1, min_dead_fraction=0.0, mode=CompactionMode.PACK_ROWS)

# One operation between steps: ("add",), ("admit", live slots), ("drop", row pick), ("reject", row pick,
# count), ("compact",); each step feeds every row 1-3 tokens (or none).
OPERATIONS = st.one_of(
    st.tuples(st.just("add")),
    st.tuples(st.just("admit"), st.integers(1, 6)),
    st.tuples(st.just("drop"), st.integers(0, 7)),
    st.tuples(st.just("reject"), st.integers(0, 7), st.integers(1, 3)),
    st.tuples(st.just("compact")),
)


def _stage_view(mirror: Mirror, track: BatchTrack, feed: list[list[int]]) -> tuple[np.ndarray, np.ndarray, object]:
    message = track.step(feed)
    inputs = replay_deltas(mirror, message.slot_deltas)
    return inputs.beam_idx, inputs.position_ids, message


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(OPERATIONS, max_size=3), st.integers(0, 3)), min_size=1, max_size=12))
def test_driver_beam_idx_and_positions_match_a_replaying_mirror(script: list[tuple[list[tuple], int]]) -> None:
    track = BatchTrack(1, 10_000)
    mirror = Mirror(10_000)
    track.add_row(0)
    next_stream = 1
    for operations, width in script:
        for operation in operations:
            kind = operation[0]
            if kind == "add":
                track.add_row(next_stream)
                next_stream += 1
            elif kind == "admit":
                track.admit(next_stream, source_batch=100 + next_stream, live_slots=operation[1])
                next_stream += 1
            elif kind == "drop" and track.rows > 1:
                track.drop({track.stream_ids[operation[1] % track.rows]})
            elif kind == "reject" and track.rows:
                stream = track.stream_ids[operation[1] % track.rows]
                live = int(track.ledger.next_positions[track.stream_ids.index(stream)])
                track.reject(stream, min(operation[2], live))
            elif kind == "compact":
                track.compact(EAGER)
        feed = [[7] * ((width + row) % 4) for row in range(track.rows)]
        if not any(feed):
            feed = [[7] for _ in range(track.rows)]
        beam_idx, positions, message = _stage_view(mirror, track, feed)
        np.testing.assert_array_equal(message.beam_idx, beam_idx)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(message.position_ids, positions)  # type: ignore[attr-defined]


def test_rows_dropped_and_added_before_a_step_read_the_right_state_rows() -> None:
    track = BatchTrack(1, 100)
    for stream in range(3):
        track.add_row(stream)
    track.step([[1, 2], [3], [4, 5]])
    track.drop({1})
    track.add_row(9)
    message = track.step([[6], [7], [8]])
    assert message.beam_idx.tolist() == [0, 2, 0]  # rows 0 and 2 survive; the new row reads row 0 (masked)
    assert message.position_ids.tolist() == [[2], [2], [0]]


@pytest.mark.parametrize("admitted_after_drop", [True, False])
def test_an_admission_gathers_pending_reorders_first(admitted_after_drop: bool) -> None:
    track = BatchTrack(1, 100)
    mirror = Mirror(100)
    for stream in range(2):
        track.add_row(stream)
    replay_deltas(mirror, track.step([[1], [2]]).slot_deltas)
    if admitted_after_drop:
        track.drop({0})
    track.admit(5, source_batch=7, live_slots=4)
    beam_idx, positions, message = _stage_view(mirror, track, [[3]] * track.rows)
    np.testing.assert_array_equal(message.beam_idx, beam_idx)  # type: ignore[attr-defined]
    assert message.beam_idx.tolist() == list(range(track.rows))  # type: ignore[attr-defined]
    np.testing.assert_array_equal(message.position_ids, positions)  # type: ignore[attr-defined]
