"""An operating system's error that reaches the command line (a read-only data dir, a lock file that is a folder,
a path too long) is one line naming the path and the way out, exit 2: it was a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller.cli import main
from deskfleet.controller.fleet_store import SERVE_LOCK


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0
    (tmp_path / "ctl" / ".lock").unlink(missing_ok=True)
    (tmp_path / "ctl" / ".lock").mkdir()
    capsys.readouterr()
    assert main(["fleet", "token", *data]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"deskfleet: error: cannot open the data dir's lock file: Is a directory: "
                                 f"{tmp_path / 'ctl' / '.lock'} (that is a folder, where a file is needed)\n")


def test_a_serve_lock_that_cannot_be_opened_costs_no_token_and_no_listing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `fleet token` printed a token its ledger holds, then failed on the question whether `fleet serve` runs
    # (a token a script then threw away); `fleet ls` failed on it too, where the data dir was read-only
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0
    (tmp_path / "ctl" / SERVE_LOCK).unlink(missing_ok=True)
    (tmp_path / "ctl" / SERVE_LOCK).mkdir()
    capsys.readouterr()
    assert main(["fleet", "token", *data]) == 0
    assert capsys.readouterr().out.startswith("dfj")
    assert main(["fleet", "ls", "--discover-seconds", "0", *data]) == 0


def test_a_path_too_long_is_named_with_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / ("m" * 300)
    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "File name too long" in err and "longer than its file system takes" in err, err

