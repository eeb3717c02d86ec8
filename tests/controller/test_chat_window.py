"""The chat window (`deskfleet window`): its conversation (no Qt), its client against a real `serve` API on the tiny
model, and the window itself on Qt's offscreen platform, driven as a user would: type, Enter, Stop, New."""

from __future__ import annotations

import gc
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QKeyEvent, QTextCursor
from PySide6.QtWidgets import QApplication

from deskfleet.controller.chat_client import CONTEXT_FULL, ChatClient, ChatClientError, ReplySettings
from deskfleet.controller.chat_window import ChatWindow, WindowOptions
from deskfleet.controller.conversation import Conversation
from deskfleet.controller.engine_service import EngineService
from tests.controller.windows import wait_for
from tests.ports import free_port

from .test_openai_api import MODEL, post, serving, slow

GREEDY = ReplySettings(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def served(tiny_export: Path) -> Iterator[tuple[str, EngineService]]:
    with serving(tiny_export) as server:
        yield server


def whole_reply(url: str, messages: list[dict[str, str]], max_tokens: int = 12) -> str:
    status, body = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                       "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return str(body["choices"][0]["message"]["content"])


# The conversation

def test_a_finished_reply_joins_the_conversation_and_notes_are_never_sent() -> None:
    conversation = Conversation("Be brief.")
    assert conversation.ask("hello") == [[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hello"}]]
    conversation.add("hi ")
    conversation.add("there")
    assert conversation.finished("length") is None
    assert [turn.role for turn in conversation.turns] == ["user", "assistant", "note"]
    whole, alone = conversation.ask("again")
    assert whole[1:] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
                         {"role": "user", "content": "again"}]
    assert alone[1:] == [{"role": "user", "content": "again"}]  # what is sent where the context is full


def test_a_failed_or_unstarted_reply_leaves_the_conversation_as_it_was_and_gives_the_message_back() -> None:
    conversation = Conversation()
    conversation.ask("first")
    assert conversation.failed("the server's reply failed: a PC went") == "first"
    conversation.ask("second")
    assert conversation.finished(None) == "second"  # stopped before any text
    assert [turn.role for turn in conversation.turns] == ["note", "note"]
    assert conversation.ask("third") == [[{"role": "user", "content": "third"}]]
    conversation.add("part")
    assert conversation.finished(None) is None  # stopped midway: what came stays, as in `deskfleet chat`
    assert [(turn.role, turn.text) for turn in conversation.turns[-3:-1]] == [("user", "third"),
                                                                             ("assistant", "part")]


def test_a_conversation_past_the_context_forgets_its_oldest_exchanges_but_shows_them() -> None:
    conversation = Conversation()
    for number in range(3):
        conversation.ask(f"q{number}")
        conversation.add(f"a{number}")
        conversation.finished("stop")
    candidates = conversation.ask("q3")
    assert [len(messages) for messages in candidates] == [7, 5, 3, 1]
    conversation.add("a3")
    conversation.finished("stop", left_out=2)  # the request that fitted went without the 2 oldest exchanges
    assert [turn.text for turn in conversation.turns if turn.forgotten] == ["q0", "a0", "q1", "a1"]
    assert conversation.exchanges == 2
    assert conversation.turns[-3].text.startswith("The conversation outgrew the model's context: its oldest 2 "
                                                  "exchanges (greyed) no longer go")
    assert [message["content"] for message in conversation.ask("q4")[0]] == ["q2", "a2", "q3", "a3", "q4"]
    assert "color:#9e9e9e" in conversation.finished_html()


def test_the_transcript_shows_text_as_typed_never_as_markup() -> None:
    conversation = Conversation()
    conversation.ask("<script>alert(1)</script>\n    indented & more")
    conversation.add("<b>bold?</b>")
    text = conversation.finished_html()
    assert "<script>" not in text and "&lt;script&gt;" in text and "    indented &amp; more" in text
    assert "&lt;b&gt;bold?&lt;/b&gt;" in text


# The client, against a real API

def test_the_client_streams_the_reply_the_api_gives_whole(served: tuple[str, EngineService]) -> None:
    url, _ = served
    client = ChatClient(f"{url}/v1")
    assert client.models() == [MODEL]
    messages = [{"role": "user", "content": "Say something."}]
    stream = client.reply(MODEL, messages, GREEDY)
    stream.open()
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == whole_reply(url, messages)
    assert stream.end is not None and stream.end.finish_reason in ("stop", "length")
    assert stream.end.completion_tokens is not None and stream.end.completion_tokens > 0


def test_the_client_names_what_went_wrong(served: tuple[str, EngineService], tiny_export: Path) -> None:
    url, _ = served
    with pytest.raises(ChatClientError, match=r"/v1/chat/completions answered 404: .*'nope'"):
        ChatClient(f"{url}/v1").reply("nope", [{"role": "user", "content": "x"}], GREEDY).open()
    with pytest.raises(ChatClientError, match=r"answered 404 \(.*\): is --url the API's root, ending in /v1\?"):
        ChatClient(url).models()
    full = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(ChatClientError) as refused:
        ChatClient(f"{url}/v1").reply(MODEL, full, GREEDY).open()
    assert refused.value.code == CONTEXT_FULL
    nobody = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ChatClientError, match=f"nothing answers at {nobody} \\(connection refused\\): start "):
        ChatClient(nobody).models()
    with pytest.raises(ChatClientError, match=f"nothing answers at {nobody} "):
        ChatClient(nobody).reply(MODEL, full, GREEDY).open()
    for key in ("sesame", "clé"):  # serve compares the key's UTF-8 bytes; http.client sent a str as Latin-1
        with serving(tiny_export, api_key=key) as (keyed, _):
            with pytest.raises(ChatClientError, match=r"wants an API key .*: give the window the server's "
                                                      r"--api-key-file"):
                ChatClient(f"{keyed}/v1").models()
            assert ChatClient(f"{keyed}/v1", api_key=key).models() == [MODEL]
    for bad in ("ftp://host/v1", "localhost:8000", "http://host:99999/v1"):
        with pytest.raises(ValueError):
            ChatClient(bad)
    not_pem = tiny_export / "config.json"
    with pytest.raises(ValueError, match=f"--ca-file {not_pem}: .*: give a certificate in PEM"):
        ChatClient("https://127.0.0.1:1/v1", ca_file=not_pem)


def test_a_cancelled_reply_ends_at_once_and_the_server_stops_making_it(tiny_export: Path) -> None:
    with serving(tiny_export, opener=slow(tiny_export)) as (url, service):
        stream = ChatClient(f"{url}/v1").reply(MODEL, [{"role": "user", "content": "go on"}],
                                               ReplySettings(max_tokens=400, temperature=0.0))
        stream.open()
        pieces = iter(stream)
        assert next(pieces)
        stream.cancel()
        assert len(list(pieces)) <= 2  # what was in flight
        assert stream.end is not None and stream.end.finish_reason is None
        deadline = time.monotonic() + 30
        while service.live_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.live_streams == 0 and service.streams_cancelled == 1


def test_a_reply_cancelled_while_the_server_has_not_answered_ends_at_once() -> None:
    # Stop did nothing until the server sent its answer's head: a server that took the connection and said nothing
    # held the window for READ_TIMEOUT_S (300 s)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        stream = ChatClient(f"http://127.0.0.1:{silent.getsockname()[1]}/v1").reply(
            MODEL, [{"role": "user", "content": "x"}], GREEDY)
        opening = threading.Thread(target=stream.open)
        opening.start()
        time.sleep(0.3)
        started = time.monotonic()
        stream.cancel()
        opening.join(10)
        assert not opening.is_alive() and time.monotonic() - started < 5
        assert list(stream) == [] and stream.end is not None and stream.end.finish_reason is None


