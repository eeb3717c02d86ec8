"""`generate` and `chat` stopped by SIGTERM (kill, systemd, a CI runner's cancel) or SIGHUP (a closed terminal):
they unwind as on Ctrl-C (the chain's micro-batches freed and its links closed, what the streams made kept), say
so, and exit 143 / 129. Python's default ended the process on the spot (exit -15), the streamed line cut and, over
the fleet, the agents left to notice a dropped connection. A Ctrl-C keeps its meaning: in `chat` it stops a reply,
and the chat goes on."""

from __future__ import annotations

import errno
import io
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deskfleet.common.wire import ForwardResult
from deskfleet.controller import chat, cli
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.text_printer import TextPrinter
from tests.controller.test_chat import _chat_model


@pytest.fixture(autouse=True)
def default_handlers() -> Iterator[None]:
    """SIGTERM and SIGHUP as Python leaves them (the commands unwind only where they are): under nohup, SIGHUP is
    ignored, and the SIGHUP cases would test nothing."""
    before = {signum: signal.signal(signum, signal.SIG_DFL) for signum in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


class HungUp(io.StringIO):
    """A terminal that hung up: every write fails as a tty's does after SIGHUP (EIO)."""

    def write(self, text: str) -> int:
        raise OSError(errno.EIO, "Input/output error")


def _signal_at_token(monkeypatch: pytest.MonkeyPatch, signum: int, at: int) -> None:
    """The process receives `signum` as the `at`-th streamed token is printed."""
    push = TextPrinter.push
    pushed = [0]

    def push_then_signal(self: TextPrinter, stream_id: int, token: int) -> None:
        push(self, stream_id, token)
        pushed[0] += 1
        if pushed[0] == at:
            signal.raise_signal(signum)

    monkeypatch.setattr(TextPrinter, "push", push_then_signal)


def _signal_at_step(monkeypatch: pytest.MonkeyPatch, signum: int, at: int) -> None:
    """The process receives `signum` as the `at`-th step's result is collected."""
    collect = LocalPipeline.collect
    collected = [0]

    def collect_then_signal(self: LocalPipeline, timeout: float | None = None) -> ForwardResult:
        result = collect(self, timeout)
        collected[0] += 1
        if collected[0] == at:
            signal.raise_signal(signum)
        return result

    monkeypatch.setattr(LocalPipeline, "collect", collect_then_signal)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_generate_stopped_by_sigterm_or_sighup_unwinds_and_keeps_what_it_made(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], signum: int,
        status: int) -> None:
    _signal_at_step(monkeypatch, signum, at=4)
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,9", "--max-new-tokens", "50", "--ignore-eos",
            "--json"]
    assert cli.main(argv) == status
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the report of the tokens so far, whole
    assert report["stopped"] == "interrupted" and 3 <= report["generated_tokens"] < 50
    assert captured.err.rstrip().endswith(f"deskfleet: stopped by {signal.Signals(signum).name} (0 of 1 stream(s) had "
                                          f"finished; {report['generated_tokens']} tokens in all, in the JSON on "
                                          "standard output)")
    assert signal.getsignal(signum) is signal.SIG_DFL  # put back as it was


def test_a_hung_up_terminal_does_not_turn_the_sighup_into_an_error(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _signal_at_step(monkeypatch, signal.SIGHUP, at=4)
    monkeypatch.setattr(sys, "stderr", HungUp())
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,9", "--max-new-tokens", "50", "--ignore-eos",
            "--json"]
    assert cli.main(argv) == 129  # was an OSError (EIO) from the stop line, exit 1


def test_generate_stopped_before_its_streams_began_says_so(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    open_stage = LocalPipeline.__init__

    def compiled_then_sigterm(self: LocalPipeline, *args: Any, **kwargs: Any) -> None:
        open_stage(self, *args, **kwargs)
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(LocalPipeline, "__init__", compiled_then_sigterm)
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,9", "--max-new-tokens", "5", "--json"]
    assert cli.main(argv) == 143
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "deskfleet: stopped by SIGTERM\n"


def test_generate_streaming_its_text_ends_the_line_and_says_what_stopped_it(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _signal_at_step(monkeypatch, signal.SIGTERM, at=4)
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,9", "--max-new-tokens", "50", "--ignore-eos"]
    assert cli.main(argv) == 143
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and captured.err == "deskfleet: stopped by SIGTERM\n"


def test_chat_ends_on_sigterm_mid_reply_where_ctrl_c_stops_only_the_reply(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model = _chat_model(tmp_path, tiny_export)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand again\n"))
    _signal_at_token(monkeypatch, signal.SIGINT, at=2)  # Ctrl-C: the first reply stops, the second is answered
    assert cli.main(["chat", "--model", str(model), "--max-new-tokens", "6", "--precision", "f32", "--json"]) == 0
    answered = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["stopped"] for line in answered] == ["interrupted", "max_new_tokens"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand again\n"))
    _signal_at_token(monkeypatch, signal.SIGTERM, at=2)
    assert cli.main(["chat", "--model", str(model), "--max-new-tokens", "6", "--precision", "f32", "--json"]) == 143
    captured = capsys.readouterr()
    # ended in its first reply, which is written out as stopped; the second message is never answered
    (reply,) = map(json.loads, captured.out.splitlines())
    assert reply["stopped"] == "interrupted" and reply["reply_tokens"] >= 2
    assert captured.err.endswith("deskfleet: chat stopped by SIGTERM\n")


def test_chat_stopped_mid_reply_ends_the_replys_line(tmp_path: Path, tiny_export: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = _chat_model(tmp_path, tiny_export)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand again\n"))
    _signal_at_token(monkeypatch, signal.SIGHUP, at=2)
    assert cli.main(["chat", "--model", str(model), "--max-new-tokens", "6", "--precision", "f32"]) == 129
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and captured.out.count("\n") == 1
    assert captured.err.endswith("deskfleet: chat stopped by SIGHUP\n")


def test_chat_stopped_while_the_prompt_is_made_tells_a_script_its_message_was_not_sent(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # under --json a message read but stopped before its reply began had no line: a script could not tell
    model = _chat_model(tmp_path, tiny_export)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    fit_prompt = chat._fit_prompt

    def fit_then_sigterm(*args: Any, **kwargs: Any) -> Any:
        signal.raise_signal(signal.SIGTERM)  # raised here, inside the message's preparation
        return fit_prompt(*args, **kwargs)

    monkeypatch.setattr(chat, "_fit_prompt", fit_then_sigterm)
    assert cli.main(["chat", "--model", str(model), "--max-new-tokens", "4", "--json"]) == 143
    captured = capsys.readouterr()
    assert [json.loads(line) for line in captured.out.splitlines()] == [
        {"error": "stopped by SIGTERM before the reply began: not sent"}]
    assert captured.err.endswith("deskfleet: chat stopped by SIGTERM\n")
