"""A benchmark stopped by SIGTERM or SIGHUP cleans up as one stopped by Ctrl-C does.

Python's default for SIGTERM (kill, timeout, systemd, a CI runner's cancel) and SIGHUP (a closed terminal)
ends the process at once: no `finally` and no context manager's exit runs. `bench fleet` then left its
simulated PCs (processes of their own) running, each holding a port and a compiled model, and its temporary
folder in place. While a bench runs under `signals_unwind`, these signals raise BenchTerminated instead: a
KeyboardInterrupt, so it unwinds every `finally`, asyncio's runner and thread joins exactly as Ctrl-C does
(asyncio re-raises a KeyboardInterrupt from a callback, where it would log and drop any other exception).

Where an asyncio loop runs in the main thread, the signal's exception is raised by a callback the handler
schedules on it, not by the handler itself: a handler runs at whatever bytecode the main thread is at, and an
exception raised inside the loop's own callbacks was lost or hung the loop. uvloop passes an exception from a
protocol's data_received to the loop's exception handler (logged as "Fatal error on transport", the transport
closed), so the websocket library saw a dropped link, the bench carried on and exited 0 (a fresh-clone CI run,
SIGHUP while deploying); a test script that echoes over a websocket while SIGHUP arrives lost the signal in 4
of 14 runs on uvloop and hung in 2 (4 of 14 on the standard loop), and none with the callback (240 of 240). A
signal scheduled so, whose loop stopped before running it, is raised when `signals_unwind`'s block ends.

Two places must not be cut in two, Ctrl-C included:
- the cleanup: after the first signal every further one is ignored, so that stopping the simulated PCs
  (bounded by their stop timeout) is not cut short and does not leave some of them running;
- a `signals_held` block, such as starting a process and recording it: an exception raised inside
  subprocess.Popen after its fork leaves a child that no Popen object names, so nothing could stop it. A
  signal that arrives there is raised when the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

# What kill, timeout, systemd and a closed terminal send; SIGINT already raises KeyboardInterrupt.
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


_Report = TypeVar("_Report")


class BenchTerminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a benchmark ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class _Unwinding:
    """The handler of the signals while `signals_unwind` runs: the first one received, whether it waits for
    the end of the held blocks open."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.raised = False  # its exception was raised (or is being: the callback ran)
        self.held_blocks = 0
        self.deferred = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # again while the first one unwinds: let the cleanup finish
            return
        self.received = signum
        if self.held_blocks:
            self.deferred = True
            return
        try:
            loop = asyncio.get_running_loop()  # the main thread's: the handler runs there
        except RuntimeError:
            self.raise_received()
            return
        try:
            loop.call_soon_threadsafe(self.raise_received)  # raised by the loop, between its callbacks
        except RuntimeError:  # the loop closed meanwhile
            self.raise_received()

    def raise_received(self) -> None:
        self.deferred = False
        self.raised = True
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is not None:
            raise BenchTerminated(self.received)


_unwinding: _Unwinding | None = None  # set while `signals_unwind` runs (in the main thread, the only one)


@contextlib.contextmanager
def signals_unwind(ctrl_c: bool = True) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise BenchTerminated and Ctrl-C KeyboardInterrupt, except in
    a `signals_held` block (raised at its end); after the first of them every further one is ignored until
    the block has exited. Only where a signal's handling is Python's default: a program's own handler, or the
    SIG_IGN that nohup sets for SIGHUP, is left as it is. `ctrl_c` False leaves SIGINT to Python's own handler
    (`generate` and `chat`, where a Ctrl-C stops a reply and the next one may stop the next)."""
    global _unwinding
    if threading.current_thread() is not threading.main_thread() or _unwinding is not None:
        yield  # only the main thread may set handlers (Python runs them there); an outer block handles them
        return
    unwinding = _Unwinding()
    handled = [signum for signum in ENDING_SIGNALS if signal.getsignal(signum) is signal.SIG_DFL]
    if ctrl_c and signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where Ctrl-C is ignored
        handled.append(signal.SIGINT)
    previous = {signum: signal.signal(signum, unwinding.handle) for signum in handled}
    _unwinding = unwinding
    try:
        yield
        if unwinding.received is not None and not unwinding.raised:  # scheduled on a loop that stopped first
            unwinding.raise_received()
    except Exception as error:
        if unwinding.received is None:
            raise
        # the signal's exception was lost where it was raised, in a library's code, and came back as that code's
        # failure (bench fleet, SIGTERM as it signed a PC's certificate: "certificate request signature is invalid",
        # exit 2): the signal is what stops it
        try:
            unwinding.raise_received()
        except KeyboardInterrupt as stopped:
            raise stopped from error
        raise
    finally:
        _unwinding = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A block that a signal must not cut in two (see the module's docstring): one that arrives while it runs
    is raised when it ends. Outside `signals_unwind`, or in another thread (where Python raises no signal's
    exception), it holds nothing."""
    unwinding = _unwinding
    if unwinding is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    unwinding.held_blocks += 1
    try:
        yield
    finally:
        unwinding.held_blocks -= 1
    if not unwinding.held_blocks and unwinding.deferred:
        unwinding.raise_received()


