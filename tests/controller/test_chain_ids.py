"""ChainIds: the ids a chain puts on its stages and the steps it awaits (both chains keep theirs there)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from deskfleet.common.kv_ledger import AdmitRow, AppendSlots, CopyRow
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.chain_ids import ChainIds

SPAN = 1 << 8


def step(micro_batch_id: int, step_id: int = 0, admit_from: tuple[int, ...] = ()) -> Forward:
    deltas = tuple(AdmitRow(1) for _ in admit_from) or (AppendSlots(1, (1,), (0,)),)
    rows = max(len(admit_from), 1)
    return Forward(micro_batch_id, step_id, tuple(range(rows)), deltas, np.zeros(rows, np.int64),
                   np.zeros((rows, 1), np.int64), np.ones((rows, 1), np.int64), None, None, admit_from=admit_from)


def incrementing() -> ChainIds:
    return ChainIds(SPAN, itertools.count(0, SPAN).__next__)


def test_a_first_run_at_base_zero_sends_the_engines_own_message() -> None:
    ids = incrementing()
    message = step(3)
    assert ids.send(message) is message  # no copy per step while the base is 0
    result = ForwardResult(3, 0, (7,), None, None)
    assert ids.receive(result) is result
    assert ids.in_flight == 0


def test_after_renumber_every_id_is_shifted_and_shifted_back() -> None:
    ids = incrementing()
    ids.renumber()
    wire = ids.send(step(3, step_id=2, admit_from=(4, 5)))
    assert (wire.micro_batch_id, wire.admit_from) == (SPAN + 3, (SPAN + 4, SPAN + 5))
    assert ids.is_awaited(SPAN + 3) and not ids.is_awaited(3)
    result = ids.receive(ForwardResult(SPAN + 3, 2, (7,), None, None))
    assert result is not None and result.micro_batch_id == 3
    assert ids.engine_id(SPAN + 3) == 3


def test_copies_go_to_shifted_ids_too_and_ids_out_of_range_are_refused() -> None:
    """A row copied out for the prefix cache lands on the stages under the id the engine later resumes or releases
    through this chain: shifted as the step's own (the fleet's base is never 0)."""
    ids = incrementing()
    ids.renumber()
    message = replace(step(3), slot_deltas=(CopyRow(0), AppendSlots(1, (1,), (0,))), copy_into=(9,))
    wire = ids.send(message)
    assert wire.copy_into == (SPAN + 9,)
    with pytest.raises(ValueError, match="outside"):
        ids.send(replace(step(4), slot_deltas=(CopyRow(0), AppendSlots(1, (1,), (0,))), copy_into=(SPAN,)))


def test_changes_are_applied_even_at_base_zero() -> None:
    wire = incrementing().send(step(1), return_logits=True)
    assert wire.return_logits and wire.micro_batch_id == 1


def test_ids_out_of_range_and_a_second_step_in_flight_are_refused() -> None:
    ids = incrementing()
    with pytest.raises(ValueError, match="outside"):
        ids.send(step(SPAN))
    ids.send(step(1))
    with pytest.raises(ValueError, match="micro-batch 1 already has a step in flight"):
        ids.send(step(1, step_id=1))


def test_a_result_nobody_awaits_is_not_handed_on() -> None:
    ids = incrementing()
    ids.send(step(1, step_id=4))
    assert ids.receive(ForwardResult(1, 3, (7,), None, None)) is None  # another step of it
    assert ids.receive(ForwardResult(2, 4, (7,), None, None)) is None  # another micro-batch
    assert ids.receive(ForwardResult(1, 4, (7,), None, None)) is not None
    assert ids.receive(ForwardResult(1, 4, (7,), None, None)) is None  # a duplicate


def test_release_and_failure_stop_awaiting_a_step() -> None:
    ids = incrementing()
    ids.send(step(1))
    ids.send(step(2))
    assert ids.release(1) == 1
    assert ids.receive(ForwardResult(1, 0, (7,), None, None)) is None
    assert ids.fail(2) and not ids.fail(2)
    assert ids.in_flight == 0


def test_renumber_forgets_the_steps_in_flight_and_knows_their_late_results() -> None:
    bases = iter([5 * SPAN, 9 * SPAN])
    ids = ChainIds(SPAN, bases.__next__)
    wire = ids.send(step(1))
    ids.renumber()
    assert ids.in_flight == 0 and not ids.is_awaited(wire.micro_batch_id)
    assert ids.receive(ForwardResult(wire.micro_batch_id, 0, (7,), None, None)) is None
    assert ids.from_earlier_run(wire.micro_batch_id)
    assert not ids.from_earlier_run(9 * SPAN + 1) and not ids.from_earlier_run(7 * SPAN + 1)
    assert ids.send(step(1)).micro_batch_id == 9 * SPAN + 1  # the next engine's micro-batch 1 is a new id
