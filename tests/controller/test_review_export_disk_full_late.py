"""A disk that fills up after the IRs are written (the tokenizer, the copied config files, the manifest, the
fsync before the rename) ended `deskfleet export` with a traceback (tokenizers' bare Exception, OSError); like a
full disk during the IRs, it is one line naming what could not be written and the room left."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deskfleet.controller.cli import main
from deskfleet.controller.export import exporter

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_disk_at(place: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if place == "tokenizer":
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        def save_pretrained(self: Any, *args: object, **kwargs: object) -> None:
            raise Exception("No space left on device (os error 28)")  # what tokenizers raises

        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", save_pretrained)
    elif place == "config.json":
        copyfile = shutil.copyfile

        def full_copyfile(source: Any, target: Any, **kwargs: Any) -> Any:
            if Path(target).name == "config.json":
                raise ENOSPC
            return copyfile(source, target, **kwargs)

        monkeypatch.setattr(exporter.shutil, "copyfile", full_copyfile)
    elif place == "manifest.json":
        write_text = Path.write_text

        def full_write_text(self: Path, *args: Any, **kwargs: Any) -> int:
            if self.name == "manifest.json":
                raise ENOSPC
            return write_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", full_write_text)
    else:
        def full_flush(folder: Path) -> None:
            raise ENOSPC  # ext4/XFS allocate a file's blocks at writeback: fsync is where ENOSPC can come

        monkeypatch.setattr(exporter, "flush_to_disk", full_flush)


@pytest.mark.parametrize(("place", "named"), [("tokenizer", "the tokenizer files"), ("config.json", "config.json"),
                                              ("manifest.json", "manifest.json"), ("fsync", "the files")])
def test_a_disk_full_after_the_irs_names_what_was_not_written(
        place: str, named: str, checkpoint_factory: Callable[..., Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = checkpoint_factory("review-disk-full-late", num_hidden_layers=1)
    out = tmp_path / "out"
    out.mkdir()
    fill_disk_at(place, monkeypatch)
    capsys.readouterr()
    assert main(["export", str(checkpoint), "-o", str(out / "model"), "--weights", "f32"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"deskfleet: error: cannot write {named} of the export: ")
    assert "No space left on device" in error and f"free in {out}; is the disk full?" in error
    assert list(out.iterdir()) == []  # the unfinished export is removed
