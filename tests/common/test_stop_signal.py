"""StopSignal: a stop one thread gives another's work, calling what registered to be woken, once."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from deskfleet.common.stop_signal import Stopped, StopSignal
from tests.log_records import records_of


def test_set_calls_each_callback_registered_while_its_block_runs_once() -> None:
    stop = StopSignal()
    called: list[str] = []
    with stop.calling(lambda: called.append("gone")):
        pass  # left before the stop: not called
    with stop.calling(lambda: called.append("a")), stop.calling(lambda: called.append("b")):
        stop.set()
        stop.set()  # a second stop calls nothing again
    assert called == ["a", "b"] and stop.is_set()


def test_a_callback_registered_after_the_stop_is_called_at_once() -> None:
    stop = StopSignal()
    stop.set()
    called: list[str] = []
    with stop.calling(lambda: called.append("late")):
        assert called == ["late"]
    assert called == ["late"]


def test_wait_returns_as_another_thread_stops() -> None:
    stop = StopSignal()
    assert stop.wait(0.01) is False
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert stop.wait(10) is True
    assert time.monotonic() - started < 5


def test_check_raises_only_once_stopped() -> None:
    stop = StopSignal()
    stop.check("the re-plan")
    stop.set()
    with pytest.raises(Stopped, match="the re-plan was cut short: stopping"):
        stop.check("the re-plan")


def test_a_callback_that_fails_is_logged_and_the_others_are_called() -> None:
    stop = StopSignal()
    called: list[str] = []

    def fails() -> None:
        raise RuntimeError("the loop closed")

    with records_of("deskfleet.common.stop_signal", logging.ERROR) as logged, stop.calling(fails), \
            stop.calling(lambda: called.append("second")):
        stop.set()
    assert called == ["second"] and logged.messages() == ["a stop's callback failed"]
