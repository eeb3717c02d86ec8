"""The agent's KV memory guard: a step that would grow a stage's KV cache past what the PC has available (less a
floor) is refused before anything is allocated, and the available memory is read seldom."""

from __future__ import annotations

import pytest

from deskfleet.agent.kv_memory_guard import MIB, KvGrowth, KvMemoryGuard, KvMemoryRefused
from tests.fake_clock import FakeClock


class Memory:
    """Available memory a test sets (of `total`, 16 GiB unless given), counting the reads."""

    def __init__(self, free: int | None, total: int = 16 << 30) -> None:
        self.free = free
        self.total = total
        self.reads = 0

    def __call__(self) -> tuple[int, int] | None:
        self.reads += 1
        return None if self.free is None else (self.free, self.total)


def test_growth_is_bounded_from_the_step_alone() -> None:
    assert KvGrowth(rows=1, slots=40, held_rows=0, held_slots=0).slot_count == 40  # a first prompt
    assert KvGrowth(rows=4, slots=101, held_rows=4, held_slots=100).slot_count == 4  # a decode step of 4 rows
    assert KvGrowth(rows=5, slots=101, held_rows=4, held_slots=100).slot_count == 105  # a row added, padded to 101
    assert KvGrowth(rows=2, slots=101, held_rows=4, held_slots=100).slot_count == 0  # rows dropped: memory freed
    assert KvGrowth(rows=50_000, slots=11, held_rows=1, held_slots=10).slot_count == 549_990  # a hostile header


def test_steps_within_the_last_reading_are_let_grow_without_reading_again() -> None:
    memory, clock = Memory(1024 * MIB), FakeClock(100.0)
    guard = KvMemoryGuard(memory, floor_bytes=512 * MIB, recheck_s=1.0, clock=clock)
    for _ in range(5):
        guard.admit(100 * MIB, lambda: "a step")  # 500 of the 512 MiB above the floor
    assert memory.reads == 1
    clock.now += 1.0  # a second on: what other programs took since counts too
    memory.free = 600 * MIB
    guard.admit(50 * MIB, lambda: "a step")
    assert memory.reads == 2
    memory.free = 560 * MIB  # the cache took 40 of the 50 MiB counted
    with pytest.raises(KvMemoryRefused) as refused:
        guard.admit(60 * MIB, lambda: "micro-batch 7 step 3 (4 rows x 900 slots)")  # 48 MiB left above the floor
    assert memory.reads == 3  # read afresh before refusing: the estimates since the last reading may overstate
    assert str(refused.value).startswith("micro-batch 7 step 3 (4 rows x 900 slots) would grow this PC's KV cache "
                                         "and call buffers by up to 60 MiB with 560 MiB of the 16,384 MiB it "
                                         "may use available, leaving less than the 512 MiB this agent keeps "
                                         "free: run fewer or shorter streams")
    guard.admit(0, lambda: "a step that grows nothing")  # nothing asked of the memory
    assert memory.reads == 3


def test_memory_given_back_counts_from_the_next_reading() -> None:
    memory, clock = Memory(600 * MIB), FakeClock(100.0)
    guard = KvMemoryGuard(memory, floor_bytes=512 * MIB, clock=clock)
    guard.admit(80 * MIB, lambda: "a step")
    memory.free = 2048 * MIB  # a micro-batch released
    guard.admit(80 * MIB, lambda: "a step")  # more than the first reading left: read again, and let grow
    assert memory.reads == 2


def test_unknown_memory_refuses_nothing_and_is_asked_again_a_second_on() -> None:
    memory, clock = Memory(None), FakeClock(100.0)
    guard = KvMemoryGuard(memory, floor_bytes=512 * MIB, clock=clock)
    guard.admit(64 << 30, lambda: "a step")
    guard.admit(64 << 30, lambda: "a step")
    assert memory.reads == 1
    clock.now += 1.0
    memory.free = 1024 * MIB  # a sensor that comes back is used
    with pytest.raises(KvMemoryRefused):
        guard.admit(64 << 30, lambda: "a step")
    assert memory.reads == 2


def test_a_memory_reading_that_fails_refuses_nothing_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # a cgroup file the agent may not read raised through the guard, and the executor dropped the micro-batch
    def broken() -> tuple[int, int]:
        raise PermissionError(13, "Permission denied", "/sys/fs/cgroup/x/memory.max")

    clock = FakeClock(100.0)
    guard = KvMemoryGuard(broken, floor_bytes=512 * MIB, clock=clock)
    for _ in range(3):
        guard.admit(64 << 30, lambda: "a step")
        clock.now += 1.0
    assert [record.getMessage() for record in caplog.records] == [
        "cannot read the memory available (logged once): no step is refused for it"]


def test_an_agent_capped_to_little_memory_keeps_an_eighth_of_it_free_not_512_mib() -> None:
    # capped at 640 MiB by its service, 486 MiB available: with 512 MiB kept free it refused every step
    memory = Memory(486 * MIB, total=640 * MIB)
    guard = KvMemoryGuard(memory, floor_bytes=512 * MIB)
    guard.admit(300 * MIB, lambda: "a step")  # 486 - 80 = 406 MiB above the floor
    memory.free = 186 * MIB  # the cache took them
    with pytest.raises(KvMemoryRefused, match="with 186 MiB of the 640 MiB it may use available, leaving less than "
                                              "the 80 MiB this agent keeps free"):
        guard.admit(200 * MIB, lambda: "a step")


def test_a_refused_growth_below_a_mib_is_said_in_kib() -> None:
    # a step of a few KiB, refused on a PC at its floor, read "would grow ... by up to 0 MiB"
    guard = KvMemoryGuard(lambda: (512 * MIB, 16384 * MIB))
    with pytest.raises(KvMemoryRefused, match=r"by up to 12 KiB with 512 MiB"):
        guard.admit(12 * 1024, lambda: "micro-batch 1 step 9 (1 rows x 300 slots)")