def stopping() -> bool:
    """Whether a signal is stopping the bench (received under `signals_unwind`): what is still running should end
    at once, not finish its work first."""
    unwinding = _unwinding
    return unwinding is not None and unwinding.received is not None


def stopping_signal(error: KeyboardInterrupt) -> int:
    """The signal behind a KeyboardInterrupt: a BenchTerminated's, or one that says which (`signum`, as
    run.GenerationInterrupted carries it on), else SIGINT."""
    signum = getattr(error, "signum", None)
    return signum if isinstance(signum, int) else signal.SIGINT


def exit_status(error: KeyboardInterrupt) -> int:
    """What a shell reports for a process ended by the signal: 128 + its number (130 for Ctrl-C)."""
    return 128 + stopping_signal(error)


def signal_name(error: KeyboardInterrupt) -> str:
    """The signal that stopped the command, as a user would name it."""
    signum = stopping_signal(error)
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


def say_stopped(line: str) -> None:
    """`line` (what stopped a command) on stderr; a terminal that hung up (SIGHUP) takes nothing, and the exit
    status says it instead."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def close_unstarted_coroutines(error: BaseException) -> None:
    """Close the coroutines that the frames `error` unwound hold and that never started. Python runs a signal's
    handler as a function begins, so a signal can stop `event_loop.run(run())` between making the coroutine and the
    first line of the function that runs it: freed unrun, it printed "coroutine '_Fleet.deploy.<locals>.run' was
    never awaited" after the bench's one-line message (a fresh-clone CI run, SIGTERM while deploying)."""
    link: BaseException | None = error
    seen: set[int] = set()
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        trace = link.__traceback__
        while trace is not None:
            for value in trace.tb_frame.f_locals.values():
                if inspect.iscoroutine(value) and inspect.getcoroutinestate(value) == inspect.CORO_CREATED:
                    value.close()
            trace = trace.tb_next
        link = link.__cause__ or link.__context__


def run_bench(name: str, run: Callable[[], _Report], print_report: Callable[[_Report], None],
              then: Callable[[_Report], None] | None = None, then_what: Callable[[], str] | None = None,
              cleaned_up: str = "") -> int:
    """Run a bench under `signals_unwind`, print its report whole (`signals_held`), then do `then` (write its
    files). Stopped by Ctrl-C, SIGTERM or SIGHUP it unwinds (what it started is stopped), says in one line on
    stderr by which signal and how far it got (no report; or the report printed whole, and what `then_what` says
    `then` had not done yet), and returns 130 / 143 / 129; 0 when it ran to the end."""
    printed = False
    try:
        with signals_unwind():
            report = run()
            with signals_held():  # a signal meanwhile: after the report is out whole
                print_report(report)
                printed = True
            if then is not None:
                then(report)
    except KeyboardInterrupt as stopped:
        close_unstarted_coroutines(stopped)
        if not printed:
            how_far = f": no report{cleaned_up}"
        else:
            left = then_what() if then_what is not None else ""
            how_far = " after its report was printed whole" + (f", before {left}" if left else "")
        print(f"deskfleet: bench {name} stopped by {signal_name(stopped)}{how_far}", file=sys.stderr, flush=True)
        return exit_status(stopped)
    return 0
