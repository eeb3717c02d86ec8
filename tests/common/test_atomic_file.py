from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deskfleet.common import atomic_file
from deskfleet.common.atomic_file import write_atomic


def test_writes_whole_and_private(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.json"
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["file.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "file.json"
    target.write_bytes(b"old")

    def broken_fsync(descriptor: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["file.json"]


@pytest.mark.skipif(os.name == "nt", reason="Windows folders cannot be opened to fsync them")
def test_the_folder_is_synced_after_the_rename_so_the_new_name_survives_a_power_cut(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}") if Path("/proc/self/fd").exists() else "?")
        real_fsync(descriptor)

    monkeypatch.setattr(atomic_file.os, "fsync", recording_fsync)
    target = tmp_path / "roster.json"
    write_atomic(target, b"{}")
    assert len(synced) == 2 and synced[-1] in (str(tmp_path), "?")  # the file's data, then the folder's entry


def test_a_write_that_need_not_last_syncs_nothing_and_still_appears_whole(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # the agent's status for its tray is rewritten every few seconds: a sync each time kept a laptop's disk awake
    synced: list[int] = []
    monkeypatch.setattr(atomic_file.os, "fsync", synced.append)
    target = tmp_path / "status.json"
    target.write_bytes(b"old")
    write_atomic(target, b"new", durable=False)
    assert target.read_bytes() == b"new" and synced == []
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]

    def refused(source: str, target: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_file.os, "replace", refused)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, b"newer", durable=False)
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_folder_that_cannot_be_synced_does_not_fail_the_write(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync

    def refuse_folders(descriptor: int) -> None:  # a file system that refuses to sync a folder (some shares)
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(22, "Invalid argument")
        real_fsync(descriptor)

    monkeypatch.setattr(atomic_file.os, "fsync", refuse_folders)
    target = tmp_path / "f.json"
    write_atomic(target, b"x")
    assert target.read_bytes() == b"x"


@pytest.mark.skipif(os.name == "nt", reason="symbolic links and FIFOs as POSIX makes them")
def test_a_link_is_written_through_and_what_is_no_regular_file_is_left_alone(tmp_path: Path) -> None:
    # the rename replaced whatever was at the path: a link to a managed file came apart from it, a FIFO became a file,
    # and as root `bench fleet --json-out /dev/full` made /dev/full a regular file
    target = tmp_path / "real.json"
    target.write_bytes(b"old")
    target.chmod(0o644)  # a managed copy others read
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    write_atomic(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # its mode kept, not tempfile's 0600
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to("made-on-write.json")
    write_atomic(dangling, b"made")
    assert dangling.is_symlink() and (tmp_path / "made-on-write.json").read_bytes() == b"made"
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match=r"fifo\.json is a named pipe \(FIFO\), not a regular file"):
        write_atomic(fifo, b"x")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    with pytest.raises(OSError, match=r"is a folder, not a regular file"):
        write_atomic(tmp_path, b"x")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dangling.json", "fifo.json", "link.json",
                                                                 "made-on-write.json", "real.json"]  # no temp left
