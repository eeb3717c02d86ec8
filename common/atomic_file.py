"""Files that appear whole or not at all: written to a temporary sibling, synced, then renamed."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

# Windows refuses to rename onto a file that another process has open (Python opens files without
# FILE_SHARE_DELETE): the agent reading opt_out.json while `deskfleet-agent pause` writes it, `fleet serve` reading
# revoked.json while `fleet remove` writes it, an antivirus scanning the old file. Those reads last milliseconds:
# the rename is tried again for this long before its PermissionError is raised.
REPLACE_RETRY_S = 2.0


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, mode 0600 (tempfile's default); the old file stays on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        _replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


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
