"""The agent's CLI with its standard streams closed or full, and a join token refused before any folder is made.

`join -` with standard input closed raised AttributeError (sys.stdin is None); a mistyped token was named, but
only after the data dir's cache/, settings/ and state/ were made for it; `pause > /dev/full` said only
"[Errno 28] No space left on device" with status 2, although the pause had taken effect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deskfleet.agent.cli import main
from tests.agent.test_opt_out import joined

AGENT = [sys.executable, "-m", "deskfleet.agent.cli"]
BUFFERED = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # as a user's is


def test_join_from_a_closed_standard_input_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["join", "-", "--data-dir", str(tmp_path / "agent")]) == 2
    assert "reads the token from standard input, which is closed" in capsys.readouterr().err
    assert not (tmp_path / "agent").exists()


@pytest.mark.parametrize("token", ["garbage", "dfj.not-base64!"])
def test_a_token_that_cannot_be_used_makes_no_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       token: str) -> None:
    assert main(["join", token, "--data-dir", str(tmp_path / "agent")]) == 2
    assert capsys.readouterr().err.startswith("deskfleet-agent: error:")
    assert not (tmp_path / "agent").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_pause_whose_message_cannot_be_written_says_it_was_done(tmp_path: Path) -> None:
    data_dir = joined(tmp_path / "agent")
    with open("/dev/full", "wb") as full:
        done = subprocess.run([*AGENT, "pause", "--data-dir", str(data_dir)], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=BUFFERED)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("deskfleet-agent: error: could not write to standard output (No space left on "
                                   "device); the pause itself was done")
    assert '"paused": true' in (data_dir / "state" / "opt_out.json").read_text()


def test_a_closed_standard_error_is_no_error(tmp_path: Path) -> None:
    data_dir = joined(tmp_path / "agent")
    done = subprocess.run([*AGENT, "pause", "--data-dir", str(data_dir)], stdout=subprocess.PIPE, text=True,
                          timeout=120, preexec_fn=lambda: os.close(2), env=BUFFERED)
    assert done.returncode == 0 and done.stdout.startswith("paused:")
    failed = subprocess.run([*AGENT, "pause", "--data-dir", str(tmp_path / "nobody")], stdout=subprocess.PIPE,
                            text=True, timeout=120, preexec_fn=lambda: os.close(2), env=BUFFERED)
    assert failed.returncode == 2 and failed.stdout == ""  # the error is not written into the output
