from __future__ import annotations

from deskfleet.common.log_limit import LogEvery
from tests.fake_clock import FakeClock


def test_a_key_is_due_first_then_once_an_interval_each_key_on_its_own() -> None:
    clock = FakeClock(100.0)
    limit = LogEvery(clock)
    assert limit.due("pc1", 60.0) and not limit.due("pc1", 60.0)
    assert limit.due("pc2", 60.0)  # another key: due at once
    clock.now += 59.0
    assert not limit.due("pc1", 60.0)
    clock.now += 1.0
    assert limit.due("pc1", 60.0) and not limit.due("pc1", 60.0)
    assert limit.due("pc1", 0.0)  # the interval is the caller's, read at each call


def test_past_its_bound_it_forgets_every_key() -> None:
    limit = LogEvery(FakeClock(100.0), max_keys=2)
    assert limit.due("a", 60.0) and limit.due("b", 60.0)
    assert limit.due("c", 60.0)  # a third key: the two before are forgotten
    assert limit.due("a", 60.0) and not limit.due("c", 60.0)
