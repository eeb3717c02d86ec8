"""The command lines `deskfleet-agent` tells its user to run, on Windows (simulated: `sys.platform` is "win32"): a
--data-dir holding a space (a folder under C:\\Users\\John Smith) was printed bare, and the command copied from
`join`'s "start it with:" or from an unjoined `pause` split it into two arguments."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path, PureWindowsPath

import pytest

from deskfleet.agent import cli


def test_a_data_dir_with_a_space_is_quoted_on_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    folder = PureWindowsPath(r"C:\Users\John Smith\deskfleet")
    assert cli._data_dir_flag(folder) == r' --data-dir "C:\Users\John Smith\deskfleet"'  # type: ignore[arg-type]
    assert cli._data_dir_flag(PureWindowsPath(r"D:\fleet")) == r" --data-dir D:\fleet"  # type: ignore[arg-type]
    assert cli._data_dir_flag(None) == ""


def test_an_unjoined_pause_names_the_quoted_join_command_on_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for module in ("deskfleet.agent.enroll", "deskfleet.agent.link", "deskfleet.agent.opt_out"):
        importlib.import_module(module)  # as on Linux, before sys.platform changes: only the message is under test

    data_dir = tmp_path / "John Smith"
    monkeypatch.setattr(sys, "platform", "win32")
    assert cli.main(["pause", "--data-dir", str(data_dir)]) == 2
    assert f'`deskfleet-agent join TOKEN --data-dir "{data_dir}"` first' in capsys.readouterr().err


def test_the_data_dir_is_quoted_for_a_posix_shell_off_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    # it was printed bare: `deskfleet-agent --headless --data-dir /srv/John Smith` split in two by the shell
    monkeypatch.setattr(sys, "platform", "linux")
    assert cli._data_dir_flag(Path("/srv/John Smith")) == " --data-dir '/srv/John Smith'"
    assert cli._data_dir_flag(Path("/srv/agent")) == " --data-dir /srv/agent"
    assert cli._data_dir_flag(Path("-dash")) == " --data-dir=-dash"  # argparse reads `--data-dir -dash` as options
