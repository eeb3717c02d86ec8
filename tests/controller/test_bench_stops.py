"""Every bench but `bench fleet` (test_review_bench_signals.py) stopped by Ctrl-C, SIGTERM or SIGHUP: it unwinds,
says so in one line, prints no report and exits 130 / 143 / 129."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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
