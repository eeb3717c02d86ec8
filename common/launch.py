"""The console scripts' entry points (`deskfleet`, `deskfleet-agent`).

A command's modules take a second or two to import (OpenVINO, numpy, the commands themselves); a Ctrl-C in
that time ends the command as a Ctrl-C anywhere else in it does, with exit status 130, not with a traceback
of the import. SIGTERM and SIGHUP in that time (where their handling is the default: nohup's ignored SIGHUP
stays ignored) end it with one line naming the signal and exit status 143 / 129, as they do once a command runs:
`deskfleet generate` killed in its first second ended without a word (a run re-executes itself once, with
jemalloc, and goes through here again). The command's main() puts their default handling back
(restore_default_signals) once its arguments are read, just before the command runs: each command installs its own
(or relies on the default's, as an export's cleanup checks). Once main() returns, a further Ctrl-C no longer
interrupts the interpreter's exit (_exit_quietly_on_ctrl_c). This module imports nothing heavy itself.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as the shell reports it
FURTHER_CTRL_C_IGNORED_S = 1.0  # after a command's main() returned: a double press or a key's bounce, not a request


def deskfleet() -> int:
    return _run("deskfleet.controller.cli", "deskfleet")


def deskfleet_agent() -> int:
    return _run("deskfleet.agent.cli", "deskfleet-agent")


_installed: list[int] = []  # the signals _stop_while_loading handles now


def restore_default_signals() -> None:
    """Give SIGTERM and SIGHUP their default handling back where this module changed it (no-op otherwise: a main()
    called from elsewhere, or called again), and take them out of the blocked set (see block_across_exec)."""
    while _installed:
        signal.signal(_installed.pop(), signal.SIG_DFL)
    unblock_held_signals()


def block_across_exec() -> None:
    """Block SIGTERM, SIGHUP and SIGINT before this process re-executes itself (agent/allocator.py, onto jemalloc):
    the blocked set and what is pending survive the exec, and the new process's launcher takes them out of it once
    its handlers are in, so that one that came while the new interpreter started is said, not the default's silent
    end, and a Ctrl-C is the 130 of one while the modules load, not Python's "Fatal Python error: init_import_site"
    (exit 1) of one while the interpreter imports its site module. A process started otherwise, such as `bench
    fleet`'s simulated PCs, takes them out where run_on_jemalloc returns: left blocked, their SIGTERM was ignored
    and each PC's stop waited 10 s for a SIGKILL."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, _held_across_exec())


def _run(module: str, program: str) -> int:
    fill_closed_standard_fds()
    try:
        _stop_while_loading(program)  # a Ctrl-C held across a re-exec arrives as it unblocks it
        main: Callable[[], int] = importlib.import_module(module).main
    except BaseException as error:
        restore_default_signals()
        if interruption(error) is not None:
            return INTERRUPTED_EXIT
        raise
    status = main()  # which calls restore_default_signals once its arguments are read
    _exit_quietly_on_ctrl_c()
    gc.collect()  # see _exit_quietly_on_ctrl_c
    return status


def fill_closed_standard_fds() -> None:
    """Open /dev/null at each of descriptors 0, 1 and 2 that the process started without (`<&-`, or a service
    manager's), close-on-exec. Otherwise the next socket took descriptor 0, and libuv (uvloop) aborted as it closed it
    ("uv__close: Assertion `fd > STDERR_FILENO' failed", exit 134): `serve`, `fleet serve` and the agent, started
    with standard input closed, died so at their stop. Python's own sys.stdin/stdout/stderr stay None, as Python set
    them at start-up (a command that must write says so, as before), and so does a re-executed process's: these
    descriptors close at exec, and its launcher opens its own."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        opened = os.open(os.devnull, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        if opened != fd:  # the lowest free descriptor is this one, unless another thread opened one meanwhile
            os.dup2(opened, fd, inheritable=False)
            os.close(opened)


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C's KeyboardInterrupt that `error` is, or was raised because of (its causes and contexts); None where
    there is none. OpenVINO's package turns one that lands in its import into `ImportError: initialization failed`,
    its cause the KeyboardInterrupt (that ended a Ctrl-C with a 30-line traceback and exit 1)."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _exit_quietly_on_ctrl_c() -> None:
    """Once the command's main() has returned, nothing is left for a Ctrl-C to stop but the interpreter's exit (its
    threads' joins, atexit handlers, the compiled models' destructors). A second Ctrl-C pressed a few milliseconds
    after the one that ended the command, as people do, landed there: Python printed "Exception ignored in ...
    KeyboardInterrupt", or the process died of SIGINT, or it aborted ("terminate called without an active
    exception", exit -6). Measured on `generate --stages 4` with three SIGINTs 3 ms apart: 8 of 21 runs ended so,
    2 of 24 with this, both aborts: a stage's compiled model was still held then, by nothing gc.get_referrers sees.

    - One within FURTHER_CTRL_C_IGNORED_S of main()'s return is ignored, so the exit finishes (the standard
      library's atexit work: logging's flush, multiprocessing's children, temporary folders); a later one, from
      someone waiting on threads that do not end, ends the process at once with 130.
    - From the atexit handlers on, SIGINT is ignored, a stuck handler or destructor too: Python puts a handler of its
      own back to the default before the C++ libraries' destructors run, and one arriving there killed the process.
    - The caller then collects the garbage: a Ctrl-C's traceback holds the frames of the run it stopped, and with
      them the compiled models, in reference cycles that were otherwise freed only as the interpreter finalized.

    Only the console scripts come here: a test calling a command's main() keeps its process's SIGINT handling
    (tests calling deskfleet() put it back)."""
    returned = time.monotonic()

    def further_ctrl_c(signum: int, frame: FrameType | None) -> None:
        if time.monotonic() - returned < FURTHER_CTRL_C_IGNORED_S:
            return
        for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError, RuntimeError):  # closed, or a flush this handler interrupted
                pass
        os._exit(INTERRUPTED_EXIT)

    signal.signal(signal.SIGINT, further_ctrl_c)
    atexit.register(ignore_ctrl_c)  # registered last, so run first


def ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_while_loading(program: str) -> None:
    """Make SIGTERM and SIGHUP, where their handling is the default, end the process with a line naming them; then
    take them out of the blocked set, where one that came before (blocked across a re-execution) is delivered. The
    handler ends the process where it is, raising nothing: an exception raised from a handler in the middle of a
    library's import can be swallowed by the library (a SIGTERM so lost let the whole run go on), and nothing is
    under way yet that needs unwinding."""
    def stop(signum: int, frame: FrameType | None) -> None:
        try:
            os.write(2, f"{program}: stopped by {signal.Signals(signum).name}\n".encode())
        except OSError:  # a terminal that hung up: the exit status says it
            pass
        os._exit(128 + signum)

    for signum in _stopping():
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, stop)
            _installed.append(signum)
    unblock_held_signals()


def _stopping() -> list[int]:
    return [signum for name in ("SIGTERM", "SIGHUP") if (signum := getattr(signal, name, None)) is not None]


def _held_across_exec() -> list[int]:
    return [*_stopping(), signal.SIGINT]


def unblock_held_signals() -> None:
    """Take the signals block_across_exec held out of the blocked set: one that came meanwhile is delivered now."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _held_across_exec())
