"""controller/qt_window.py: a window's work on a thread of its own always tells its end, and a window with no display
to go to is refused in words before Qt would abort the process."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

import pytest

from deskfleet.common.stop_signal import Stopped
from deskfleet.controller.fleet_store import FleetStoreError
from deskfleet.controller.qt_window import in_thread, require_display


def told(work: Callable[[], object], done: Callable[[object], None] | None = None) -> tuple[str, object]:
    """What in_thread told of `work`: ("done", result), ("failed", words), or ("nothing", None) within 2 s."""
    answers: queue.Queue[tuple[str, object]] = queue.Queue()
    in_thread(work, done or (lambda result: answers.put(("done", result))),
              lambda words: answers.put(("failed", words)), said_alone=(FleetStoreError,), silent=(Stopped,))
    try:
        return answers.get(timeout=2)
    except queue.Empty:
        return "nothing", None


def raising(error: BaseException) -> Callable[[], object]:
    def work() -> object:
        raise error
    return work


def test_every_end_of_the_work_is_told_but_the_one_asked_for() -> None:
    assert told(lambda: 42) == ("done", 42)
    assert told(raising(FleetStoreError("ca.pem is missing"))) == ("failed", "ca.pem is missing")  # its own words
    assert told(raising(FleetStoreError())) == ("failed", "FleetStoreError")  # no words: its name
    assert told(raising(KeyError("roster"))) == ("failed", "KeyError: 'roster'")  # a bug, with its type
    assert told(raising(asyncio.CancelledError())) == ("failed", "CancelledError: ")  # no Exception, told all the same
    assert told(raising(Stopped("closing"))) == ("nothing", None)  # the window asked for it


def test_a_done_that_fails_is_told_too() -> None:
    def done(result: object) -> None:
        raise ValueError(f"cannot show {result}")

    assert told(lambda: 7, done) == ("failed", "ValueError: cannot show 7")


@pytest.mark.parametrize(("environ", "platform", "refused"), [
    ({}, "linux", "DISPLAY and WAYLAND_DISPLAY unset"),
    ({"DISPLAY": ":0"}, "linux", None),
    ({"WAYLAND_DISPLAY": "wayland-0"}, "linux", None),
    ({"XDG_SESSION_TYPE": "wayland"}, "linux", "DISPLAY and WAYLAND_DISPLAY unset"),
    ({"QT_QPA_PLATFORM": "offscreen"}, "linux", None),
    ({"QT_QPA_PLATFORM": "xcb"}, "linux", "DISPLAY unset (QT_QPA_PLATFORM=xcb)"),  # Qt aborted after the check
    ({"QT_QPA_PLATFORM": "wayland", "DISPLAY": ":0"}, "linux", "WAYLAND_DISPLAY unset (QT_QPA_PLATFORM=wayland)"),
    ({"QT_QPA_PLATFORM": "xcb", "DISPLAY": ":1"}, "linux", None),
    ({}, "freebsd14", "DISPLAY and WAYLAND_DISPLAY unset"),
    ({}, "win32", None),  # Windows and macOS always have one
    ({}, "darwin", None),
])
def test_no_display_is_said_before_qt_would_abort(environ: dict[str, str], platform: str, refused: str | None) -> None:
    if refused is None:
        require_display(environ, platform)
        return
    with pytest.raises(RuntimeError, match="no display to show the window on") as error:
        require_display(environ, platform)
    assert refused in str(error.value)
