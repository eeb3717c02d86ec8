"""What a walk through `deskfleet export` found in its messages: a Hugging Face model name given as MODEL_DIR was
said to be "not a folder", and Ctrl-C stopped an export without the line SIGTERM's prints."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.model_spec import WeightFormat
from deskfleet.controller.export import exporter
from deskfleet.controller.export.exporter import ExportError, export_checkpoint


def test_a_model_name_for_a_folder_that_does_not_exist_is_told_export_downloads_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExportError) as raised:
        export_checkpoint(Path("meta-llama/Llama-3.1-8B"), Path("out/l"), WeightFormat.F32)
    message = str(raised.value)
    assert message.startswith("meta-llama/Llama-3.1-8B does not exist: export takes a Hugging Face model folder "
                              "already downloaded to this PC"), message
    assert "`hf download meta-llama/Llama-3.1-8B --local-dir models/Llama-3.1-8B`" in message
    assert "is not a folder" not in message
    with pytest.raises(ExportError, match=r"does not exist: .*`hf download ORG/MODEL --local-dir models/MODEL`"):
        export_checkpoint(tmp_path / "gone", tmp_path / "out", WeightFormat.F32)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ExportError, match=r"config\.json is not a folder: give the Hugging Face checkpoint folder"):
        export_checkpoint(tmp_path / "config.json", tmp_path / "out", WeightFormat.F32)
    (tmp_path / "moved").symlink_to("elsewhere")
    with pytest.raises(ExportError, match=r"moved is a broken link \(to elsewhere\)"):
        export_checkpoint(tmp_path / "moved", tmp_path / "out", WeightFormat.F32)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "moved"]


def test_ctrl_c_during_an_export_says_that_nothing_unfinished_is_left(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # SIGTERM and SIGHUP said "export stopped by SIGTERM; no unfinished export is left behind"; Ctrl-C ended the
    # export (exit 130) without a line, though it cleans up just the same
    checkpoint = checkpoint_factory("review-export-walkthrough", num_hidden_layers=1)

    def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "_save", ctrl_c)
    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
        export_checkpoint(checkpoint, tmp_path / "new" / "out", WeightFormat.F32)
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == [
        "export stopped by Ctrl-C (SIGINT); no unfinished export is left behind"]
    assert list(tmp_path.iterdir()) == []  # nor the folder made above it
