"""Every bench but `bench fleet` (test_review_bench_signals.py) stopped by Ctrl-C, SIGTERM or SIGHUP: it unwinds,
says so in one line, prints no report and exits 130 / 143 / 129."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Coroutine
from pathlib import Path

import pytest

from deskfleet.controller import cli
from deskfleet.controller.bench import speculative
from deskfleet.controller.bench.interruption import BenchTerminated


def _stopping_bench(error: KeyboardInterrupt) -> object:
    def run(*args: object, **kwargs: object) -> object:
        raise error
    return run


@pytest.mark.parametrize(("error", "status", "name"), [(KeyboardInterrupt(), 130, "SIGINT (Ctrl-C)"),
                                                      (BenchTerminated(signal.SIGTERM), 143, "SIGTERM"),
                                                      (BenchTerminated(signal.SIGHUP), 129, "SIGHUP")])
def test_a_stopped_bench_says_so_and_exits_with_the_signals_status(
        error: KeyboardInterrupt, status: int, name: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(speculative, "run_speculative_bench", _stopping_bench(error))
    assert cli.main(["bench", "speculative", "--model", "m"]) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"deskfleet: bench speculative stopped by {name}: no report\n"


def test_a_signal_whose_exception_a_library_lost_still_stops_the_bench() -> None:
    # fresh-clone CI: SIGTERM as bench fleet signed a simulated PC's certificate came back from cryptography's code as
    # "certificate request signature is invalid", and the bench exited 2 with that error instead of 143
    from deskfleet.controller.bench.interruption import signals_unwind

    with pytest.raises(BenchTerminated) as stopped, signals_unwind():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs here, and its exception is lost
        except BaseException:
            pass
        raise ValueError("certificate request signature is invalid")
    assert stopped.value.signum == signal.SIGTERM
    assert isinstance(stopped.value.__cause__, ValueError)


def test_a_coroutine_a_signal_stopped_before_it_ran_is_closed_quietly(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # Python runs a signal's handler as a function begins: SIGTERM while `bench fleet` deployed stopped
    # `event_loop.run(run())` at its first line, and "coroutine ... was never awaited" came after the bench's message
    made: list[Coroutine[object, object, None]] = []

    async def deploy() -> None:
        raise AssertionError("must not run")

    def runs(main: Coroutine[object, object, None]) -> None:  # stopped as it begins
        raise BenchTerminated(signal.SIGTERM)

    def bench(*args: object, **kwargs: object) -> object:
        made.append(deploy())
        runs(made[-1])
        return {}

    monkeypatch.setattr(speculative, "run_speculative_bench", bench)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert cli.main(["bench", "speculative", "--model", "m"]) == 143
        made.clear()
        gc.collect()
    assert [str(warning.message) for warning in said] == []
    assert capsys.readouterr().err == "deskfleet: bench speculative stopped by SIGTERM: no report\n"


@pytest.mark.slow
def test_sigterm_mid_run_unwinds_instead_of_ending_the_process_on_the_spot(tiny_export: Path, tmp_path: Path) -> None:
    # Python's default for SIGTERM ends the process at once (exit -15, nothing said, no `finally` run)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    stderr_path = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "deskfleet.controller.cli", "bench", "speculative", "--model", str(tiny_export),
               "--prompts-file", str(prompts), "--k", "2", "--no-adaptive", "--new-tokens", "4", "--rounds", "100000"]
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "round 1/" not in stderr_path.read_text(errors="replace"):  # the rounds have begun
            assert process.poll() is None, stderr_path.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "no round finished in 120 s"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    said = stderr_path.read_text(errors="replace")
    assert process.returncode == 143, said[-2000:]
    assert out == b"" and said.endswith("deskfleet: bench speculative stopped by SIGTERM: no report\n")


def test_runner_processes_are_out_of_reach_of_the_terminals_ctrl_c(tmp_path: Path) -> None:
    # the terminal's Ctrl-C reached `bench parity`'s runners too: each printed a KeyboardInterrupt traceback
    # under the bench's one line; the bench stops them itself as it unwinds
    from deskfleet.controller.bench.runner_process import RunnerProcess

    script = tmp_path / "runner.py"
    script.write_text("import sys\nsys.stdin.readline()\n")
    runner = RunnerProcess(script, None)
    try:
        assert os.getsid(runner.process.pid) != os.getsid(0)
    finally:
        runner.close("quit")
    assert runner.process.returncode == 0


def _runner_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "runner.py"
    script.write_text(body)
    return script


def test_a_signal_held_while_a_runner_starts_ends_that_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # raised as the held block ended, inside RunnerProcess(): no caller had the object to close, and the runner,
    # in a session of its own, outlived the bench
    from deskfleet.controller.bench import runner_process
    from deskfleet.controller.bench.interruption import signals_unwind

    started: list[subprocess.Popen[str]] = []
    real_popen = subprocess.Popen

    def popen_then_ctrl_c(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        started.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        signal.raise_signal(signal.SIGINT)  # held until the Popen block ends
        return started[-1]

    monkeypatch.setattr(runner_process.subprocess, "Popen", popen_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt), signals_unwind():
        runner_process.RunnerProcess(_runner_script(tmp_path, "import time\ntime.sleep(60)\n"), None)
    assert started and started[0].poll() is not None


def test_a_runner_that_never_gets_ready_is_ended_with_its_start(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller.bench.runner_process import RunnerProcess

    runner = RunnerProcess(_runner_script(tmp_path, "import sys, time\nsys.stdin.readline()\ntime.sleep(60)\n"), None)
    monkeypatch.setattr(runner, "receive", _stopping_bench(KeyboardInterrupt()))  # a Ctrl-C while it loads
    with pytest.raises(KeyboardInterrupt):
        runner.start("{}")
    assert runner.process.poll() is not None


def test_a_stopping_bench_ends_a_busy_runner_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # close() sent "quit" and waited up to 30 s for a runner busy with a generation, while further Ctrl-Cs
    # were ignored
    from deskfleet.controller.bench import runner_process

    runner = runner_process.RunnerProcess(_runner_script(tmp_path, "import time\ntime.sleep(60)\n"), None)
    monkeypatch.setattr(runner_process, "stopping", lambda: True)
    began = time.monotonic()
    runner.close("quit")
    assert runner.process.poll() is not None and time.monotonic() - began < 10


def test_a_signal_after_the_report_says_the_report_is_whole(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from deskfleet.controller import cli as cli_module

    monkeypatch.setattr(speculative, "run_speculative_bench", lambda *args, **kwargs: {"figure": 1})

    def print_then_sigterm(text: str) -> None:
        print(text)
        signal.raise_signal(signal.SIGTERM)  # held until the report is out

    monkeypatch.setattr(cli_module, "print_whole", print_then_sigterm)
    assert cli.main(["bench", "speculative", "--model", "m"]) == 143
    captured = capsys.readouterr()
    assert '"figure": 1' in captured.out
    assert captured.err == "deskfleet: bench speculative stopped by SIGTERM after its report was printed whole\n"
