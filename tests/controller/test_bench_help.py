"""Every bench's --help gives each option's default: a user reproducing a README figure must match them."""

from __future__ import annotations

import argparse
import re

import pytest

from deskfleet.controller import cli


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    commands = next(action for action in cli.build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    bench = commands.choices["bench"]
    benches = next(action for action in bench._actions if isinstance(action, argparse._SubParsersAction))
    return dict(benches.choices)


@pytest.mark.parametrize("name", sorted(_bench_parsers()))
def test_every_option_with_a_default_shows_it(name: str) -> None:
    parser = _bench_parsers()[name]
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or action.default in (None, [], ()) \
                or action.default is argparse.SUPPRESS:
            continue
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        entry = re.sub(r"\s+", " ", formatter.format_help())  # this option's own entry only
        shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
        said = (f"(default {shown})" in entry or f"{shown} (the default)" in entry  # the formatter's / in words
                or re.search(rf"\b{re.escape(shown)}: [^;]*\(default\)", entry) is not None)  # a choice's own text
        assert said, f"bench {name} {action.option_strings[0]}: its default {shown} is not in its --help: {entry}"


def test_flags_and_options_without_a_default_say_none() -> None:
    text = re.sub(r"\s+", " ", _bench_parsers()["fleet"].format_help())
    assert "(default True)" not in text and "(default False)" not in text and "(default )" not in text
    assert "(default 2 4 6)" in re.sub(r"\s+", " ", _bench_parsers()["speculative"].format_help())
