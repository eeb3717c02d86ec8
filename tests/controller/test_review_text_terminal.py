"""What a model writes reaches a terminal as text: its control characters are shown, not obeyed; and the
chat's history holds the reply as it was shown."""

from __future__ import annotations

import io
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest

from deskfleet.controller import chat, run
from deskfleet.controller.chat import ChatOptions, run_chat
from deskfleet.controller.engine import StreamRequest, StreamResult
from deskfleet.controller.export.random_checkpoint import CHAT_TEMPLATE
from deskfleet.controller.run import GenerateOptions, run_generate
from deskfleet.controller.text_printer import TextPrinter, visible_controls
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

HOSTILE = "ok \x1b[2J\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07 \x9b31m red\rhidden\x08\x7f\tend\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _model(tmp_path: Path, tiny_export: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return model


def test_visible_controls_keeps_text_newlines_and_tabs() -> None:
    assert visible_controls("a\tb\nc é 🙂 \u200d") == "a\tb\nc é 🙂 \u200d"
    shown = visible_controls(HOSTILE)
    assert not any((ord(c) < 32 and c not in "\t\n") or 0x7f <= ord(c) <= 0x9f for c in shown)
    assert shown.startswith("ok \\x1b[2J\\x1b]0;owned\\x07")


def test_a_printer_on_a_terminal_shows_control_characters(tiny_export: Path) -> None:
    tokenizer = ModelTokenizer(tiny_export)
    ids = tokenizer.encode(HOSTILE, add_special_tokens=False)
    for out, expected in ((Terminal(), visible_controls(HOSTILE)), (io.StringIO(), HOSTILE)):  # a pipe: as is
        printer = TextPrinter(tokenizer, out)
        for token in ids:
            printer.push(0, token)
        printer.finish()
        assert out.getvalue() == expected
        assert printer.text == tokenizer.decode(ids) == HOSTILE


class ScriptedEngine:
    """Engine's face to run_chat and run_generate: each stream gets the next of `replies`; a reply may stop
    at `ctrl_c_after` tokens shown with one more token taken (a Ctrl-C between taking and showing it)."""

    replies: ClassVar[list[list[int]]] = []
    ctrl_c_after: ClassVar[int | None] = None
    prompts: ClassVar[list[list[int]]] = []

    def __init__(self, chain: Any, *args: Any) -> None:
        self.chain = chain
        self.failovers: list[Any] = []
        self.streams: list[tuple[StreamRequest, list[int]]] = []

    def add(self, request: StreamRequest) -> int:
        ScriptedEngine.prompts.append(list(request.prompt_ids))
        self.streams.append((request, []))
        return len(self.streams) - 1

    def run(self, on_token: Callable[[int, int], None] | None = None, recover: Any = None) -> dict[int, StreamResult]:
        for stream_id, (_, tokens) in enumerate(self.streams):
            for index, token in enumerate(ScriptedEngine.replies.pop(0)):
                tokens.append(token)
                if index == ScriptedEngine.ctrl_c_after:
                    ScriptedEngine.ctrl_c_after = None
                    raise KeyboardInterrupt
                if on_token is not None:
                    on_token(stream_id, token)
        return self.results()

    def kept_kv(self, stream_id: int) -> None:
        return None  # keeps no KV state: every turn is fed whole

    def results(self) -> dict[int, StreamResult]:
        return {index: StreamResult(index, list(tokens), len(request.prompt_ids), 0.0, 0.0, False)
                for index, (request, tokens) in enumerate(self.streams)}


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> type[ScriptedEngine]:
    @contextmanager
    def no_chain(options: ChatOptions, settings: Any) -> Iterator[tuple[object, None]]:
        yield object(), None

    ScriptedEngine.replies, ScriptedEngine.prompts, ScriptedEngine.ctrl_c_after = [], [], None
    monkeypatch.setattr(chat, "Engine", ScriptedEngine)
    monkeypatch.setattr(chat, "_open_chain", no_chain)
    return ScriptedEngine


