"""Advisory locks on a file's first byte, the same on Linux, macOS and Windows (pure: no deskfleet state)."""

from __future__ import annotations

import sys

if sys.platform == "win32":
    import msvcrt

    def lock_file(descriptor: int) -> None:
        """Wait for the lock."""
        msvcrt.locking(descriptor, msvcrt.LK_LOCK, 1)

    def try_lock_file(descriptor: int) -> bool:
        """Take the lock if nobody holds it; False when another process does."""
        try:
            msvcrt.locking(descriptor, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

    def unlock_file(descriptor: int) -> None:
        msvcrt.locking(descriptor, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def lock_file(descriptor: int) -> None:
        """Wait for the lock."""
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
