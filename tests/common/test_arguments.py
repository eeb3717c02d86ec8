"""The shared argparse types: an empty path is refused (Path("") would be the current folder); an mDNS browse
is 0 to 600 seconds; a prompts file of `-` is standard input, and only that spelling."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deskfleet.common.arguments import (
    MAX_BROWSE_S,
    STDIN_PATH,
    browse_seconds,
    line_of_text,
    option_text,
    path_argument,
    program_argument,
    prompts_file_argument,
    seconds_up_to,
    unknown_options,
)


def test_a_path_is_taken_as_given_and_an_empty_one_is_refused() -> None:
    assert path_argument("out/demo") == Path("out/demo") and path_argument(".") == Path(".")
    for empty in ("", "  "):
        with pytest.raises(argparse.ArgumentTypeError, match=r"is empty \(an unset variable\?\)"):
            path_argument(empty)


def test_a_program_with_a_folder_part_is_that_file_and_a_name_alone_is_looked_up(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Path("./python3") is Path("python3"): `--genai-python ./python3` ran the first python3 on PATH instead
    monkeypatch.chdir(tmp_path)
    assert program_argument("./python3") == tmp_path / "python3"
    assert program_argument("venv/bin/python") == tmp_path / "venv/bin/python"
    assert program_argument("/usr/bin/python3") == Path("/usr/bin/python3")
    assert program_argument("python3") == Path("python3")  # for a lookup on PATH, as a shell does
    with pytest.raises(argparse.ArgumentTypeError, match="is empty"):
        program_argument("")


def test_a_browse_is_0_to_600_seconds_and_nothing_else() -> None:
    assert browse_seconds("0") == 0.0 and browse_seconds("1.5") == 1.5 and browse_seconds("600") == MAX_BROWSE_S
    for bad, why in (("-1", "must be 0 to 600 seconds"), ("601", "must be 0 to 600"), ("nan", "must be 0 to 600"),
                     ("inf", "must be 0 to 600"), ("2s", "expected a number of seconds, got '2s'")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            browse_seconds(bad)


def test_seconds_up_to_a_bound_take_that_bound_and_name_it() -> None:
    day = seconds_up_to(86400)
    assert day("0") == 0.0 and day("86400") == 86400.0 and day("2.5") == 2.5
    with pytest.raises(argparse.ArgumentTypeError, match="must be 0 to 86400 seconds, got 86401"):
        day("86401")


def test_only_a_bare_dash_is_standard_input_as_a_prompts_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert str(prompts_file_argument("-")) == STDIN_PATH
    for spelling in ("./-", "-/", "./-/"):  # pathlib reads each as "-": the file of that name, made absolute
        assert prompts_file_argument(spelling) == tmp_path / "-"
    assert prompts_file_argument("prompts.txt") == Path("prompts.txt")
    with pytest.raises(argparse.ArgumentTypeError, match="is empty"):
        prompts_file_argument("")


KNOWN = {"-v": False, "--verbose": False, "-h": False, "--data-dir": True, "-o": True}


@pytest.mark.parametrize(("arguments", "unknown"), [
    (["--data_dir", "D", "join"], ["--data_dir"]),
    (["-vv", "--verbose", "join", "--bogus"], []),  # a cluster of flags; the scan ends at the command
    (["-vx"], ["-vx"]), (["-o", "--x"], []),  # -o takes the next argument, whatever it looks like
    (["--data-dir=--x", "--y"], ["--y"]), (["-", "--", "--after"], []),  # `-` is standard input; -- ends options
    (["-vo"], ["-vo"]),  # a letter that takes a value is no flag of a cluster
])
def test_unknown_options_are_named_as_argparse_would_take_the_rest(arguments: list[str], unknown: list[str]) -> None:
    assert unknown_options(arguments, KNOWN, {"join"}) == unknown


def test_dash_dash_is_an_options_value_given_with_equals() -> None:
    # Python 3.11's argparse removed it from every action's values: the option got [] (a TypeError deep in the
    # command, or "the prompt is empty" for the prompt `--`)
    from deskfleet.common.arguments import KeepsDashDashValues

    parser = KeepsDashDashValues(prog="p")
    parser.add_argument("--prompt", action="append")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--stops", nargs="*")
    parser.add_argument("words", nargs="*")
    parsed = parser.parse_args(["--prompt=--", "--prompt", "x", "--model=--", "--stops=--", "a", "--", "-z"])
    assert parsed.prompt == ["--", "x"] and parsed.model == Path("--") and parsed.stops == ["--"]
    assert parsed.words == ["a", "-z"]  # a positional's `--` still ends the options
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "--"])  # `--` after the option leaves it no value: argparse says so


def test_both_command_lines_take_dash_dash_as_a_value() -> None:
    from deskfleet.agent.cli import AgentParser
    from deskfleet.common.arguments import KeepsDashDashValues
    from deskfleet.controller.cli import CommandParser

    assert issubclass(CommandParser, KeepsDashDashValues) and issubclass(AgentParser, KeepsDashDashValues)


def test_an_option_a_user_is_told_to_run_is_quoted_for_their_shell() -> None:
    assert option_text("--data-dir", "/srv/fleet", windows=False) == "--data-dir /srv/fleet"
    assert option_text("--data-dir", "/srv/odd/with space é", windows=False) == "--data-dir '/srv/odd/with space é'"
    assert option_text("--data-dir", "it's", windows=False) == """--data-dir 'it'"'"'s'"""
    assert option_text("--data-dir", "-dash", windows=False) == "--data-dir=-dash"
    assert option_text("--data-dir", r"C:\Users\John Smith", windows=True) == r'--data-dir "C:\Users\John Smith"'
    assert option_text("--data-dir", r"D:\fleet", windows=True) == r"--data-dir D:\fleet"


@pytest.mark.parametrize(("text", "said"), [(" ", "blank words"), ("\udcff", "not UTF-8 text"),
                                            ("a\nb", "a control character")])
def test_a_line_of_text_a_user_gives_is_one_line_of_utf8(text: str, said: str) -> None:
    # `fleet init --name $'\xff'` and `join --hostname $'\xff'` said "'utf-8' codec can't encode character",
    # naming no option; a newline went into the CA's name
    with pytest.raises(argparse.ArgumentTypeError, match=said):
        line_of_text(text, "blank words")
    assert line_of_text("Ann's PC, 3rd floor", "blank") == "Ann's PC, 3rd floor"