def test_a_chat_reply_on_a_terminal_shows_its_escapes_and_keeps_its_text(
        tmp_path: Path, tiny_export: Path, scripted: type[ScriptedEngine]) -> None:
    model = _model(tmp_path, tiny_export)
    tokenizer = ModelTokenizer(model)
    scripted.replies = [tokenizer.encode(HOSTILE, add_special_tokens=False), tokenizer.encode("fine")]
    out = Terminal()
    assert run_chat(ChatOptions(model=model, max_new_tokens=200), io.StringIO("hi\nagain\n"), out,
                    notes=io.StringIO()) == 2
    assert out.getvalue() == f"{visible_controls(HOSTILE)}\nfine\n"
    # the model's own text (not its shown form) goes back to it in the history
    history = [ChatMessage("user", "hi"), ChatMessage("assistant", HOSTILE), ChatMessage("user", "again")]
    assert scripted.prompts[1] == tokenizer.encode_chat(history)


def test_a_note_on_a_terminal_shows_the_templates_escapes(tmp_path: Path, tiny_export: Path,
                                                          scripted: type[ScriptedEngine]) -> None:
    model = _model(tmp_path, tiny_export)
    (model / "chat_template.jinja").write_text(
        "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('no\x1b]0;owned\x07') }}{% endif %}"
        + CHAT_TEMPLATE)
    notes = Terminal()
    assert run_chat(ChatOptions(model=model, max_new_tokens=2), io.StringIO("boom\n"), io.StringIO(),
                    notes=notes) == 0
    assert notes.getvalue() == ("[the chat template refused the conversation: no\\x1b]0;owned\\x07: not sent; the "
                                "conversation is unchanged]\n")


def test_a_reply_stopped_by_ctrl_c_stays_in_the_history_as_it_was_shown(
        tmp_path: Path, tiny_export: Path, scripted: type[ScriptedEngine]) -> None:
    # Ctrl-C between the engine taking a token and the printer showing it: the token is in the engine's
    # results, not on the screen. The conversation holds what the user saw.
    model = _model(tmp_path, tiny_export)
    tokenizer = ModelTokenizer(model)
    scripted.replies = [tokenizer.encode("shown, then NOT SHOWN", add_special_tokens=False), tokenizer.encode("x")]
    scripted.ctrl_c_after = len("shown,")
    out = io.StringIO()
    assert run_chat(ChatOptions(model=model, max_new_tokens=200), io.StringIO("hi\nagain\n"), out,
                    notes=io.StringIO()) == 2
    assert out.getvalue() == "shown,\nx\n"
    history = [ChatMessage("user", "hi"), ChatMessage("assistant", "shown,"), ChatMessage("user", "again")]
    assert scripted.prompts[1] == tokenizer.encode_chat(history)


def test_generate_on_a_terminal_shows_each_streams_escapes(tiny_export: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = ModelTokenizer(tiny_export)
    ScriptedEngine.replies = [tokenizer.encode(HOSTILE, add_special_tokens=False)] * 3
    ScriptedEngine.ctrl_c_after = None
    monkeypatch.setattr(run, "Engine", ScriptedEngine)
    monkeypatch.setattr(sys, "stdout", Terminal())
    one = run_generate(GenerateOptions(model=tiny_export, prompts=["a"], max_new_tokens=200), stream_text=True)
    assert sys.stdout.getvalue() == visible_controls(HOSTILE)
    assert one["text"] == HOSTILE  # --json gives the text itself
    monkeypatch.setattr(sys, "stdout", Terminal())
    run_generate(GenerateOptions(model=tiny_export, prompts=["a", "b"], max_new_tokens=200), stream_text=True)
    assert sys.stdout.getvalue() == "".join(f"--- --prompt #{i}\n{visible_controls(HOSTILE)}\n" for i in (1, 2))
