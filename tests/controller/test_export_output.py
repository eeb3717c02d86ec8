"""Export's output folder: what "-o" may name, and that nothing the user had there is lost."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.model_spec import WeightFormat, load_manifest, verify_files
from deskfleet.controller.export import exporter
from deskfleet.controller.export.exporter import ExportError, export_checkpoint


@pytest.fixture
def checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("export-output", num_hidden_layers=1)


@pytest.fixture
def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the export starts converting IR: the refusal must come before that work."""
    def converting(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export converted IR before refusing the output")

    monkeypatch.setattr(exporter, "_convert", converting)


def names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_the_working_directory_as_output(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "-o ." has no name of its own: the export must still land in the folder it names
    out = tmp_path / "exp"
    out.mkdir()
    monkeypatch.chdir(out)
    export_checkpoint(checkpoint, Path("."), WeightFormat.F32, overwrite=True)
    verify_files(out, load_manifest(out))
    assert names(tmp_path) == ["exp"]  # no staging or old folder left beside it
    # the old folder was swapped out from under the working directory, as a shell in it would see
    with pytest.raises(ExportError, match="the working directory no longer exists"):
        export_checkpoint(checkpoint, Path("."), WeightFormat.F32)
    monkeypatch.chdir(out)
    with pytest.raises(ExportError, match=f"{out} already exists; pass --overwrite"):
        export_checkpoint(checkpoint, Path("."), WeightFormat.F32)


def test_a_symbolic_link_as_output_is_refused(checkpoint: Path, tmp_path: Path, tiny_export: Path,
                                              no_conversion: None) -> None:
    # e.g. models/current -> v1: --overwrite would put a folder where the link was and leave v1 as it was
    shutil.copytree(tiny_export, tmp_path / "v1")
    (tmp_path / "current").symlink_to("v1")
    (tmp_path / "dangling").symlink_to("nowhere")
    for link in ("current", "dangling"):
        for overwrite in (True, False):
            with pytest.raises(ExportError, match=rf"{link} is a symbolic link \(to (v1|nowhere)\)"):
                export_checkpoint(checkpoint, tmp_path / link, WeightFormat.F32, overwrite=overwrite)
    assert names(tmp_path) == ["current", "dangling", "v1"]
    assert (tmp_path / "current").readlink() == Path("v1") and names(tmp_path / "v1") == names(tiny_export)
