"""What `deskfleet export` prints: its progress on stderr and only its result on stdout, INT4 included; a
failed write names the file."""

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


def test_a_full_disk_names_the_file_and_the_room_left(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import openvino as ov

    from deskfleet.controller.export import exporter

    save_model = ov.save_model

    def disk_full_at_layer_0(model: ov.Model, path: Path, **kwargs: object) -> None:
        if Path(path).name == "layer_000.xml":
            Path(path).with_suffix(".bin").write_bytes(b"\0" * 100)  # what OpenVINO got written
            raise RuntimeError("basic_ios::clear: iostream error")  # OpenVINO's words for ENOSPC
        save_model(model, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(exporter.ov, "save_model", disk_full_at_layer_0)
    checkpoint = checkpoint_factory("export-output", num_hidden_layers=1)
    capsys.readouterr()
    assert main(["export", str(checkpoint), "-o", str(tmp_path / "out"), "--weights", "f32"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("deskfleet: error: cannot write layer_000.xml/.bin of the export: basic_ios::clear")
    assert f"free in {tmp_path}; is the disk full?" in error
    assert list(tmp_path.iterdir()) == []  # nothing half-written left, and no out
