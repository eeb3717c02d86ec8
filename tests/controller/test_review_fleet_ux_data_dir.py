"""A controller data dir that is a file (or lies under one) is named with exit 2, not a FileExistsError
traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller.cli import main


@pytest.mark.parametrize(("command", "under"), [("init", ""), ("init", "sub"), ("token", ""), ("ls", "sub")])
def test_a_data_dir_that_is_a_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             command: str, under: str) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("not a fleet")
    data_dir = existing / under if under else existing
    assert main(["fleet", command, "--data-dir", str(data_dir)]) == 2
    error = capsys.readouterr().err
    where = "is a file, not a folder" if not under else f"cannot be made: {existing} is a file"
    assert f"deskfleet: error: the controller data dir {data_dir} {where}" in error
    assert "Traceback" not in error and existing.read_text() == "not a fleet"


def test_a_data_dir_that_is_a_dangling_link_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "ctl"
    link.symlink_to(tmp_path / "gone")
    assert main(["fleet", "init", "--data-dir", str(link)]) == 2
    assert "is a link to nothing, not a folder" in capsys.readouterr().err
