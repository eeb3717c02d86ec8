"""The console scripts' entry points: a Ctrl-C while a command's modules import ends it with 130, quietly; SIGTERM
and SIGHUP with one line and 143 / 129."""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator

import pytest

from deskfleet.common import launch


@pytest.fixture(autouse=True)
def _default_signals_after() -> Iterator[None]:
    """A main() faked here does not give SIGTERM and SIGHUP their default handling back, as a command's does; and
    a command that returned leaves SIGINT to the interpreter's exit, which is pytest's process here."""
    ctrl_c = signal.getsignal(signal.SIGINT)
    yield
    launch.restore_default_signals()
    signal.signal(signal.SIGINT, ctrl_c)
    atexit.unregister(launch.ignore_ctrl_c)


def test_a_ctrl_c_while_the_command_imports_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(name: str) -> types.ModuleType:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert launch.deskfleet() == 130
    assert launch.deskfleet_agent() == 130


@pytest.mark.parametrize(("entry", "module"), [(launch.deskfleet, "deskfleet.controller.cli"),
                                               (launch.deskfleet_agent, "deskfleet.agent.cli")])
def test_each_entry_runs_its_commands_main(monkeypatch: pytest.MonkeyPatch, entry: object, module: str) -> None:
    monkeypatch.setattr(importlib.import_module(module), "main", lambda: 7)
    assert callable(entry) and entry() == 7


def test_launching_imports_nothing_heavy() -> None:
    code = "import sys, deskfleet.common.launch; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('openvino', 'numpy', 'websockets', 'cryptography')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


_IMPORT_THEN = """
import importlib, os, signal, sys, time, types
from deskfleet.common import launch

def import_module(name):
    {during}
    time.sleep(0.5)  # a signal the handler takes arrives by now
    # a command's main() reads its arguments, then gives SIGTERM its default handling back for the command
    return types.SimpleNamespace(main=lambda: (launch.restore_default_signals(),
                                               0 if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else 9)[1])

importlib.import_module = import_module
sys.exit(launch.deskfleet())
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on Windows")
@pytest.mark.parametrize(("signum", "status", "said"), [(signal.SIGTERM, 143, "deskfleet: stopped by SIGTERM\n"),
                                                        (signal.SIGHUP, 129, "deskfleet: stopped by SIGHUP\n")])
def test_sigterm_or_sighup_while_the_command_imports_says_so(signum: int, status: int, said: str) -> None:
    # `deskfleet generate` killed in its first second ended with exit 143 and not a word (the default handling)
    code = _IMPORT_THEN.format(during=f"os.kill(os.getpid(), {int(signum)})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (status, said)


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on Windows")
def test_an_ignored_sighup_stays_ignored_and_the_command_runs_with_the_default_handling() -> None:
    # under nohup (SIGHUP ignored) the command goes on; and it runs with SIGTERM's handling the default again: an
    # export removes its unfinished folder on SIGTERM only where that handling is the default
    code = _IMPORT_THEN.format(during="os.kill(os.getpid(), signal.SIGHUP)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert (run.returncode, run.stderr) == (0, "")


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no signal masks on Windows")
@pytest.mark.parametrize(("signum", "status", "said"), [(signal.SIGTERM, 143, "deskfleet: stopped by SIGTERM\n"),
                                                        (signal.SIGINT, 130, "")])
def test_a_signal_as_the_process_re_executes_itself_is_taken_by_the_new_one(signum: int, status: int,
                                                                            said: str) -> None:
    # a run re-executes itself onto jemalloc: a SIGTERM while the new interpreter started ended it without a word,
    # and a Ctrl-C while it imported its site module was Python's "Fatal Python error: init_import_site", exit 1;
    # both are held across the exec, and arrive where the new one's launcher takes them
    after = _IMPORT_THEN.format(during="pass")
    code = ("import os, signal, sys\nfrom deskfleet.common import launch\nlaunch.block_across_exec()\n"
            f"os.kill(os.getpid(), {int(signum)})  # pending, across the exec\n"
            f"os.execv(sys.executable, [sys.executable, '-c', {after!r}])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (status, said)


def test_a_ctrl_c_that_a_library_wraps_in_its_import_error_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenVINO's package turns a KeyboardInterrupt in its import into `ImportError: initialization failed`: a
    # 30-line traceback and exit 1
    def wrapped(name: str) -> types.ModuleType:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as error:
            raise ImportError("initialization failed") from error

    monkeypatch.setattr(importlib, "import_module", wrapped)
    assert launch.deskfleet() == 130

    def broken(name: str) -> types.ModuleType:
        raise ImportError("no module named openvino")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ImportError, match="no module named openvino"):
        launch.deskfleet()


def test_the_interruption_is_found_through_causes_and_contexts_and_a_cycle_ends_the_search() -> None:
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("while stopping")  # noqa: B904 (the context is the point)
    except RuntimeError as error:
        assert isinstance(launch.interruption(error), KeyboardInterrupt)
    first, second = ValueError("a"), ValueError("b")
    first.__context__, second.__context__ = second, first
    assert launch.interruption(first) is None


_RETURN_THEN = """
import atexit, gc, importlib, os, signal, sys, threading, time, types
from deskfleet.common import launch

