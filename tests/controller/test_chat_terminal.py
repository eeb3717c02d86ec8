"""`deskfleet chat` at a terminal edits the line as it is typed and recalls earlier messages (readline): an arrow
key's escape codes went to the model as part of the message. Several lines make one message with a backslash at a
line's end."""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deskfleet.controller.terminal_lines import CONTINUATION_PROMPT, PROMPT, TerminalLines, terminal_lines


def _typed(monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> list[str]:
    """Feed input() `lines` (then Ctrl-D); returns the prompts it was shown."""
    prompts: list[str] = []
    left = iter(lines)

    def typed(prompt: str = "") -> str:
        prompts.append(prompt)
        try:
            return next(left)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", typed)
    return prompts


def test_a_line_is_a_message_with_its_line_ending_and_ctrl_d_ends_the_input(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _typed(monkeypatch, ["    return x", ""])
    lines = TerminalLines()
    assert lines.readline() == "    return x\n"  # as typed, indentation kept
    assert lines.readline() == "\n"  # an empty line: the chat skips it
    assert lines.readline() == ""  # Ctrl-D: the end, as a stream's
    assert prompts == [PROMPT] * 3


def test_a_backslash_at_a_lines_end_goes_on_on_the_next_line(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _typed(monkeypatch, ["def f(x):\\", "    return x\\", "", "a path C:\\\\", "half\\"])
    lines = TerminalLines()
    assert lines.readline() == "def f(x):\n    return x\n\n"
    assert prompts == [PROMPT, CONTINUATION_PROMPT, CONTINUATION_PROMPT]
    assert lines.readline() == "a path C:\\\\\n"  # two backslashes: sent as typed, no continuation
    assert lines.readline() == "half\n"  # Ctrl-D in a continuation sends what was typed
    assert lines.readline() == ""


def test_only_a_terminal_at_both_ends_is_edited() -> None:
    assert terminal_lines(stdin_is_tty=True, stdout_is_tty=False) is None  # input() would not use readline
    assert terminal_lines(stdin_is_tty=False, stdout_is_tty=True) is None
    assert isinstance(terminal_lines(stdin_is_tty=True, stdout_is_tty=True), TerminalLines)


def _take_the_terminal() -> None:
    """Make standard input, the pseudo-terminal, the new session's controlling terminal: its Ctrl-C then sends
    SIGINT to the chat, as a real terminal's does."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class _Terminal:
    """`deskfleet chat` on a pseudo-terminal: what it writes, and keys typed at it."""

    def __init__(self, argv: list[str]) -> None:
        import pty

        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from deskfleet.controller.cli import main; sys.exit(main())", *argv],
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True, preexec_fn=_take_the_terminal,
            env={**os.environ, "TERM": "xterm", "INPUTRC": "/dev/null"})
        os.close(slave)
        self.seen = b""

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait_for(self, text: bytes, times: int = 1, timeout: float = 120) -> None:
        import select

        deadline = time.monotonic() + timeout
        while self.seen.count(text) < times:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} x{times} not shown within {timeout} s; the terminal shows {self.seen[-600:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:  # the chat ended: the terminal's other end closed
                    assert self.seen.count(text) >= times, f"ended, showing {self.seen[-600:]!r}"

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        os.close(self.master)


@pytest.fixture
def terminal(tiny_export: Path) -> Iterator[_Terminal]:
    chat = _Terminal(["chat", "--model", str(tiny_export), "--max-new-tokens", "2", "--precision", "f32"])
    yield chat
    chat.close()


def test_the_arrow_keys_edit_the_line_and_recall_the_message_before(terminal: _Terminal) -> None:
    terminal.wait_for(PROMPT.encode())
    terminal.type(b"/rst\x1b[D\x1b[De\r")  # "/rst", two steps left, an "e" between "r" and "st"
    terminal.wait_for(b"/rest is no command")  # the edited line: with the arrows' codes in it, it went to the model
    terminal.type(b"\x1b[A\r")  # up: the message before, again
    terminal.wait_for(b"/rest is no command", times=2)
    terminal.wait_for(PROMPT.encode(), times=3)
    terminal.type(b"\x04")  # Ctrl-D at an empty line leaves
    assert terminal.process.wait(timeout=60) == 0


def test_a_message_of_several_lines_is_one_message(terminal: _Terminal) -> None:
    terminal.wait_for(PROMPT.encode())
    terminal.type(b"/reset\\\r")  # continued: no longer a command on its own line
    terminal.wait_for(CONTINUATION_PROMPT.encode())
    terminal.type(b"/quit\r")  # "/reset\n/quit" is one message, sent to the model: the chat goes on
    terminal.wait_for(PROMPT.encode(), times=2)
    terminal.type(b"/quit\r")
    assert terminal.process.wait(timeout=60) == 0


def test_a_bracketed_paste_of_several_lines_is_one_message(terminal: _Terminal) -> None:
    # CPython turns readline's bracketed paste off: a paste of 20 lines went out as 20 messages, and a pasted
    # "/quit" line left the chat
    terminal.wait_for(PROMPT.encode())
    assert b"\x1b[?2004h" in terminal.seen  # the terminal is asked to bracket pastes
    terminal.type(b"\x1b[200~/reset\r/quit\x1b[201~\r")  # one message of two lines: no command
    terminal.wait_for(PROMPT.encode(), times=2)
    terminal.type(b"/quit\r")
    assert terminal.process.wait(timeout=60) == 0


def test_ctrl_c_at_the_edited_prompt_leaves_the_chat(terminal: _Terminal) -> None:
    terminal.wait_for(PROMPT.encode())
    terminal.type(b"half a mess")
    time.sleep(0.5)  # echoed by readline, not sent
    terminal.type(b"\x03")  # the terminal sends SIGINT to the chat
    assert terminal.process.wait(timeout=60) == 130
