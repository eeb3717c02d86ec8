"""Files that appear whole or not at all: written to a temporary sibling, synced, then renamed."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# Windows refuses to rename onto a file that another process has open (Python opens files without
# FILE_SHARE_DELETE): the agent reading opt_out.json while `deskfleet-agent pause` writes it, `fleet serve` reading
# revoked.json while `fleet remove` writes it, an antivirus scanning the old file. Those reads last milliseconds:
# the rename is tried again for this long before its PermissionError is raised.
REPLACE_RETRY_S = 2.0


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Write `path` whole or not at all, mode 0600 (tempfile's default); the old file stays on failure.

    `durable=False` leaves out the syncs to disk: for a file that only shows what is now (the agent's status for its
    tray), which a power cut may lose. (It still reaches the disk soon: ext4 commits a renamed file's data with its
    journal, every 5 s; status_file.py writes it only when it changed.)

    A symbolic link is written through: its target is replaced, keeping the target's mode, and the link stays
    (the rename replaced the link with a file, and a file an admin had linked to a managed copy, or `--json-out`
    given a link, came apart from it). Anything else that is not a regular file (a FIFO, a device such as
    /dev/null, a folder) is refused with OSError and left as it is: the rename replaced it, and as root even
    /dev/full became a file."""
    if durable:
        write_atomic_together([(path, data)])
        return
    temporary, target = _staged(path, data, durable=False)
    try:
        _replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_atomic_together(files: Sequence[tuple[Path, bytes]]) -> None:
    """Write several files as write_atomic does, each whole: every one is written and synced beside its target
    before the first is renamed into place, so a full disk, a read-only folder or a refused path leaves every old
    file as it was (an agent's join wrote its fleet's CA and certificate in place, then failed on the disk's last
    byte at its membership: the PC kept another fleet's CA and no membership, and no fleet could use it). The
    renames themselves come one after another: only a crash between them parts the files."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in files:
            staged.append(_staged(path, data))
        for temporary, target in staged:
            _replace(temporary, target)
    except BaseException:
        for temporary, _ in staged:
            Path(temporary).unlink(missing_ok=True)
        raise
    for folder in dict.fromkeys(target.parent for _, target in staged):
        sync_folder(folder)


def _staged(path: Path, data: bytes, durable: bool = True) -> tuple[str, Path]:
    """`data` written and synced (unless not `durable`) to a temporary sibling of where `path` is written (see
    write_atomic), with the mode it will have; (the temporary file, its target)."""
    linked = path.is_symlink()
    path = regular_file_target(path)
    mode = stat.S_IMODE(path.stat().st_mode) if linked and path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
            stream.flush()
            if durable:
                os.fsync(stream.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return temporary, path


def regular_file_target(path: Path) -> Path:
    """Where write_atomic writes `path`: the path, or a link's target; OSError naming it when that exists and is
    no regular file (a folder, a FIFO, a device)."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if target.exists() and not target.is_file():
        raise OSError(f"{target} is {_kind(target)}, not a regular file: it is left as it is")
    return target


def cannot_make_file_in(folder: Path) -> str | None:
    """Why no file can be made in `folder` (a read-only disk, no permission, a folder of /proc), or None when one
    can: tried by making one, as os.access says yes to root everywhere."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            return None
    except OSError as error:
        return error.strerror or str(error)


def _kind(path: Path) -> str:
    """What a path that is not a regular file is, in words."""
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "no regular file"


def _replace(source: str, target: Path) -> None:
    """os.replace, tried again on Windows while the target is held open elsewhere (see REPLACE_RETRY_S)."""
    deadline = time.monotonic() + REPLACE_RETRY_S
    delay = 0.005
    while True:
        try:
            os.replace(source, target)
            return
        except PermissionError:
            if sys.platform != "win32" or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def sync_folder(folder: Path) -> None:
    """fsync a folder, so that a rename into it survives a power cut (a confirmed `fleet remove` could come back
    after one: the file's data was synced, the folder entry naming it was not). Not on Windows, whose folders
    cannot be opened for it; a file system that refuses (some network shares) is left as it is."""
    if os.name == "nt":
        return
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
