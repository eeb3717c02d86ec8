"""Advisory locks on a file's first byte, the same on Linux, macOS and Windows (pure: no deskfleet state).

Windows locks the byte at the file's current position: every call here seeks to 0 first, so that a holder
that wrote into the file (a pid after the first byte) and a newcomer lock the same byte.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

if sys.platform == "win32":
    import msvcrt

    def lock_file(descriptor: int) -> None:
        """Wait for the lock (as long as it takes, as flock does: LK_LOCK alone gives up after 10 tries a second
        apart, with OSError EDEADLOCK "Resource deadlock avoided", which a store command showed as a traceback)."""
        while True:
            os.lseek(descriptor, 0, os.SEEK_SET)
            try:
                msvcrt.locking(descriptor, msvcrt.LK_LOCK, 1)
            except OSError as error:
                if error.errno != errno.EDEADLOCK:
                    raise
                continue
            return

    def try_lock_file(descriptor: int) -> bool:
        """Take the lock if nobody holds it; False when another process does."""
        os.lseek(descriptor, 0, os.SEEK_SET)
        try:
            msvcrt.locking(descriptor, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

    def unlock_file(descriptor: int) -> None:
        os.lseek(descriptor, 0, os.SEEK_SET)
        msvcrt.locking(descriptor, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def lock_file(descriptor: int) -> None:
        """Wait for the lock."""
        os.lseek(descriptor, 0, os.SEEK_SET)  # flock ignores the position; kept alike for the Windows branch
        fcntl.flock(descriptor, fcntl.LOCK_EX)

    def try_lock_file(descriptor: int) -> bool:
        """Take the lock if nobody holds it; False when another process does."""
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock_file(descriptor: int) -> None:
        fcntl.flock(descriptor, fcntl.LOCK_UN)


@contextlib.contextmanager
def pid_lock(path: Path, refusal: Callable[[str, str], Exception], holder: str = "") -> Iterator[None]:
    """Hold the lock on `path`'s first byte while the block runs, this process's pid and `holder` (what holds it:
    "fleet serve", "join"; one line, no secret) written after it for the next comer's message; raise
    refusal(the holder's pid or "unknown", what holds it or "") at once when another process holds it. One agent
    per data dir, one `fleet serve` or deploy per controller data dir.

    A lock file that cannot be opened (created on a full disk, say) is named in the OSError; a pid that cannot
    be written into it (the disk is full) is left out, logged: the lock holds all the same, and the next comer
    is told "unknown" for the pid (it used to stop the agent, with an OSError naming no file)."""
    if path.is_symlink():  # the pid would be written through it, over whatever file it names (as its user: root)
        raise OSError(f"the lock file {path} is a symbolic link (to {os.readlink(path)}): remove it")
    try:
        # not through a link made meanwhile either; unbuffered: nothing is left to write (and fail) at close
        handle = open(path, "a+b", buffering=0, opener=_not_through_a_link)
    except OSError as error:
        # its errno kept: the command's error line adds the way out (common/os_error_text.py)
        raise OSError(error.errno, f"cannot open the lock file {path}: {error.strerror or error}") from None
    with handle:
        if not try_lock_file(handle.fileno()):
            raise refusal(*lock_holder(handle))
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"\n{os.getpid()} {holder}".rstrip().encode("utf-8"))
        except OSError as error:
            log.warning("cannot write this process's id into %s (%s): the lock holds without it", path,
                        error.strerror or error)
        try:
            yield
        finally:
            unlock_file(handle.fileno())


def _not_through_a_link(path: str, flags: int) -> int:
    """os.open for open(): a link at `path` is refused (ELOOP) where the platform can tell (O_NOFOLLOW)."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o600)


HOLDER_WAIT_S = 0.2  # how long a refused comer waits for a holder that has the lock to write who it is


def lock_holder(handle: BinaryIO) -> tuple[str, str]:
    """(the pid, what holds it) a lock holder wrote after the locked first byte; ("unknown", "") where it wrote
    nothing. A holder that took the lock an instant ago writes a moment later: the file is read again for
    HOLDER_WAIT_S (four `fleet serve` started at once: one was told "pid unknown")."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            handle.seek(1)
            text = handle.read().decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        if text or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    pid, _, what = text.partition(" ")
    return pid or "unknown", what
