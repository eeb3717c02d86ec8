"""argparse types shared by the deskfleet and deskfleet-agent command lines."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import Any

MAX_BROWSE_S = 600.0  # the longest mDNS browse a --discover-seconds asks for
FAILOVER_BROWSE_S = 1.0  # a re-plan's mDNS browse for the PCs left, unless --discover-seconds says otherwise


class KeepsDashDashValues(argparse.ArgumentParser):
    """An ArgumentParser that takes `--` as the value of an option given with `=` (`--prompt=--`, an SQL comment).
    Python 3.11's argparse removes a `--` from every action's values, and an option then got an empty list for its
    value: `--model=--` raised a TypeError with a traceback instead of naming the folder, `--prompt=--` was said to
    be empty. Only an option can receive `--` that way (`--prompt --` leaves it no value, which argparse names), so
    positionals keep argparse's handling."""

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        if action.option_strings and action.nargs not in (argparse.PARSER, argparse.REMAINDER) \
                and "--" in arg_strings:
            arg_strings = ["--", *arg_strings]  # the one argparse removes
        return super()._get_values(action, arg_strings)


def whole_number(text: str) -> int:
    """argparse type: int(text), written as a user types a number: ASCII, no `_` (ValueError otherwise)."""
    return int(_typed_number(text))


def real_number(text: str) -> float:
    """argparse type: float(text), written as a user types a number: ASCII, no `_` (ValueError otherwise)."""
    return float(_typed_number(text))


def _typed_number(text: str) -> str:
    """`text`, where it holds no character a number is not typed with. Python's int and float take other scripts'
    digits and a `_` between digits: `--seed ١` ran with seed 1, `--top-p 1_0` with 10.0, `--ttl ١d` a day."""
    if not text.isascii() or "_" in text:
        raise ValueError(f"{text!r} is not a number written with the digits 0-9")
    return text


def option_text(option: str, value: str, windows: bool | None = None) -> str:
    """`option value` as a user can paste it into their shell (a command an error or a result tells them to run):
    quoted where the value holds a space or a shell's special character, as cmd and PowerShell (`windows`) or a
    POSIX shell take it, and joined with `=` where the value starts with a dash, which argparse would read as an
    option (it said "`deskfleet fleet serve --data-dir /srv/with space`", split in two by the shell). `windows`:
    this process's platform where None."""
    if windows if windows is not None else sys.platform == "win32":
        import subprocess  # list2cmdline: the quoting Windows programs' argument parsing undoes

        quoted = subprocess.list2cmdline([value])
    else:
        import shlex

        quoted = shlex.quote(value)
    return f"{option}={quoted}" if value.startswith("-") else f"{option} {quoted}"


def line_of_text(text: str, blank: str) -> str:
    """`text`, checked as an argparse type checks one line a user gives for people or clients to read; `blank` the
    error's words for an empty or blank one (an unset variable). Refused too: bytes that are not UTF-8 (they became
    an error naming no option, or a model id no JSON request could carry), and a control character (a line break
    went into a CA's name)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(blank)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{text!r:.60} holds bytes that are not UTF-8 text") from None
    if not text.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r:.60} holds a control character (a line break?): give one line")
    return text


def path_argument(text: str) -> Path:
    """argparse type: a path, refused when empty. Path("") is the current folder, so an unset variable (`-o "$OUT"`)
    made `export` write over whatever export the current folder held, and `--model ""` read it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give a path; . names the current folder")
    return Path(text)


def program_argument(text: str) -> Path:
    """argparse type: a program, as a shell takes one: a name alone is looked up on PATH, and one with a folder part
    (`./python3`, `venv/bin/python`) is that file, made absolute. Path("./python3") is Path("python3"), which a
    lookup on PATH then found elsewhere: `--genai-python ./python3` ran the first python3 on PATH without a word."""
    path = path_argument(text)
    named_alone = os.sep not in text and (os.altsep is None or os.altsep not in text)
    return path if named_alone else path.absolute()


def option_arity(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Every option string of `parser` itself (not its commands'), and whether it takes a value."""
    return {option: action.nargs != 0 for action in parser._actions for option in action.option_strings}


def unknown_options(arguments: Sequence[str], known: Mapping[str, bool],
                    commands: Container[str] = frozenset()) -> list[str]:
    """The options among `arguments` that `known` (option -> whether it takes a value) does not hold, up to `--` or
    the first of `commands`. The value after a known option that takes one is skipped (`--hostname --x`: a missing
    value, which argparse names); a cluster of short flags (`-vv`) is known where each of its letters is a flag;
    `-` alone (standard input) is no option."""
    unknown: list[str] = []
    value_next = False
    for argument in arguments:
        if value_next:
            value_next = False
            continue
        if argument == "--" or argument in commands:
            break
        if not argument.startswith("-") or argument == "-":
            continue
        name = argument.split("=", 1)[0]
        if name in known:
            value_next = known[name] and "=" not in argument
        elif argument.startswith("--") or not all(known.get(f"-{letter}") is False for letter in argument[1:]):
            unknown.append(argument)
    return unknown


STDIN_PATH = "-"  # a prompts file of this name is standard input (`... | deskfleet generate --prompts-file -`)


def prompts_file_argument(text: str) -> Path:
    """argparse type of a prompts file: `-` is standard input; `./-` (or `-/`), which pathlib reads as `-` too, is
    the file of that name in the working folder, made absolute so that it stays one."""
    path = path_argument(text)
    return path if text == STDIN_PATH or str(path) != STDIN_PATH else Path.cwd() / STDIN_PATH


def seconds_up_to(maximum: float) -> Callable[[str], float]:
    """argparse type: a number of seconds, 0 to `maximum` (NaN, infinity, negatives refused)."""
    def parse(text: str) -> float:
        try:
            value = real_number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not 0 <= value <= maximum:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"must be 0 to {maximum:.0f} seconds, got {text}")
        return value

    return parse


# argparse type: how long to browse mDNS
browse_seconds = seconds_up_to(MAX_BROWSE_S)


def verbose_anywhere(parser: argparse.ArgumentParser) -> None:
    """Let each command of `parser` take its -v/--verbose too (`deskfleet fleet ls -v` was "unrecognized
    arguments: -v": only `deskfleet -v fleet ls` took it). Not given there, the one before the command stands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                if "--verbose" not in command._option_string_actions:
                    command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                         help="debug logging and full tracebacks")
                verbose_anywhere(command)


def describe_commands(parser: argparse.ArgumentParser) -> None:
    """Give each command's own --help page the line that describes it in its parent's list, where it has no
    description of its own (every page began with its usage and options alone)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            said = {choice.dest: choice.help for choice in action._choices_actions}
            for name, command in action.choices.items():
                if not command.description and said.get(name):
                    text = str(said[name])
                    command.description = f"{text[0].upper()}{text[1:]}."
                describe_commands(command)
