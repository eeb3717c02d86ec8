"""--overwrite replaces an old export, never a file the user put into its folder since; and an export that
appears at its folder is on disk whole."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.model_spec import WeightFormat, load_manifest, verify_files
from deskfleet.controller.export import exporter, output_folder
from deskfleet.controller.export.exporter import ExportError, export_checkpoint
from deskfleet.controller.export.output_folder import FinishedExportKept


@pytest.fixture
def checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("export-output", num_hidden_layers=1)


@pytest.fixture
def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def converting(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export converted IR before refusing the output")

    monkeypatch.setattr(exporter, "_convert", converting)


def old_export_with(tiny_export: Path, out: Path, *extra: str) -> None:
    shutil.copytree(tiny_export, out)
    for name in extra:
        if name.endswith("/"):
            (out / name).mkdir()
            (out / name / "model.xml").write_text("another export, kept in a subfolder")
        else:
            (out / name).write_text("my notes")


@pytest.mark.parametrize("extra", [("notes.txt",), ("optimum/",), ("a", "b", "c", "d", "e", "f", "g")])
def test_an_export_holding_files_of_the_user_is_not_replaced(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, no_conversion: None, extra: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    old_export_with(tiny_export, out, *extra)
    before = sorted(path.name for path in out.iterdir())
    # "holds notes.txt, which are not files ... delete them": one name, one file
    grammar = (r"is not a file its manifest\.json lists: --overwrite would delete it with the old export; move it "
               r"out first" if len(extra) == 1 else
               r"are not files its manifest\.json lists: --overwrite would delete them with the old export; move "
               r"them out first")
    with pytest.raises(ExportError, match=grammar) as raised:
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert extra[0].rstrip("/") in str(raised.value)
    if len(extra) > 5:
        assert "and 2 more" in str(raised.value)
    assert sorted(path.name for path in out.iterdir()) == before
    assert [path.name for path in tmp_path.iterdir()] == ["out"]


def test_a_folder_at_a_name_the_manifest_lists_is_not_replaced(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, no_conversion: None) -> None:
    # a hand-edited manifest.json listing a folder of the user's as one of its files had --overwrite delete it
    out = tmp_path / "out"
    old_export_with(tiny_export, out)
    listed = next(name for name in load_manifest(out).files if name.endswith(".bin"))
    (out / listed).unlink()
    (out / listed).mkdir()
    (out / listed / "thesis.tex").write_text("four years")
    with pytest.raises(ExportError, match=rf"also holds {listed}, which is not a file its manifest\.json lists"):
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert (out / listed / "thesis.tex").read_text() == "four years"


def test_a_file_put_into_the_old_export_during_the_export_keeps_it(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    old_export_with(tiny_export, out)
    save_tokenizer = exporter._save_tokenizer

    def and_user_writes(*args: object, **kwargs: object) -> tuple[str, ...]:
        (out / "notes.txt").write_text("my notes")  # while the export ran
        return save_tokenizer(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(exporter, "_save_tokenizer", and_user_writes)
    with pytest.raises(FinishedExportKept, match=r"notes\.txt"):
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert (out / "notes.txt").read_text() == "my notes"
    assert load_manifest(out).spec.num_layers == 4  # the old export, untouched


def test_a_file_manager_s_litter_does_not_stop_overwrite(checkpoint: Path, tiny_export: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old_export_with(tiny_export, out, "Thumbs.db", ".DS_Store", "desktop.ini")
    export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    verify_files(out, load_manifest(out))
    assert load_manifest(out).spec.num_layers == 1


def test_a_folder_holding_only_a_file_manager_s_litter_is_empty(checkpoint: Path, tmp_path: Path) -> None:
    # the README says they "do not count"; the emptiness check counted them: "holds files but no manifest.json"
    out = tmp_path / "out"
    out.mkdir()
    for name in ("Thumbs.db", ".DS_Store", "desktop.ini"):
        (out / name).write_bytes(b"\0\1")
    export_checkpoint(checkpoint, out, WeightFormat.F32)  # as empty: filled, without --overwrite
    verify_files(out, load_manifest(out))
    assert [path.name for path in tmp_path.iterdir()] == ["out"]


def test_a_folder_named_as_litter_is_not_litter(checkpoint: Path, tmp_path: Path, no_conversion: None) -> None:
    out = tmp_path / "out"
    (out / "desktop.ini").mkdir(parents=True)
    (out / "desktop.ini" / "thesis.tex").write_text("four years")
    with pytest.raises(ExportError, match=r"holds files but no manifest\.json"):
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert (out / "desktop.ini" / "thesis.tex").read_text() == "four years"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names descriptors through /proc")
def test_every_file_is_on_disk_before_the_export_appears(checkpoint: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # A power cut just after the rename must not leave a manifest naming files whose data never reached the disk
    events: list[tuple[str, str]] = []
    fsync, rename = os.fsync, output_folder._rename_no_replace

    def recording_fsync(descriptor: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def recording_rename(source: Path, target: Path) -> None:
        rename(source, target)
        events.append(("rename", str(target)))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(output_folder, "_rename_no_replace", recording_rename)
    out = tmp_path / "out"
    export_checkpoint(checkpoint, out, WeightFormat.F32)
    moved = events.index(("rename", str(out)))
    synced_before = {Path(path).name for kind, path in events[:moved] if kind == "fsync"}
    assert {path.name for path in out.iterdir()} <= synced_before  # manifest.json included
    assert any(Path(path).name.startswith(".out.partial-") for kind, path in events[:moved])  # the folder too
    assert ("fsync", str(tmp_path)) in events[moved:]  # and the rename itself


def test_an_old_export_a_killed_overwrite_set_aside_is_never_deleted_silently(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # `cp -r EXPORT o/.sw.old-99999; deskfleet export ... -o o/sw --overwrite` deleted it without a line (even
    # under -v), though the export before had named it as the user's "to move back or remove"
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    left = tmp_path / ".out.old-99999"  # a PID no process has: the killed export's
    shutil.copytree(tiny_export, left)
    (left / "layer_notes.txt").write_text("what the user kept in it")
    for _ in range(2):  # every export to out names it again, and removes only the old export it moved aside
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
        assert sorted(path.name for path in tmp_path.iterdir()) == [".out.old-99999", "out"]
        assert (left / "layer_notes.txt").read_text() == "what the user kept in it"
        warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert any(f"{left} holds what was at {out} before an export with --overwrite was killed" in text
                   and "left for you to move back or remove" in text for text in warned), warned


def test_an_old_export_is_deleted_under_a_name_of_its_own_and_a_deletion_cut_short_goes_next_time(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # deleted under its .old- name, a deletion cut short (a power cut) left half an export that every later
    # export offered back as "what was at OUT before ... to move back"
    from deskfleet.controller.export import output_folder

    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    deleted: list[str] = []
    rmtree = shutil.rmtree

    def power_cut_mid_delete(path: Path, *args: object, **kwargs: object) -> None:
        deleted.append(Path(path).name)
        (Path(path) / "manifest.json").unlink(missing_ok=True)  # as far as the deletion got

    monkeypatch.setattr(output_folder.shutil, "rmtree", power_cut_mid_delete)
    export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert deleted == [f".out.deleting-{os.getpid()}"]  # renamed before the deletion began
    half = tmp_path / f".out.deleting-{os.getpid()}"
    assert half.is_dir() and not (tmp_path / f".out.old-{os.getpid()}").exists()
    monkeypatch.setattr(output_folder.shutil, "rmtree", rmtree)
    dead = tmp_path / ".out.deleting-99999"  # a PID no process has, as the next run finds it
    half.rename(dead)
    export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


def test_an_old_export_set_aside_under_this_process_s_number_is_in_the_way_before_any_work(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, no_conversion: None) -> None:
    # left by an earlier process of the same PID: moving the old export aside to that name would fail at the end
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    left = tmp_path / f".out.old-{os.getpid()}"
    shutil.copytree(tiny_export, left)
    with pytest.raises(ExportError, match=rf"{left} is in the way \(what was at {out} before an earlier export "
                                          r"with --overwrite was killed\): move it back or remove it"):
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == [left.name, "out"]


@pytest.mark.parametrize(("holds", "says"), [
    ("thesis.txt", r"holds files but no manifest\.json: --overwrite replaces only a deskfleet export or an empty "
                   r"folder; remove it yourself or choose another folder"),
    ("export+notes.txt", r"is an export, but also holds notes\.txt, which is not a file its manifest\.json lists: "
                         r"--overwrite would delete it"),
    ("export", r"already exists; pass --overwrite to replace it"),
])
def test_overwrite_is_advised_only_where_it_would_replace_the_folder(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, no_conversion: None, holds: str, says: str) -> None:
    # "already exists; pass --overwrite to replace it" was said of a folder --overwrite then refused as well
    out = tmp_path / "out"
    if holds.startswith("export"):
        old_export_with(tiny_export, out, *holds.split("+")[1:])
    else:
        out.mkdir()
        if holds:
            (out / holds).write_text("my only copy")
    with pytest.raises(ExportError, match=says) as raised:
        export_checkpoint(checkpoint, out, WeightFormat.F32)
    assert ("pass --overwrite" in str(raised.value)) == (holds == "export")


@pytest.mark.parametrize("litter", [(), ("Thumbs.db", ".DS_Store")])
def test_an_empty_folder_made_for_the_export_is_filled(checkpoint: Path, tmp_path: Path,
                                                       litter: tuple[str, ...]) -> None:
    # `mkdir out` then `export -o out` said "already exists; pass --overwrite to replace it"
    out = tmp_path / "out"
    out.mkdir()
    for name in litter:
        (out / name).write_bytes(b"\0")
    export_checkpoint(checkpoint, out, WeightFormat.F32)
    verify_files(out, load_manifest(out))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]  # no staging or old folder left beside it


def test_an_export_of_a_newer_deskfleet_is_named_as_such_not_as_no_deskfleet_manifest(
        checkpoint: Path, tiny_export: Path, tmp_path: Path, no_conversion: None) -> None:
    # "out/manifest.json is not a deskfleet manifest (the export was made by a newer deskfleet ...)" said both
    import json

    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": manifest["format_version"] + 1}))
    for overwrite in (False, True):
        with pytest.raises(ExportError, match=rf"^{re.escape(str(out))} holds an export made by a newer deskfleet, "
                                              "which this one cannot check for files of yours before deleting it"):
            export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=overwrite)
    assert json.loads((out / "manifest.json").read_text())["format_version"] == manifest["format_version"] + 1


def test_an_output_name_too_long_for_the_folders_beside_it_is_refused_before_any_work(
        checkpoint: Path, tmp_path: Path, no_conversion: None) -> None:
    # a 245-character -o failed with "File name too long" of the hidden .NAME.partial-PID, a name never given
    out = tmp_path / ("m" * 245)
    with pytest.raises(ExportError, match=r"^the output folder's name is too long: the export works beside it in "
                                          r"hidden folders whose names add 21 bytes to it, past the 255 a name may "
                                          r"have; give -o a name of at most 234 bytes$"):
        export_checkpoint(checkpoint, out, WeightFormat.F32)
    assert list(tmp_path.iterdir()) == []
    from deskfleet.controller.export.output_folder import make_staging_folder

    staging = make_staging_folder(tmp_path / ("m" * 234))  # the longest name that fits
    assert staging.is_dir()
