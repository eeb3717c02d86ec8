"""What keeps this PC's shard cache from taking files, for the agent's status until it has passed.

A deploy that the cache's disk refused (full, read-only, no permission) fails naming the PC and the fix, but only
that deploy's user saw it: the admin's `deskfleet fleet ls` listed the PC as available with nothing to say, and
every later plan chose it again. The agent now adds a note to its status detail, which `fleet ls` prints beside
the PC and `fleet plan` beside a PC it leaves out; the note goes once the disk has room for what was refused (or
can be written again), checked at each status, and once a write into the cache goes through.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

from deskfleet.agent.shard_cache import ShardCache, disk_space

# errno values that mean the cache's folder cannot be written at all (as opposed to full)
UNWRITABLE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def disk_free_bytes(folder: Path) -> int:
    """Bytes the disk under `folder` has free for this process (as the shard cache reads its disk)."""
    return disk_space(folder)[1]


class CacheHealth:
    """The cache's disk trouble since the last write that went through. `free_bytes` is injectable for tests."""

    def __init__(self, cache: ShardCache, free_bytes: Callable[[Path], int] = disk_free_bytes) -> None:
        self._cache = cache
        self._free_bytes = free_bytes
        self._needed_bytes: int | None = None  # what a write the full disk refused needed; None: none refused
        self._unwritable = cache.unwritable() is not None  # a read-only cache is noted from the start

    def refused(self, error: OSError, needed_bytes: int) -> None:
        """A write into the cache failed with `error`, wanting `needed_bytes` more on its disk (the rest of the
        shard being received, or a stage's files: what one write needed, not the whole deploy, so a note that
        went may come back at the deploy's next shard)."""
        if error.errno == errno.ENOSPC:
            self._needed_bytes = max(needed_bytes, self._needed_bytes or 0, 1)
        elif error.errno in UNWRITABLE_ERRNOS:
            self._unwritable = True

    def stored(self) -> None:
        """A write into the cache went through: whatever was refused before has passed."""
        self._needed_bytes = None
        self._unwritable = False

    def note(self) -> str:
        """The trouble in words for the status detail, "" when there is none (any more)."""
        root = self._cache.root
        if self._unwritable:
            why = self._cache.unwritable()
            if why is not None:
                return f"shard cache {root} not writable ({why}): it takes no new stage"
            self._unwritable = False
        if self._needed_bytes is not None:
            try:
                free = self._free_bytes(root)
            except OSError as error:
                return f"shard cache disk full at the last deploy, and its free space is unknown ({error})"
            if free >= self._needed_bytes:
                self._needed_bytes = None
            else:
                return (f"shard cache disk full: {_gb(free)} free at {root}, a shard being received needed "
                        f"{_gb(self._needed_bytes)} more (free space there, or lower cache_limit_bytes)")
        return ""


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 10_000_000 else f"{size / 1e6:.2f} MB"
