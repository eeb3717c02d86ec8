"""A clock for the code that takes one (a `clock` callable that returns seconds), shared by the tests."""

from __future__ import annotations


class FakeClock:
    """Stands still at `now` until the test moves it (`clock.now += 5`); with `tick`, each reading first moves it
    on by that much (an LRU that must see every access at a later time)."""

    def __init__(self, now: float = 0.0, tick: float = 0.0) -> None:
        self.now = now
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now
