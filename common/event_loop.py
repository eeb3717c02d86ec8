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


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the chosen loop (main is closed unrun if no loop can be chosen)."""
    try:
        factory = loop_factory()
    except EventLoopError:
        main.close()
        raise
    runner = asyncio.Runner(loop_factory=factory)
    try:
        result = runner.run(main)
    except KeyboardInterrupt:  # Ctrl-C, or a bench's SIGTERM (a KeyboardInterrupt): it must reach the caller
        try:
            runner.close()
        except RuntimeError:
            # Raised by a signal handler while uvloop ran, a KeyboardInterrupt once left that loop marked running
            # (a CI run of `bench fleet` stopped while it deployed): closing it raised "Cannot close a running
            # event loop", which replaced the interrupt, so the bench said that and exited 2 instead of 130.
            _close_unstarted_tasks(runner)
        raise
    except BaseException:
        runner.close()
        raise
    finally:
        # a no-op once it ran; one that a signal (Ctrl-C, a bench's SIGTERM) stopped before it started would
        # print "coroutine ... was never awaited" after the command's last line
        main.close()
    runner.close()
    return result


def _close_unstarted_tasks(runner: asyncio.Runner) -> None:
    """Close the coroutines of the tasks that never started on a loop that could not be closed. Closing the loop
    would have cancelled and run them; left as they are, each printed "coroutine ... was never awaited" when it
    was collected, after the command's last line (`bench fleet` stopped by SIGTERM while its survey asked every
    address of a PC at once: a CI run). A task that did start is left alone: its coroutine cannot run its
    clean-up without the loop."""
    try:
        loop = runner.get_loop()
    except RuntimeError:  # closed after all
        return
    for task in asyncio.all_tasks(loop):
        coroutine = task.get_coro()
        if inspect.iscoroutine(coroutine) and inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
            coroutine.close()
