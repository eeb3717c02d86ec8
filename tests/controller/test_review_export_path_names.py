"""Folder names on the way of an export: one that is not UTF-8 (an old archive's Latin-1 name) made the
tokenizer fail, for an output folder only after every layer was converted and with a message that asked
whether the disk was full; such a path is refused before any work, naming it. Non-ASCII UTF-8 names and a
checkpoint folder reached through a symbolic link export as any other."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.model_spec import WeightFormat, load_manifest
from deskfleet.controller.export import exporter
from deskfleet.controller.export.exporter import ExportError, export_checkpoint

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux file names are bytes; others' are text")


@pytest.mark.parametrize("which", ["checkpoint", "output"])
def test_a_path_that_is_not_utf8_is_refused_before_any_work(which: str, checkpoint_factory: Callable[..., Path],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = checkpoint_factory("review-path-names", num_hidden_layers=1)
    latin1 = Path(os.fsdecode(b"mod\xe8le"))  # "modèle" in Latin-1
    checkpoint = tmp_path / latin1 if which == "checkpoint" else source
    if which == "checkpoint":
        shutil.copytree(source, checkpoint)
    out = tmp_path / (latin1 if which == "output" else "out")
    converted: list[str] = []
    convert = exporter._convert
    monkeypatch.setattr(exporter, "_convert", lambda *args: converted.append("ir") or convert(*args))
    with pytest.raises(ExportError, match=rf"the {which} folder .*mod\\udce8le has a name that is not UTF-8"):
        export_checkpoint(checkpoint, out, WeightFormat.F32)
    assert converted == []
    assert sorted(path.name for path in tmp_path.iterdir()) == (
        [os.fsdecode(b"mod\xe8le")] if which == "checkpoint" else [])


def test_non_ascii_names_and_a_linked_checkpoint_folder_export(checkpoint_factory: Callable[..., Path],
                                                               tmp_path: Path) -> None:
    folder = tmp_path / "modèle 模型"
    shutil.copytree(checkpoint_factory("review-path-names", num_hidden_layers=1), folder)
    (tmp_path / "link").symlink_to(folder.name)
    export_checkpoint(tmp_path / "link", tmp_path / "sortie é", WeightFormat.F32)
    assert load_manifest(tmp_path / "sortie é").model_name == "modèle 模型"
