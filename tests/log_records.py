"""A logger's own records, for tests: a handler on that logger, not caplog's on the root logger.

Some earlier test of the full suite leaves caplog's root handler receiving nothing from deskfleet's loggers
(the warning is given, caplog sees none: fresh-clone CI runs, never a run of the file alone), so a test that
asserts on a log line collects it at the logger that writes it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@contextlib.contextmanager
def records_of(name: str, level: int = logging.INFO) -> Iterator[Records]:
    """The records of logger `name` (and its children) at `level` and above while the block runs."""
    logger = logging.getLogger(name)
    handler = Records()
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
