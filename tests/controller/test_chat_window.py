"""The chat window (`deskfleet window`): its conversation (no Qt), its client against a real `serve` API on the tiny
model, and the window itself on Qt's offscreen platform, driven as a user would: type, Enter, Stop, New."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QKeyEvent, QTextCursor
from PySide6.QtWidgets import QApplication

from deskfleet.controller.chat_client import ChatClient, ChatClientError, ReplySettings
from deskfleet.controller.chat_window import ChatWindow, WindowOptions
from deskfleet.controller.conversation import Conversation
from deskfleet.controller.engine_service import EngineService
from tests.ports import free_port

from .test_openai_api import MODEL, post, serving, slow

GREEDY = ReplySettings(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def app() -> Iterator[QApplication]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # no display here: Qt's xcb plugin would abort the process
    existing = QApplication.instance()
    yield existing if isinstance(existing, QApplication) else QApplication([])


@pytest.fixture(scope="module")
def served(tiny_export: Path) -> Iterator[tuple[str, EngineService]]:
    with serving(tiny_export) as server:
        yield server


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        QApplication.processEvents()
        time.sleep(0.01)


def whole_reply(url: str, messages: list[dict[str, str]], max_tokens: int = 12) -> str:
    status, body = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                       "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])


# The conversation

def test_a_finished_reply_joins_the_conversation_and_notes_are_never_sent() -> None:
    conversation = Conversation("Be brief.")
    assert conversation.ask("hello") == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "hello"}]
    conversation.add("hi ")
    conversation.add("there")
    conversation.finished("length")
    assert [turn.role for turn in conversation.turns] == ["user", "assistant", "note"]
    assert conversation.ask("again")[1:] == [{"role": "user", "content": "hello"},
                                             {"role": "assistant", "content": "hi there"},
                                             {"role": "user", "content": "again"}]


def test_a_failed_or_unstarted_reply_leaves_the_conversation_as_it_was() -> None:
    conversation = Conversation()
    conversation.ask("first")
    assert conversation.failed("the server's reply failed: a PC went") == "first"
    conversation.ask("second")
    conversation.finished(None)  # stopped before any text
    assert [turn.role for turn in conversation.turns] == ["note", "note"]
    assert conversation.ask("third") == [{"role": "user", "content": "third"}]
    conversation.add("part")
    conversation.finished(None)  # stopped midway: what came stays, as in `deskfleet chat`
    assert [(turn.role, turn.text) for turn in conversation.turns[-3:-1]] == [("user", "third"),
                                                                             ("assistant", "part")]


def test_the_transcript_shows_text_as_typed_never_as_markup() -> None:
    conversation = Conversation()
    conversation.ask("<script>alert(1)</script>\n    indented & more")
    text = conversation.html()
    assert "<script>" not in text and "&lt;script&gt;" in text and "    indented &amp; more" in text
    assert "\u258d" in text  # the reply coming in


# The client, against a real API

def test_the_client_streams_the_reply_the_api_gives_whole(served: tuple[str, EngineService]) -> None:
    url, _ = served
    client = ChatClient(f"{url}/v1")
    assert client.models() == [MODEL]
    messages = [{"role": "user", "content": "Say something."}]
    stream = client.open_reply(MODEL, messages, GREEDY)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == whole_reply(url, messages)
    assert stream.end is not None and stream.end.finish_reason in ("stop", "length")
    assert stream.end.completion_tokens is not None and stream.end.completion_tokens > 0


def test_the_client_names_what_went_wrong(served: tuple[str, EngineService], tiny_export: Path) -> None:
    url, _ = served
    with pytest.raises(ChatClientError, match=r"/v1/chat/completions answered 404: .*'nope'"):
        ChatClient(f"{url}/v1").open_reply("nope", [{"role": "user", "content": "x"}], GREEDY)
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ChatClientError, match=f"nothing answers at {nobody} \\(connection refused\\): start "):
        ChatClient(nobody).models()
    with serving(tiny_export, api_key="sesame") as (keyed, _):
        with pytest.raises(ChatClientError, match=r"wants an API key .*: give the window the server's --api-key-file"):
            ChatClient(f"{keyed}/v1").models()
        assert ChatClient(f"{keyed}/v1", api_key="sesame").models() == [MODEL]
    for bad in ("ftp://host/v1", "localhost:8000", "http://host:99999/v1"):
        with pytest.raises(ValueError):
            ChatClient(bad)


def test_a_cancelled_reply_ends_at_once_and_the_server_stops_making_it(tiny_export: Path) -> None:
    with serving(tiny_export, opener=slow(tiny_export)) as (url, service):
        stream = ChatClient(f"{url}/v1").open_reply(MODEL, [{"role": "user", "content": "go on"}],
                                                    ReplySettings(max_tokens=400, temperature=0.0))
        pieces = iter(stream)
        assert next(pieces)
        stream.cancel()
        assert len(list(pieces)) <= 2  # what was in flight
        assert stream.end is not None and stream.end.finish_reason is None
        deadline = time.monotonic() + 30
        while service.live_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.live_streams == 0 and service.streams_cancelled == 1


# The window

def press_enter(window: ChatWindow, modifiers: Qt.KeyboardModifier = Qt.KeyboardModifier.NoModifier) -> None:
    QApplication.sendEvent(window.input, QKeyEvent(QEvent.Type.KeyPress, Qt.Key.Key_Return, modifiers))


def test_the_window_sends_on_enter_and_shows_the_reply_as_it_comes(app: QApplication,
                                                                    served: tuple[str, EngineService]) -> None:
    url, _ = served
    window = ChatWindow(ChatClient(f"{url}/v1"), WindowOptions(settings=GREEDY))
    wait_for("the model's name", lambda: window.model == MODEL)
    assert window.server.text() == f"{MODEL} at {url}/v1"
    window.input.setPlainText("Say something.")
    window.input.moveCursor(QTextCursor.MoveOperation.End)
    press_enter(window, Qt.KeyboardModifier.ShiftModifier)  # a new line, not a send
    assert not window.conversation.replying and window.input.toPlainText() == "Say something.\n"
    window.input.setPlainText("Say something.")
    press_enter(window)
    assert window.conversation.replying and window.send.text() == "Stop" and window.input.toPlainText() == ""
    wait_for("the reply", lambda: not window.conversation.replying)
    expected = whole_reply(url, [{"role": "user", "content": "Say something."}])
    assert [(turn.role, turn.text) for turn in window.conversation.turns[:2]] == [("user", "Say something."),
                                                                                 ("assistant", expected)]
    assert expected.strip().splitlines()[0] in window.transcript.toPlainText()
    assert window.send.text() == "Send" and window.new.isEnabled()
    window.new.click()
    assert window.conversation.turns == [] and window.transcript.toPlainText().strip() == ""


def test_a_long_reply_keeps_pythons_none_alive(app: QApplication) -> None:
    # PySide6 6.12.0 dropped a reference to None at each Qt call returning nothing (see pyproject.toml): each piece
    # of a reply redraws the transcript, and a long chat aborted Python 3.11 ("deallocating None")
    window = ChatWindow(ChatClient(f"http://127.0.0.1:{free_port()}/v1"), WindowOptions())
    window.conversation.ask("hello")
    window._reply_number = 1
    gc.collect()
    before = sys.getrefcount(None)
    for _ in range(300):
        window._piece(1, "word ")
    window._ended(1, "length")
    gc.collect()  # what cycles hold is not what Qt lost
    assert abs(sys.getrefcount(None) - before) < 100, "Qt calls are losing references to None"


def test_stop_keeps_what_came_and_a_dead_server_gives_the_message_back(app: QApplication, tiny_export: Path) -> None:
    with serving(tiny_export, opener=slow(tiny_export)) as (url, service):
        window = ChatWindow(ChatClient(f"{url}/v1"), WindowOptions(settings=ReplySettings(400, 0.0)))
        wait_for("the model's name", lambda: window.model == MODEL)
        window.input.setPlainText("go on")
        window.send.click()
        wait_for("the reply's first text", lambda: bool(window.conversation.reply))
        window.send.click()  # Stop
        wait_for("the reply to end", lambda: not window.conversation.replying)
        roles = [turn.role for turn in window.conversation.turns]
        assert roles == ["user", "assistant", "note"] and window.conversation.turns[1].text
        assert window.conversation.turns[2].text.startswith("Stopped: the reply so far stays")
        wait_for("the server to drop the stream", lambda: service.live_streams == 0, timeout=30)
        assert service.streams_cancelled == 1
    # the server is gone now: the next message fails, and is given back to send again
    window.input.setPlainText("are you there?")
    window.send.click()
    wait_for("the failure", lambda: not window.conversation.replying)
    assert window.input.toPlainText() == "are you there?"
    assert window.conversation.turns[-1].role == "note" and "Not sent" in window.conversation.turns[-1].text
    assert json.dumps([turn.role for turn in window.conversation.turns]) == '["user", "assistant", "note", "note"]'


def test_a_window_on_nothing_says_so_and_asks_again_on_send(app: QApplication) -> None:
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    window = ChatWindow(ChatClient(nobody), WindowOptions())
    wait_for("the failure", lambda: "Send asks again" in window.server.text())
    assert window.server.text().startswith(f"nothing answers at {nobody} (connection refused)")
    window.input.setPlainText("hello")
    window.send.click()  # asks for the models again; the message stays
    assert window.input.toPlainText() == "hello" and not window.conversation.replying
    wait_for("the second failure", lambda: "Send asks again" in window.server.text())
