"""Standard streams that cannot fail on a character their encoding lacks, a closed standard error, a
standard output that cannot take what was written to it, and lines a Ctrl-C cannot cut."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO, cast


def tolerate_unencodable(*streams: TextIO) -> None:
    """Write what each stream's encoding cannot carry as a backslash escape (`\\U0001f642`) instead of raising
    UnicodeEncodeError.

    Python writes standard output in the locale's encoding when it is a file or a pipe, strictly: on Windows
    that is the ANSI code page (cp1252, cp932 in Japan), where an emoji, or a Japanese hostname on cp1252,
    raised in the middle of a reply or a table. Standard error already escapes (Python's default there);
    a stream that chose other error handling keeps it, and one that cannot be reconfigured is left alone.
    """
    for stream in streams:
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


def open_missing_stderr() -> None:
    """Give a process started with standard error closed (`2>&-`) one that discards what is written to it.

    Python then sets sys.stderr to None, and `print(..., file=sys.stderr)` writes to standard OUTPUT: notes and
    progress lines went into the JSON a script reads, and code that wrote to sys.stderr itself (chat's notes)
    raised AttributeError. Whoever closed it asked for no diagnostics: the exit status still tells.
    """
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # for the rest of the process


class ForgivingStream:
    """Standard error for a command: a write or flush it cannot make (a full disk, `2>/dev/full`, a log file on a
    share that went away) is dropped, not raised. A note or a progress line that failed so turned a finished run
    into exit 1 (`generate`'s closing line), and ended a scripted chat after its first reply (the note that a reply
    was cut); whoever sent standard error where it cannot be written gets what a closed one gives (see
    open_missing_stderr): the result, and the exit status. Everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def forgiving_stderr() -> Iterator[None]:
    """sys.stderr as a ForgivingStream for the block (after open_missing_stderr and tolerate_unencodable), then
    as it was."""
    original = sys.stderr
    if original is None or isinstance(original, ForgivingStream):
        yield
        return
    forgiving = ForgivingStream(original)
    sys.stderr = cast(TextIO, forgiving)
    try:
        yield
    finally:
        if sys.stderr is forgiving:
            sys.stderr = original


class WatchedStream:
    """A text stream that remembers the last OSError its write or flush raised (and raises it on), so that a
    command's error handler can tell "standard output refused the result" (a full disk, `> /dev/full`) from
    any other OSError: a failed write leaves nothing behind to test afterwards (the buffer is dropped, and a
    later flush succeeds). Everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as error:
            self.failure = error
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as error:
            self.failure = error
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def watched_stdout() -> Iterator[WatchedStream | None]:
    """sys.stdout as a WatchedStream for the block (None when standard output is closed), then as it was."""
    original = sys.stdout
    if original is None or isinstance(original, WatchedStream):
        yield cast(WatchedStream | None, original)
        return
    watched = WatchedStream(original)
    sys.stdout = cast(TextIO, watched)
    try:
        yield watched
    finally:
        if sys.stdout is watched:
            sys.stdout = original


def flush_stdout() -> None:
    """Flush standard output now, where a command's error handling still runs: a short result written to a
    file sits in its buffer, and a full disk then failed only at the interpreter's exit ("Exception ignored
    ... OSError: No space left on device", exit status 120) after sys.stdout was put back."""
    if sys.stdout is not None:
        sys.stdout.flush()


def silence_stdout() -> None:
    """Point standard output at the null device, so that Python's flush at exit does not fail on it again (a
    closed pipe, a full disk) and print a second error."""
    try:
        descriptor = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (io.UnsupportedOperation is both), or None
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def stopping_signals() -> list[int]:
    """The signals a long-running service (the agent, `fleet serve`) stops cleanly on: SIGINT, SIGTERM, and SIGHUP
    where there is one and its handling is the default (a terminal or SSH session that closes sends it, which
    ended the process on the spot); under nohup, which sets SIGHUP to be ignored, the service keeps running."""
    signals: list[int] = [signal.SIGINT, signal.SIGTERM]
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is signal.SIG_DFL:
        signals.append(hangup)
    return signals


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives during the block until the block is done, then deliver it to whatever
    handles SIGINT outside the block (Python's own raises KeyboardInterrupt there). A second Ctrl-C is delivered
    at once: a print stuck on a reader that stopped reading (`| less` paused) can still be stopped.

    For output that must come out whole: a report printed after a run (minutes of a benchmark, or the streams a
    first Ctrl-C stopped) was cut mid-line by a Ctrl-C during the print, and a script reading the JSON got
    half an object. Off the main thread (where Python runs no signal handler), or where SIGINT's handler was
    not set from Python (it could not be put back), the block runs as it is. (The benches, whose SIGTERM and
    SIGHUP unwind too, hold all three with bench/interruption.signals_held.)
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, frame: object) -> None:
        arrived.append(signum)
        if len(arrived) > 1:  # asked twice: now
            signal.signal(signal.SIGINT, outside)
            signal.raise_signal(signal.SIGINT)

    outside = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, outside)
            if arrived:
                signal.raise_signal(signal.SIGINT)


def print_whole(text: str, file: TextIO | None = None) -> None:
    """print(text, flush=True), as one line a Ctrl-C cannot cut (see ctrl_c_held)."""
    with ctrl_c_held():
        print(text, file=file, flush=True)
