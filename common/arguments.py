"""argparse types shared by the deskfleet and deskfleet-agent command lines."""

from __future__ import annotations

import argparse
from pathlib import Path


def path_argument(text: str) -> Path:
    """argparse type: a path, refused when empty. Path("") is the current folder, so an unset variable (`-o "$OUT"`)
    made `export` write over whatever export the current folder held, and `--model ""` read it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give a path; . names the current folder")
    return Path(text)
