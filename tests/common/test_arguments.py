"""The shared argparse types: an empty path is refused (Path("") would be the current folder); an mDNS browse
is 0 to 600 seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deskfleet.common.arguments import MAX_BROWSE_S, browse_seconds, path_argument


def test_a_path_is_taken_as_given_and_an_empty_one_is_refused() -> None:
    assert path_argument("out/demo") == Path("out/demo") and path_argument(".") == Path(".")
    for empty in ("", "  "):
        with pytest.raises(argparse.ArgumentTypeError, match=r"is empty \(an unset variable\?\)"):
            path_argument(empty)


def test_a_browse_is_0_to_600_seconds_and_nothing_else() -> None:
    assert browse_seconds("0") == 0.0 and browse_seconds("1.5") == 1.5 and browse_seconds("600") == MAX_BROWSE_S
    for bad, why in (("-1", "must be 0 to 600 seconds"), ("601", "must be 0 to 600"), ("nan", "must be 0 to 600"),
                     ("inf", "must be 0 to 600"), ("2s", "expected a number of seconds, got '2s'")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            browse_seconds(bad)
