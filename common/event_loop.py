"""Which asyncio event loop deskfleet's network code runs on.

Every token crosses one TLS websocket per pipeline hop, and the standard loop runs TLS through
asyncio's pure-Python SSL protocol. uvloop (libuv, its SSL layer in Cython) cuts the CPU each message
costs, so it is used wherever it is installed (pyproject installs it on every platform but Windows,
which uvloop does not support). DESKFLEET_EVENT_LOOP=asyncio forces the standard loop (to rule the loop
out when debugging); DESKFLEET_EVENT_LOOP=uvloop makes a missing uvloop an error instead of a fallback.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from deskfleet.common.stop_signal import Stopped, StopSignal

ENV_VAR = "DESKFLEET_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


class EventLoopError(ValueError):
    """DESKFLEET_EVENT_LOOP names no loop, or one that is not installed."""


def chosen_loop(environ: Mapping[str, str] | None = None, uvloop_installed: bool | None = None) -> str:
    """The loop to run: "uvloop" or "asyncio", from DESKFLEET_EVENT_LOOP and what is installed."""
    environ = os.environ if environ is None else environ
    wanted = environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise EventLoopError(f"{ENV_VAR}={environ[ENV_VAR]!r} is not one of {', '.join(CHOICES)}")
    if uvloop_installed is None:
        uvloop_installed = importlib.util.find_spec("uvloop") is not None
    if wanted == "asyncio":
        return "asyncio"
    if not uvloop_installed:
        if wanted == "uvloop":
            raise EventLoopError(f"{ENV_VAR}=uvloop but uvloop is not installed (pip install uvloop; not on Windows)")
        return "asyncio"
    return "uvloop"


def loop_factory(environ: Mapping[str, str] | None = None) -> LoopFactory | None:
    """A factory for asyncio.Runner: uvloop's, or None for the standard loop."""
    if chosen_loop(environ) == "asyncio":
        return None
    import uvloop

    factory: LoopFactory = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], stop: StopSignal | None = None) -> T:
    """asyncio.run(main) on the chosen loop (main is closed unrun if no loop can be chosen). `stop`: where it is set,
    before or while main runs (from another thread), main's task is cancelled, as a Ctrl-C cancels it, and Stopped
    is raised once main has unwound."""
    runs = main if stop is None else _stoppable(main, stop)
    try:
        runner = asyncio.Runner(loop_factory=loop_factory())
        try:
            result = runner.run(runs)
        except KeyboardInterrupt:  # Ctrl-C, or a bench's SIGTERM (a KeyboardInterrupt): it must reach the caller
            _close(runner, interrupted=True)
            raise
        except BaseException:
            _close(runner, interrupted=False)
            raise
    finally:
        # a no-op once it ran; one that a signal (Ctrl-C, a bench's SIGTERM) stopped before it started (also while
        # the loop was chosen or the runner made: a fresh-clone CI run's SIGTERM while `bench fleet` deployed) would
        # print "coroutine ... was never awaited" after the command's last line
        runs.close()
        main.close()
    _close(runner, interrupted=False)
    return result


async def _stoppable(main: Coroutine[Any, Any, T], stop: StopSignal) -> T:
    """main, its task cancelled where `stop` is set; Stopped then."""
    if stop.is_set():
        main.close()
        raise Stopped("the work was not begun: stopping")
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()

    def cancel() -> None:  # on the thread that set the signal
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the loop closed meanwhile: main is over
            pass

    with stop.calling(cancel):
        try:
            return await main
        except asyncio.CancelledError:
            if not stop.is_set():
                raise
            task.uncancel()
            raise Stopped("the work was cut short: stopping") from None
        except Exception as error:  # what the cancel became on its way out (a TaskGroup's child failing with it)
            if not stop.is_set():
                raise
            raise Stopped("the work was cut short: stopping") from error


def _close(runner: asyncio.Runner, interrupted: bool) -> None:
    """runner.close() (which cancels the tasks left and runs them to their end), quietly after an interrupt, also
    one that comes while it closes: the command has said how it stopped and is on its way out."""
    loop = _loop_of(runner)
    try:
        runner.close()
    except RuntimeError:
        if not interrupted:
            raise
        # Raised by a signal handler while uvloop ran, a KeyboardInterrupt once left that loop marked running
        # (a CI run of `bench fleet` stopped while it deployed): closing it raised "Cannot close a running
        # event loop", which replaced the interrupt, so the bench said that and exited 2 instead of 130.
        if loop is not None:
            _close_unstarted_tasks(loop)
    except KeyboardInterrupt:  # a signal while the close ran the cancelled tasks (or the run had just ended)
        interrupted = True
        raise
    finally:
        if interrupted and loop is not None:
            _quiet_pending_tasks(loop)


def _loop_of(runner: asyncio.Runner) -> asyncio.AbstractEventLoop | None:
    """The runner's loop, None if it made none: get_loop() would make one, and a run refused before it began
    (called inside a running loop, given no coroutine) must raise its own error, not one of a loop made to close."""
    loop: asyncio.AbstractEventLoop | None = getattr(runner, "_loop", None)  # asyncio.Runner's own attribute
    return loop


def _close_unstarted_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Close the coroutines of the tasks that never started on a loop that could not be closed. Closing the loop
    would have cancelled and run them; left as they are, each printed "coroutine ... was never awaited" when it
    was collected, after the command's last line (`bench fleet` stopped by SIGTERM while its survey asked every
    address of a PC at once: a CI run). A task that did start is left to _quiet_pending_tasks: its coroutine
    cannot run its clean-up without the loop."""
    for task in asyncio.all_tasks(loop):
        coroutine = task.get_coro()
        if inspect.iscoroutine(coroutine) and inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
            coroutine.close()


def _quiet_pending_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Tell the tasks still pending after an interrupt not to log "Task was destroyed but it is pending!" when they
    are collected: the command has said how it stopped and is on its way out (CI runs of `bench fleet` stopped by
    SIGINT, SIGHUP or SIGTERM as it deployed printed it after their last line: the run's own task left cancelling,
    or a survey's task that the close was running when the signal came).
    The clean-up that matters there (its PCs and folder) runs outside the loop, in the caller's finally."""
    for task in asyncio.all_tasks(loop):
        if not task.done():
            task._log_destroy_pending = False  # type: ignore[attr-defined]  # asyncio's own switch for this message