def main():
    {during}
    return 7

def returned():  # main() has returned: the launcher's handler of a further Ctrl-C is in (a thread's clock starts here)
    while getattr(signal.getsignal(signal.SIGINT), "__name__", "") != "further_ctrl_c":
        time.sleep(0.005)

importlib.import_module = lambda name: types.SimpleNamespace(main=main)
sys.exit(launch.deskfleet())
"""


def _exit_of(during: str) -> subprocess.CompletedProcess[str]:
    code = _RETURN_THEN.format(during=during.replace("\n", "\n    "))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_second_ctrl_c_as_the_interpreter_exits_is_ignored() -> None:
    # a double Ctrl-C: the second landed in the exit's join of the threads, and Python printed "Exception ignored
    # in: <module 'threading'> ... KeyboardInterrupt"; or in the C++ destructors, and the process died of SIGINT
    # the atexit handler's comes past the second a press is ignored for: SIGINT is ignored from the atexit handlers on
    run = _exit_of("threading.Thread(target=lambda: (returned(), time.sleep(0.2), os.kill(os.getpid(), signal.SIGINT),"
                   " time.sleep(0.2))).start()  # joined as the interpreter exits\n"
                   "atexit.register(lambda: (time.sleep(launch.FURTHER_CTRL_C_IGNORED_S + 0.2),"
                   " os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))")
    assert (run.returncode, run.stderr) == (7, "")


def test_a_ctrl_c_long_after_the_command_returned_ends_an_exit_that_waits() -> None:
    # someone pressing Ctrl-C at an exit that seems stuck (a thread that does not end) is not ignored
    started = time.monotonic()
    run = _exit_of("threading.Thread(target=lambda: (returned(), time.sleep(launch.FURTHER_CTRL_C_IGNORED_S + 0.3),"
                   " print('pressed', flush=True), os.kill(os.getpid(), signal.SIGINT), time.sleep(30))).start()")
    assert (run.returncode, run.stdout, run.stderr) == (launch.INTERRUPTED_EXIT, "pressed\n", "")
    assert time.monotonic() - started < 20


def test_what_the_command_left_in_reference_cycles_is_freed_before_the_interpreter_finalizes() -> None:
    # a Ctrl-C's traceback holds the stopped run's frames, and its compiled models, in cycles: freed as the
    # interpreter finalized, they aborted it ("terminate called without an active exception") now and then
    run = _exit_of("class Held:\n"
                   "    def __del__(self):\n"
                   "        print('finalizing' if sys.is_finalizing() else 'freed', flush=True)\n"
                   "held = Held()\n"
                   "held.cycle = held\n"
                   "gc.disable()  # as if no collection came before the exit\n"
                   "del held")
    assert (run.returncode, run.stdout, run.stderr) == (7, "freed\n", "")


def test_a_process_started_without_standard_input_gives_uvloop_no_descriptor_0() -> None:
    # `serve`, `fleet serve` and the agent started with `<&-` aborted at their stop: a socket took descriptor 0,
    # and libuv asserts that it never closes one of 0-2 (exit 134)
    script = """
import asyncio, fcntl, os, sys, uvloop
from deskfleet.common.launch import fill_closed_standard_fds
fill_closed_standard_fds()
assert sys.stdin is None and fcntl.fcntl(0, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
async def main():
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    server.close()
    await server.wait_closed()
uvloop.run(main())
"""
    started = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                             preexec_fn=lambda: os.close(0))
    assert started.returncode == 0, started.stderr


def test_a_command_started_without_standard_output_still_says_so_through_the_launcher() -> None:
    closed = subprocess.run([sys.executable, "-c", "import sys; from deskfleet.common.launch import deskfleet; "
                             "sys.exit(deskfleet())", "generate", "--model", "/tmp/deskfleet-no-such-export",
                             "--prompt-ids", "1,2", "--json"],
                            stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2 and "standard output is closed" in closed.stderr, closed.stderr
