"""Chat messages typed at a terminal, with line editing and history.

Python's readline module (GNU readline, or libedit on macOS) edits the line as it is typed: the arrow keys move in
it and recall the messages sent before, Ctrl-A / Ctrl-E go to its start and end. Before, chat read the terminal as
a plain stream, and an arrow key's escape codes went to the model as part of the message. History is kept for
the chat only, never written to a file: messages may hold what an employee would not want left on disk.

Several lines make one message two ways: a line that ends with a backslash goes on on the next (the prompt
becomes `...> `), and a paste of several lines is one message with GNU readline 8.1 or later, whose bracketed paste
is turned on here (CPython turns it off), on a terminal that brackets pastes (most do). Tab inserts a tab, for code,
instead of completing file names. History holds the lines as typed: a message of several lines is recalled a line
at a time.

Only where standard input and output are both a terminal: input() uses readline only then. Windows has no
readline module; its console edits a line itself.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)

PROMPT = "you> "
CONTINUATION_PROMPT = "...> "


class TerminalLines:
    """A `readline()` source of messages over input(), which shows the prompt itself: readline must know the
    prompt to redraw the line as it is edited, so the chat does not write it."""

    def __init__(self, prompt: str = PROMPT, continuation: str = CONTINUATION_PROMPT) -> None:
        self.prompt = prompt
        self.continuation = continuation

    def readline(self) -> str:
        """The next message with a line ending, as a stream's readline() gives a line; "" at Ctrl-D on an empty
        line (the end of input). A line that ends with one backslash goes on on the next line; a Ctrl-D there
        sends what was typed."""
        parts: list[str] = []
        prompt = self.prompt
        while True:
            try:
                line = input(prompt)
            except EOFError:
                return "\n".join(parts) + "\n" if parts else ""
            if line.endswith("\\") and not line.endswith("\\\\"):
                parts.append(line[:-1])
                prompt = self.continuation
                continue
            parts.append(line)
            return "\n".join(parts) + "\n"


def terminal_lines(stdin_is_tty: bool, stdout_is_tty: bool) -> TerminalLines | None:
    """Messages read with line editing where standard input and output are both a terminal and the readline
    module loads; None otherwise (read the stream as it is)."""
    if not (stdin_is_tty and stdout_is_tty):
        return None
    try:
        readline = importlib.import_module("readline")
    except ImportError:  # Windows, or a Python built without it
        return None
    _bind(readline)
    return TerminalLines()


def _bind(readline: ModuleType) -> None:
    """Bind Tab to insert a tab (indented code) instead of completing file names, in GNU readline's syntax or
    libedit's; with GNU readline, turn bracketed paste back on: CPython (3.10 and later) turns it off as its readline
    module loads, and a paste of 20 lines went out as 20 messages (a pasted `/quit` line left the chat)."""
    libedit = getattr(readline, "backend", None) == "editline" or "libedit" in (readline.__doc__ or "")
    bindings = ["bind ^I ed-insert"] if libedit else ["tab: tab-insert", "set enable-bracketed-paste on"]
    for binding in bindings:
        try:
            readline.parse_and_bind(binding)
        except Exception:  # an unknown binding leaves readline as it was: said at debug, the chat works without it
            log.debug("readline refused %r", binding, exc_info=True)
