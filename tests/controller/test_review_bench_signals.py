"""`deskfleet bench fleet` stopped by a signal: every simulated PC ends, the temporary folder goes, the exit
status is the shell's 128 + signal and stderr says so in one line.

Each test runs the real command on the tiny export with TMPDIR in its own folder, so that the bench's
temporary folder and its simulated PCs (whose command lines name that folder) are told apart from anything
else on the machine; whatever a failing run leaves behind is killed by its pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

DEADLINE_S = 120.0  # a bound for a broken run: reaching a round took 7-10 s here (process starts, imports,
# compiles), 2.5x inside the old 25 s and too little for a CI machine 3-5x slower at those


class BenchRun:
    """One `deskfleet bench fleet` process in a session of its own (a signal reaches it alone, not its PCs)."""

    def __init__(self, model: Path, folder: Path, new_tokens: int) -> None:
        self.temporary = folder / "tmp"
        self.temporary.mkdir(parents=True)
        self.stderr_path = folder / "stderr.txt"
        environment = {**os.environ, "TMPDIR": str(self.temporary)}
        command = [sys.executable, "-m", "deskfleet.controller.cli", "bench", "fleet", "--model", str(model),
                   "--rounds", "3", "--warmup-rounds", "0", "--new-tokens", str(new_tokens),
                   "--prompt-tokens", "4"]
        with self.stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=environment,
                                            start_new_session=True)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def simulated_pcs(self) -> list[int]:
        """The pids of the processes whose command line names this run's temporary folder."""
        marker = str(self.temporary).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == self.process.pid:
                continue
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # ended meanwhile
                continue
        return pids

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert self.process.poll() is None, f"the bench ended before {what}: {self.stderr()[-2000:]}"
            assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S:.0f} s: {self.stderr()[-2000:]}"
            time.sleep(0.01)

    def end(self) -> None:
        """Kill whatever is left of this run (only after a failed assertion is anything left)."""
        for pid in [self.process.pid, *self.simulated_pcs()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


@pytest.fixture
def start_bench(tiny_export: Path, tmp_path: Path) -> Iterator[Callable[[int], BenchRun]]:
    runs: list[BenchRun] = []

    def start(new_tokens: int = 48) -> BenchRun:
        runs.append(BenchRun(tiny_export, tmp_path / f"run{len(runs)}", new_tokens))
        return runs[-1]

    yield start
    for run in runs:
        run.end()


def agents_starting(run: BenchRun) -> bool:
    return bool(run.simulated_pcs())


def deploying(run: BenchRun) -> bool:
    return "deploying" in run.stderr()


def round_running(run: BenchRun) -> bool:
    return "round 1/3 " in run.stderr()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
@pytest.mark.parametrize("phase", [agents_starting, deploying, round_running])
def test_a_signal_stops_every_simulated_pc_removes_the_folder_and_says_so(
        start_bench: Callable[..., BenchRun], phase: Callable[[BenchRun], bool], signum: int) -> None:
    run = start_bench()
    run.wait_for(lambda: phase(run), phase.__name__.replace("_", " "))
    run.process.send_signal(signum)
    try:
        status = run.process.wait(DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the bench did not end within {DEADLINE_S:.0f} s of {signal.Signals(signum).name}")
    assert status == 128 + signum, run.stderr()[-2000:]
    last_line = run.stderr().strip().splitlines()[-1]
    assert last_line.startswith("deskfleet: bench fleet stopped by SIG"), run.stderr()[-2000:]
    assert signal.Signals(signum).name in last_line
    assert run.simulated_pcs() == []
    assert list(run.temporary.iterdir()) == []


def test_the_simulated_pcs_end_when_the_bench_is_killed(start_bench: Callable[..., BenchRun]) -> None:
    # SIGKILL (the OOM killer, kill -9) runs no cleanup in the bench: each PC must notice on its own.
    run = start_bench(new_tokens=400)
    run.wait_for(lambda: round_running(run), "round")
    pcs = run.simulated_pcs()
    assert pcs
    run.process.kill()
    run.process.wait()
    deadline = time.monotonic() + DEADLINE_S
    while run.simulated_pcs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.simulated_pcs() == [], "simulated PCs outlived the bench that started them"


def test_ctrl_c_among_the_starts_of_the_simulated_pcs_stops_those_already_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet starts its PCs in its constructor, before any `with` holds it to stop them.
    from deskfleet.controller.bench import fleet as fleet_module

    started: list[subprocess.Popen[bytes]] = []
    real_popen, real_issue = subprocess.Popen, fleet_module._issue

    def recorded_popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    def issue_until_ctrl_c(ca: object, files: object, name: str) -> None:
        if started:
            raise KeyboardInterrupt
        real_issue(ca, files, name)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet_module.subprocess, "Popen", recorded_popen)
    monkeypatch.setattr(fleet_module, "_issue", issue_until_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            fleet_module._Fleet(tmp_path, {"pc0": (0,), "pc1": (0,)}, threads=1)
        assert len(started) == 1
        assert started[0].poll() is not None, "a simulated PC started before the Ctrl-C is still running"
    finally:
        for process in started:
            process.kill()
            process.wait()


# In a fresh interpreter: a real signal raised in the test process crashed it (SIGSEGV) once earlier tests had
# run OpenVINO and asyncio there (a fresh-clone CI run; test_export_output.py saw the same with kill; the cause,
# OpenVINO Cores unmapping a thread's alternate signal stack, is in agent/openvino_core.py).
HELD_BLOCK = """
import signal
from deskfleet.controller.bench.interruption import signals_held, signals_unwind

finished_block = raised = False
with signals_unwind():
    try:
        with signals_held():
            signal.raise_signal(signal.SIGINT)
            finished_block = True
    except KeyboardInterrupt:
        raised = True
    signal.raise_signal(signal.SIGINT)  # while the first one unwinds: ignored, the cleanup goes on
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
print(f"finished_block={finished_block} raised={raised}")
"""


def test_a_signal_in_a_held_block_is_raised_at_its_end_and_a_second_one_is_ignored() -> None:
    # A held block is a process start and its record: cut in two, it leaves a process nothing can stop.
    done = subprocess.run([sys.executable, "-c", HELD_BLOCK], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "finished_block=True raised=True"


# A websocket echo under signals_unwind, SIGHUP sent at a random moment of its traffic, 20 times: the handler
# raised its exception at whatever bytecode the main thread was at, and uvloop took one raised inside a
# protocol's data_received for a transport's error (the link closed, the client carried on: the signal lost, as
# in the fresh-clone CI run of SIGHUP while deploying), or the loop hung.
SIGNAL_IN_TRAFFIC = """
import os, random, signal, sys, threading, time
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed
from deskfleet.common import event_loop
from deskfleet.controller.bench.interruption import BenchTerminated, signals_unwind

async def echo_traffic(seconds):
    async def echo(websocket):
        try:
            async for message in websocket:
                await websocket.send(message)
        except ConnectionClosed:
            pass
    async with serve(echo, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            try:  # as a deploy does: a dropped link is an agent's problem, not the end of the run
                async with connect(f"ws://127.0.0.1:{port}") as websocket:
                    while time.monotonic() < ends:
                        await websocket.send(b"x" * 4096)
                        await websocket.recv()
            except (ConnectionClosed, OSError):
                pass

random.seed(int(sys.argv[1]))
outcomes = []
for _ in range(20):
    timer = threading.Timer(random.uniform(0.05, 0.4), os.kill, (os.getpid(), signal.SIGHUP))
    timer.start()
    try:
        with signals_unwind():
            event_loop.run(echo_traffic(0.6))
        outcomes.append("lost")
    except BenchTerminated:
        outcomes.append("raised")
    timer.join()
print(" ".join(outcomes))
"""


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_signal_amid_websocket_traffic_is_never_lost(loop: str) -> None:
    if loop == "uvloop" and sys.platform == "win32":
        pytest.skip("no uvloop on Windows")
    environment = {**os.environ, "DESKFLEET_EVENT_LOOP": loop}
    try:  # 20 runs take 4-5 s
        done = subprocess.run([sys.executable, "-c", SIGNAL_IN_TRAFFIC, "7"], capture_output=True, text=True,
                              timeout=60, check=False, env=environment)
    except subprocess.TimeoutExpired:
        pytest.fail("a signal amid the traffic hung the event loop")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["raised"] * 20, done.stdout
