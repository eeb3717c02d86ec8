"""Every command's --help page says what the command is, and every option what it does: a walk that used the help
alone found no way to spread a model over two PCs (`--policy` had no text), nor how to start the agent."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from deskfleet.agent.cli import build_parser as agent_parser
from deskfleet.controller.cli import build_parser as controller_parser


def _pages(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...],
                                                                                  argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield from _pages(command, (*path, name))


PAGES = [*_pages(controller_parser(), ("deskfleet",)), *_pages(agent_parser(), ("deskfleet-agent",))]


@pytest.mark.parametrize(("path", "parser"), PAGES, ids=[" ".join(path) for path, _ in PAGES])
def test_every_command_page_describes_the_command_and_every_option(path: tuple[str, ...],
                                                                    parser: argparse.ArgumentParser) -> None:
    if len(path) > 1:
        assert parser.description, f"`{' '.join(path)} --help` does not say what the command is"
    silent = [action.option_strings for action in parser._actions
              if action.option_strings and not action.help and "-h" not in action.option_strings]
    assert silent == [], f"`{' '.join(path)} --help`: options without a word of help"


def test_the_help_says_how_to_spread_a_model_and_how_to_run_an_agent() -> None:
    deploy = dict(PAGES)[("deskfleet", "fleet", "deploy")].format_help()
    assert "all_by_speed: every PC whose share shortens the slowest stage" in " ".join(deploy.split())
    agent = " ".join(agent_parser().format_help().split())
    assert "then run it with `deskfleet-agent --headless`" in agent
    steps = " ".join(dict(PAGES)[("deskfleet", "fleet")].format_help().split())
    assert "`fleet init`" in steps and "`deskfleet-agent join -`" in steps and "`fleet deploy --model M`" in steps


@pytest.mark.parametrize("argv", [["fleet", "ls", "-v"], ["-v", "fleet", "ls"], ["fleet", "ls"]])
def test_verbose_is_taken_before_or_after_the_command(argv: list[str]) -> None:
    # `deskfleet fleet ls -v` was "unrecognized arguments: -v"
    assert controller_parser().parse_args(argv).verbose is ("-v" in argv)
    agent_argv = ["pause", *argv[2:]] if argv[0] == "fleet" else ["-v", "pause"]
    assert agent_parser().parse_args(agent_argv).verbose is ("-v" in agent_argv)


@pytest.mark.parametrize("bench", ["parity", "speculative", "streams", "admission", "fleet"])
def test_every_bench_takes_generates_token_limit_option_too(bench: str) -> None:
    # generate says --max-new-tokens, the benches --new-tokens: one copied from the other was refused
    page = dict(PAGES)[("deskfleet", "bench", bench)]
    required = [argument for action in page._actions if action.required and action.option_strings
                for argument in (action.option_strings[0], "m")]
    parser = controller_parser()
    assert parser.parse_args(["bench", bench, *required, "--max-new-tokens", "7"]).new_tokens == 7
    assert parser.parse_args(["bench", bench, *required, "--new-tokens", "9"]).new_tokens == 9
