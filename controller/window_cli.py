"""`deskfleet window`'s arguments, and its start (the window itself, Qt, loads only when it runs)."""

from __future__ import annotations

import argparse
import math

from deskfleet.common.arguments import line_of_text, path_argument, real_number

from .chat_client import DEFAULT_URL, ReplySettings
from .decoding_options import MAX_TEMPERATURE, non_negative_int, positive_int


def add_window_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    window = subparsers.add_parser(
        "window", help="a chat window on a `deskfleet serve` (local stages or the fleet)",
        description="A chat window for the office's users: it talks to a `deskfleet serve` (on this PC or the "
                    "controller's) through its OpenAI-compatible API; the reply streams in as the model makes it. "
                    "Enter sends, Shift+Enter starts a new line; Stop ends a reply, New conversation starts over.")
    window.add_argument("--url", default=DEFAULT_URL,
                        help=f"the API's root (default {DEFAULT_URL}, the default of `deskfleet serve` on this PC)")
    window.add_argument("--api-key-file", type=path_argument, default=None, metavar="FILE",
                        help="a file holding the server's API key on its first line (default: $DESKFLEET_API_KEY, else "
                             "none)")
    window.add_argument("--ca-file", type=path_argument, default=None, metavar="FILE",
                        help="for an https:// server whose certificate the system does not trust: the certificate (or "
                             "its CA's) to trust")
    window.add_argument("--model", type=_line, default=None,
                        help="the model to chat with, as the server names it (default: the first it serves)")
    window.add_argument("--system", type=_line, default=None, help="a system message that begins the conversation")
    window.add_argument("--max-tokens", type=positive_int, default=ReplySettings().max_tokens,
                        help="the longest a reply may be, in tokens (default %(default)s, as `deskfleet chat`'s)")
    window.add_argument("--temperature", type=_temperature, default=0.7,
                        help="sampling temperature (0: greedy; default 0.7)")
    window.add_argument("--seed", type=non_negative_int, default=None,
                        help="sampling seed, for replies that can be had again")
    window.set_defaults(handler=_window_command)


def _window_command(args: argparse.Namespace) -> int:
    from .chat_client import ChatClient
    from .chat_window import WindowOptions, run_window
    from .serve_cli import read_api_key

    client = ChatClient(args.url, read_api_key(args.api_key_file), args.ca_file)  # ValueError: exit 2, said
    settings = ReplySettings(args.max_tokens, args.temperature, args.seed)
    return run_window(client, WindowOptions(args.model, args.system, settings))


def _line(text: str) -> str:
    return line_of_text(text, "is empty or blank (an unset variable?)")


def _temperature(text: str) -> float:
    value = real_number(text)
    if not (math.isfinite(value) and 0 <= value <= MAX_TEMPERATURE):
        raise argparse.ArgumentTypeError(f"must be from 0 (greedy) to {MAX_TEMPERATURE:g}")
    return value
