"""What the controller's windows share (the chat window, controller/chat_window.py, and the fleet window,
controller/fleet_window.py): work on a thread of its own, whose end is told to the window's thread; and running a
window until it is closed or a signal stops it, where there is a display to show it on."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMainWindow

T = TypeVar("T")
W = TypeVar("W", bound=QMainWindow)


def in_thread(work: Callable[[], T], done: Callable[[T], None], failed: Callable[[str], None],
              said_alone: tuple[type[BaseException], ...] = (), silent: tuple[type[BaseException], ...] = (),
              name: str = "deskfleet-window-work") -> None:
    """Run `work` on a daemon thread, then `done` with its result, or `failed` with what went wrong: an error of
    `said_alone` in its own words (they are the whole story), any other with its type too (a bug must not pass in
    silence, nor leave the window waiting for an end that never comes); one of `silent` tells no one (the window asked
    for it: its close). `done` and `failed` are meant to emit a Qt signal, which Qt queues to the window's thread."""

    def run() -> None:
        try:
            try:
                done(work())  # a `done` that fails is told too (one that raised left the window waiting)
            except silent:
                return
            except said_alone as error:
                failed(str(error) or type(error).__name__)
            except BaseException as error:  # a CancelledError too: see the docstring
                failed(f"{type(error).__name__}: {error}")
        except RuntimeError as error:  # "... already deleted", "Signal source has been deleted": the window was
            # closed meanwhile, and there is no one to tell
            if "deleted" not in str(error):
                raise

    threading.Thread(target=run, daemon=True, name=name).start()


def require_display(environ: dict[str, str] | None = None, platform: str = sys.platform) -> None:
    """Raise RuntimeError, naming the way out, where a window cannot be shown: on Linux and the BSDs with no X11 or
    Wayland display and no Qt platform chosen (QT_QPA_PLATFORM). Qt would abort the process there (exit 134), after
    a page of its plugin's advice. Windows and macOS always have their own."""
    environ = dict(os.environ) if environ is None else environ
    if not (platform.startswith("linux") or "bsd" in platform):
        return
    chosen = environ.get("QT_QPA_PLATFORM", "").split(":")[0].strip().lower()
    needs = {"xcb": ("DISPLAY",), "wayland": ("WAYLAND_DISPLAY",), "": ("DISPLAY", "WAYLAND_DISPLAY")}.get(chosen)
    if needs is None or any(environ.get(name) for name in needs):  # another platform (offscreen, eglfs...): its own
        return
    platform_set = f" (QT_QPA_PLATFORM={environ['QT_QPA_PLATFORM']})" if chosen else ""
    raise RuntimeError(f"no display to show the window on: {' and '.join(needs)} unset{platform_set}; run it in the "
                       "desktop session, or over `ssh -X`")


def run_until_closed(make_window: Callable[[], W]) -> W:
    """Make the window once Qt runs, show it, and return it once it is closed or a signal (Ctrl-C, SIGTERM, SIGHUP)
    quits the application; the caller then stops what it still has under way."""
    require_display()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    assert isinstance(app, QApplication)
    app.setApplicationName("deskfleet")
    window = make_window()
    window.show()
    for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None:
            signal.signal(signum, lambda *_: QApplication.quit())
    wake = QTimer()  # Python runs a signal's handler only when it runs: wake it twice a second
    wake.timeout.connect(lambda: None)
    wake.start(500)
    app.exec()
    return window
