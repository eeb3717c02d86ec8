"""Started with standard output closed (`>&-`), Python's sys.stdout is None: the CLI crashed with an
AttributeError traceback (the allocator's flush before re-executing, then the streamed text's first write),
and `generate --json` generated, wrote nothing and exited 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deskfleet.agent import allocator
from deskfleet.controller import cli


def test_the_cli_refuses_a_closed_standard_output_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdout", None)
    # a command that would otherwise run (and here fail later on the missing model folder)
    assert cli.main(["generate", "--model", "/tmp/deskfleet-no-such-export", "--prompt-ids", "1,2", "--json"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "standard output is closed" in error


def test_a_closed_standard_output_is_refused_before_any_model_runs_in_a_real_process() -> None:
    closed = subprocess.run([sys.executable, "-c", "import sys; from deskfleet.controller.cli import main; "
                             "sys.exit(main(['generate', '--model', '/tmp/deskfleet-no-such-export', "
                             "'--prompt-ids', '1,2', '--json']))"],
                            stderr=subprocess.PIPE, text=True, timeout=120,
                            preexec_fn=lambda: os.close(1))  # as `>&-` starts it: no fd 1 at all
    assert closed.returncode == 2, closed.stderr
    assert "Traceback" not in closed.stderr and "standard output is closed" in closed.stderr


def test_re_executing_on_jemalloc_flushes_only_the_streams_that_are_open(monkeypatch: pytest.MonkeyPatch) -> None:
    executed: list[list[str]] = []
    monkeypatch.setattr(allocator, "jemalloc_environment", lambda device: {allocator.PRELOADED_VAR: "x"})
    monkeypatch.setattr(allocator.os, "execve", lambda path, argv, environment: executed.append(argv))
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "stderr", None)
    allocator.run_on_jemalloc("CPU")
    assert len(executed) == 1
