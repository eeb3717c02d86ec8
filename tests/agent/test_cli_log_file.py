"""`deskfleet-agent --log-file FILE`: what a command says on standard error (the log, its errors, a crash's traceback)
goes to FILE. Autostart's tasks on Windows give it: pythonw.exe has no standard error at all."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_log_file_gets_what_the_command_says_on_standard_error(tmp_path: Path) -> None:
    log = tmp_path / "state" / "agent.log"
    done = subprocess.run([sys.executable, "-m", "deskfleet.agent", "--log-file", str(log), "--headless",
                           "--data-dir", str(tmp_path / "not-joined")], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and done.stderr == ""
    assert "deskfleet-agent: error:" in log.read_text(encoding="utf-8") and "join" in log.read_text(encoding="utf-8")


def test_a_log_file_past_its_size_is_kept_as_dot_1_at_the_start(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.agent import cli

    log = tmp_path / "agent.log"
    log.write_text("old line\n" * 20)
    monkeypatch.setattr(cli, "LOG_ROLL_BYTES", 100)
    assert cli.main(["--log-file", str(log), "pause", "--data-dir", str(tmp_path / "never-joined")]) == 2
    assert (tmp_path / "agent.log.1").read_text() == "old line\n" * 20
    assert "old line" not in log.read_text() and "deskfleet-agent: error:" in log.read_text()


def test_a_log_file_that_cannot_be_written_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deskfleet.agent import cli

    (tmp_path / "file").touch()
    assert cli.main(["--log-file", str(tmp_path / "file" / "agent.log"), "pause"]) == 2
    assert "cannot write the log file" in capsys.readouterr().err


def test_a_crash_is_written_to_the_log_file_with_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python prints an uncaught exception's traceback after main() has put standard error back: under pythonw, to
    nowhere. It is written to the log before."""
    from deskfleet.agent import cli

    def crash(*_: object, **__: object) -> int:
        raise RuntimeError("a bug in pause")

    monkeypatch.setattr(cli, "_pause", crash)
    log = tmp_path / "agent.log"
    with pytest.raises(RuntimeError):
        cli.main(["--log-file", str(log), "pause", "--data-dir", str(tmp_path)])
    text = log.read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in text and "RuntimeError: a bug in pause" in text


@pytest.mark.skipif(ctypes.util.find_library("jemalloc") is None or sys.platform != "linux",
                    reason="the agent re-executes itself only onto an installed jemalloc, on Linux")
def test_an_agent_re_executed_onto_jemalloc_logs_its_crash_once_and_the_terminal_sees_it(tmp_path: Path) -> None:
    """fd 2 is given back for the re-exec: the new process opens the log itself (it inherited the log as fd 2, and
    wrote the traceback there twice, the terminal nothing)."""
    log = tmp_path / "agent.log"
    done = subprocess.run([sys.executable, "-P", "-m", "deskfleet.agent", "-v", "--log-file", str(log), "--headless",
                           "--data-dir", str(tmp_path / "not-joined")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DESKFLEET_ALLOCATOR": "jemalloc"}, check=False)
    text = log.read_text(encoding="utf-8")
    assert done.returncode == 1 and "re-executing on" in text
    assert text.count("Traceback (most recent call last)") == 1 and "Traceback" in done.stderr


def test_a_log_that_cannot_be_rolled_over_is_appended_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log viewer or an antivirus holding the old log open on Windows: the agent starts all the same."""
    from deskfleet.agent import cli

    log = tmp_path / "agent.log"
    log.write_text("old line\n" * 20)
    (tmp_path / "agent.log.1").mkdir()  # what cannot be replaced here, as a held file cannot there
    monkeypatch.setattr(cli, "LOG_ROLL_BYTES", 100)
    assert cli.main(["--log-file", str(log), "pause", "--data-dir", str(tmp_path / "never-joined")]) == 2
    assert log.read_text().startswith("old line\n") and "deskfleet-agent: error:" in log.read_text()
