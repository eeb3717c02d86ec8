"""Standard streams that cannot fail on a character their encoding lacks."""

from __future__ import annotations

import io
from typing import TextIO


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
