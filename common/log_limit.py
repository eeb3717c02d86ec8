"""Rate-limited log lines: a line that many peers repeat (a host reopening refused joins, PCs not upgraded yet
retrying every 30 s) is a warning once a while for each of them, and a debug line between; and a library's record
made one line (as_one_line), where its traceback told nothing an admin acts on.

Pure code, its clock injectable for tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

MAX_KEYS = 4096  # keys remembered at once; past this all are forgotten (peers that came once are not kept for good)


class LogEvery:
    """Whether a key's line is due as a warning: the first time, and once `interval_s` has passed since the last."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        self.clock = clock
        self.max_keys = max_keys
        self._said: dict[Hashable, float] = {}  # key -> when its line was last due

    def due(self, key: Hashable, interval_s: float) -> bool:
        """True (and remembered) when `key`'s line has not been due within `interval_s`."""
        now = self.clock()
        last = self._said.get(key)
        if last is not None and now - last < interval_s:
            return False
        if last is None and len(self._said) >= self.max_keys:
            self._said.clear()
        self._said[key] = now
        return True


def as_one_line(record: logging.LogRecord, added: str, max_level: int) -> None:
    """`record` (a logging filter's) as one line, its message then `added`, with no traceback, at `max_level` at most
    (a lower level stays)."""
    record.msg, record.args = f"{record.getMessage()}: {added}", ()
    record.exc_info = record.exc_text = None
    record.levelno = min(record.levelno, max_level)
    record.levelname = logging.getLevelName(record.levelno)