def test_a_reply_cut_off_by_the_server_is_an_error_not_an_end() -> None:
    # http.client reads a chunked body cut short as its end: a server killed mid-reply looked like the user's Stop
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "half"}, "finish_reason": null}]}\n\n'
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer() -> None:
            connection, _ = server.accept()
            with connection:
                connection.settimeout(10)
                asked = b""
                while b"\r\n\r\n" not in asked:  # the whole request, or closing resets the link before the reply
                    asked += connection.recv(65536)
                header, _, body = asked.partition(b"\r\n\r\n")
                length = int(header.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += connection.recv(65536)
                connection.sendall(head + f"{len(event):x}\r\n".encode() + event + b"\r\n")
                connection.shutdown(socket.SHUT_WR)  # the server goes, mid-reply
                while connection.recv(65536):
                    pass
        threading.Thread(target=answer, daemon=True).start()
        stream = ChatClient(f"http://127.0.0.1:{server.getsockname()[1]}/v1").reply(
            MODEL, [{"role": "user", "content": "x"}], GREEDY)
        stream.open()
        pieces: list[str] = []
        with pytest.raises(ChatClientError, match="broke during the reply \\(it ended before the reply did"):
            for piece in stream:
                pieces.append(piece)
        assert pieces == ["half"]


# The window

def press_enter(window: ChatWindow, modifiers: Qt.KeyboardModifier = Qt.KeyboardModifier.NoModifier) -> None:
    QApplication.sendEvent(window.input, QKeyEvent(QEvent.Type.KeyPress, Qt.Key.Key_Return, modifiers))


def test_the_window_sends_on_enter_and_shows_the_reply_as_it_comes(app: QApplication,
                                                                    served: tuple[str, EngineService]) -> None:
    url, _ = served
    window = ChatWindow(ChatClient(f"{url}/v1"), WindowOptions(settings=GREEDY))
    wait_for("the model's name", lambda: window.model == MODEL)
    # the server's /health, beside the API's root: its chain of 2 local stages is open once a request ran
    wait_for("the server's health", lambda: window.server.text().startswith(f"{MODEL} at {url}/v1, "))
    whole_reply(url, [{"role": "user", "content": "hello"}])
    window.ask_health()
    wait_for("the chain's stages", lambda: window.server.text() == f"{MODEL} at {url}/v1, ready on 2 stage(s)")
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
    window._ended(1, "length", 0)
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


def test_a_conversation_past_the_context_goes_on_without_its_oldest_exchanges(
        app: QApplication, served: tuple[str, EngineService]) -> None:
    # every message after a long reply was refused (400: the prompt past the model's context) until New conversation
    url, _ = served
    window = ChatWindow(ChatClient(f"{url}/v1"), WindowOptions(settings=GREEDY))
    wait_for("the model's name", lambda: window.model == MODEL)
    for number in range(4):  # 4 exchanges of ~200 tokens each, past the tiny model's context of 512
        window.conversation.ask(f"question {number} " + "word " * 100)
        window.conversation.add("answer " * 100)
        window.conversation.finished("stop")
    window.input.setPlainText("and now?")
    window.send.click()
    wait_for("the reply", lambda: not window.conversation.replying)
    turns = window.conversation.turns
    last = max(index for index, turn in enumerate(turns) if turn.role == "user")
    assert turns[last].text == "and now?" and turns[last + 1].role == "assistant" and turns[last + 1].text
    assert turns[last - 1].text.startswith("The conversation outgrew the model's context: its oldest")
    assert 1 <= window.conversation.exchanges < 5 and turns[0].forgotten
    assert window.input.toPlainText() == ""


def test_stopping_before_the_reply_began_gives_the_message_back(app: QApplication) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes the request, never answers
        window = ChatWindow(ChatClient(f"http://127.0.0.1:{silent.getsockname()[1]}/v1"), WindowOptions())
        window.model = MODEL  # as if it had listed its models
        window.input.setPlainText("hello?")
        window.send.click()
        window.send.click()  # Stop, before any answer
        wait_for("the stop", lambda: not window.conversation.replying, timeout=10)
    assert window.input.toPlainText() == "hello?"
    assert [turn.text for turn in window.conversation.turns] == ["Stopped before the reply began: not sent."]


def test_a_reader_scrolled_up_stays_where_they_read_while_the_reply_comes(app: QApplication) -> None:
    window = ChatWindow(ChatClient(f"http://127.0.0.1:{free_port()}/v1"), WindowOptions())
    window.resize(600, 400)
    window.show()  # laid out: the transcript has a scroll bar
    for number in range(60):
        window.conversation.ask(f"question {number}")
        window.conversation.add(f"answer {number}\n" * 3)
        window.conversation.finished("stop")
    window.conversation.ask("one more")
    window._reply_number = 1
    window._show_transcript()
    bar = window.transcript.verticalScrollBar()
    assert bar.value() == bar.maximum() > 0  # following the end
    window._piece(1, "first words ")
    assert bar.value() == bar.maximum()
    cursor = window.transcript.textCursor()  # the reader selects some text, and scrolls up to read
    cursor.setPosition(10)
    cursor.setPosition(40, QTextCursor.MoveMode.KeepAnchor)
    window.transcript.setTextCursor(cursor)
    reading = bar.maximum() // 3
    bar.setValue(reading)
    for _ in range(50):
        window._piece(1, "more words\n")
    assert bar.value() == reading and bar.maximum() > 3 * reading  # drawing it whole took them to the top
    assert len(window.transcript.textCursor().selectedText()) == 30  # and lost the selection
    window._ended(1, "stop", 0)
    assert bar.value() == reading  # drawn again as the reply ended: still where they read
    assert window.conversation.turns[-1].text == "first words " + "more words\n" * 50


def test_the_window_says_what_the_servers_health_says(app: QApplication) -> None:
    window = ChatWindow(ChatClient(f"http://127.0.0.1:{free_port()}/v1"), WindowOptions())
    window.model = MODEL
    said = {"status": "unavailable", "error": "the chain could not be opened: agent 3f2a1b0c9d8e did not answer"}
    window._health_found(said)
    assert window.server.text().endswith(", cannot run the model now: the chain could not be opened: agent "
                                         "3f2a1b0c9d8e did not answer")
    window._health_found({"status": "unavailable"})  # a server with a key tells the error only to who gives it
    assert window.server.text().endswith(", cannot run the model now; the next message tries again")
    window._health_found({"status": "opening", "stages": None})
    assert window.server.text().endswith(", opening its chain (the first reply waits for it)")
    window._health_found(None)  # no answer: the requests say why
    assert window.server.text() == f"{MODEL} at http://127.0.0.1:{window.client._parsed.port}/v1"
    assert ChatClient("http://127.0.0.1:1/some/root").health() is None  # where /health is cannot be told
