"""The shared argparse types: an empty path is refused (Path("") would be the current folder)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deskfleet.common.arguments import path_argument


def test_a_path_is_taken_as_given_and_an_empty_one_is_refused() -> None:
    assert path_argument("out/demo") == Path("out/demo") and path_argument(".") == Path(".")
    for empty in ("", "  "):
        with pytest.raises(argparse.ArgumentTypeError, match=r"is empty \(an unset variable\?\)"):
            path_argument(empty)
