"""`deskfleet export` prints its progress on stderr and only its result on stdout, INT4 included."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.controller.cli import main


def test_int4_export_prints_only_its_result_on_stdout(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = checkpoint_factory("export-output", num_hidden_layers=1)
    capsys.readouterr()
    assert main(["export", str(checkpoint), "-o", str(tmp_path / "out"), "--weights", "int4"]) == 0
    captured = capsys.readouterr()
    # NNCF's rich progress bar, one per compressed IR, went to stdout
    assert "Weight Compression" not in captured.out + captured.err
    (line,) = captured.out.splitlines()
    assert line.startswith("exported ") and "int4" in line
    assert "[4/5] head" in captured.err
