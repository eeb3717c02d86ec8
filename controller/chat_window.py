"""`deskfleet window`: a chat window on a `deskfleet serve` (local stages or the fleet), for the office's users.

A thin view: the conversation is controller/conversation.py's, the HTTP client controller/chat_client.py's; this
draws them, and runs each request on a thread of its own so that the window never waits on the network. The
reply streams in as it is generated; Stop ends it (the server stops generating it), New conversation starts over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent, QTextCursor
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from deskfleet.controller.chat_client import CONTEXT_FULL, ChatClient, ChatClientError, ReplySettings, ReplyStream
from deskfleet.controller.conversation import Conversation
from deskfleet.controller.qt_window import in_thread, run_until_closed

WINDOW_TITLE = "deskfleet chat"
HEALTH_EVERY_MS = 10_000  # how often the window asks the server whether its chain can run the model


@dataclass(frozen=True)
class WindowOptions:
    model: str | None = None  # None: the first the server lists
    system: str | None = None
    settings: ReplySettings = field(default_factory=ReplySettings)


class _Reply:
    """One reply's requests (a conversation past the context is asked again without its oldest exchange), as the
    window and its thread share them: Stop ends the one under way, whatever it is doing."""

    def __init__(self, number: int) -> None:
        self.number = number
        self._stream: ReplyStream | None = None
        self._stopped = False
        self._lock = threading.Lock()

    def attach(self, stream: ReplyStream) -> None:
        with self._lock:
            self._stream = stream
            if self._stopped:
                stream.cancel()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._stream is not None:
                self._stream.cancel()


class _Bridge(QObject):
    """Carries what a request's thread learns to the window's thread (Qt queues signals across threads)."""

    models = Signal(list)
    models_failed = Signal(str)
    health = Signal(object)  # the server's /health, or None
    piece = Signal(int, str)  # (reply number, text)
    ended = Signal(int, object, int)  # (reply number, finish_reason or None, oldest exchanges left out)
    failed = Signal(int, str)


class ChatWindow(QMainWindow):
    def __init__(self, client: ChatClient, options: WindowOptions) -> None:
        super().__init__()
        self.client = client
        self.options = options
        self.conversation = Conversation(options.system)
        self.model: str | None = None
        self._reply: _Reply | None = None  # the reply coming in
        self._reply_number = 0  # pieces of a reply given up (a new conversation) are not taken for the next one's
        self._bridge = _Bridge()
        self._bridge.models.connect(self._models_found)
        self._bridge.models_failed.connect(self._models_failed)
        self._bridge.health.connect(self._health_found)
        self._health: str = ""  # what the server's /health last said, in words
        self._health_timer = QTimer(self)
        self._health_timer.setInterval(HEALTH_EVERY_MS)
        self._health_timer.timeout.connect(self.ask_health)
        self._bridge.piece.connect(self._piece)
        self._bridge.ended.connect(self._ended)
        self._bridge.failed.connect(self._failed)

        self.setWindowTitle(WINDOW_TITLE)
        self.resize(760, 620)
        self.transcript = QTextBrowser()
        self.transcript.setOpenLinks(False)  # a link in a reply opens nothing
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Write a message (Enter sends it, Shift+Enter starts a new line)")
        self.input.setMaximumHeight(110)
        self.input.installEventFilter(self)
        self.send = QPushButton("Send")
        self.send.clicked.connect(self.send_or_stop)
        self.new = QPushButton("New conversation")
        self.new.clicked.connect(self.new_conversation)
        self.server = QLabel(f"{client.base_url}: asking for its models...")
        self.server.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        buttons = QHBoxLayout()
        buttons.addWidget(self.server, 1)
        buttons.addWidget(self.new)
        buttons.addWidget(self.send)
        layout = QVBoxLayout()
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.input)
        layout.addLayout(buttons)
        central = QWidget()
        central.setLayout(layout)
        self.setCentralWidget(central)
        self._show_state()
        self.find_models()

    # What the user does

    def find_models(self) -> None:
        """Ask the server which models it serves (again after a failure: the Send button does)."""
        self.server.setText(f"{self.client.base_url}: asking for its models...")
        _request(self.client.models, self._bridge.models.emit, self._bridge.models_failed.emit)

    def send_or_stop(self) -> None:
        if self.conversation.replying:
            self.stop()
            return
        if self.model is None:
            self.find_models()
            return
        text = self.input.toPlainText()
        if not text.strip():
            return
        self.input.clear()
        candidates = self.conversation.ask(text)
        self._reply_number += 1
        number, model = self._reply_number, self.model
        self._reply = asked = _Reply(number)

        def reply() -> None:
            for left_out, messages in enumerate(candidates):  # the whole conversation first, then without the oldest
                stream = self.client.reply(model, messages, self.options.settings)
                asked.attach(stream)
                try:
                    stream.open()
                except ChatClientError as error:
                    if error.code == CONTEXT_FULL and left_out + 1 < len(candidates):
                        continue
                    raise
                break
            for piece in stream:
                self._bridge.piece.emit(number, piece)
            self._bridge.ended.emit(number, stream.end.finish_reason if stream.end else None, left_out)

        _request(reply, lambda _: None, lambda error: self._bridge.failed.emit(number, error))
        self._show_state()

    def stop(self) -> None:
        """End the reply coming in: its thread then says it ended (finish None), with what came so far."""
        if self._reply is not None:
            self._reply.stop()

    def new_conversation(self) -> None:
        if self.conversation.replying:
            self.stop()
            self._reply_number += 1  # what the stopped reply still sends is not this conversation's
            self.conversation.failed("Stopped for a new conversation")
        self.conversation.reset()
        self._reply = None
        self._show_state()
        self.input.setFocus()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # Qt's name
        """Enter sends; Shift+Enter is a new line in the message."""
        if watched is self.input and event.type() == QEvent.Type.KeyPress:
            assert isinstance(event, QKeyEvent)
            plain = event.modifiers() in (Qt.KeyboardModifier.NoModifier, Qt.KeyboardModifier.KeypadModifier)
            if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and plain:
                if not self.conversation.replying:
                    self.send_or_stop()
                return True
        return super().eventFilter(watched, event)

    # What the threads report

    def _models_found(self, models: list[str]) -> None:
        wanted = self.options.model
        if not models or (wanted is not None and wanted not in models):
            served = ", ".join(models) or "none"
            self._models_failed(f"{self.client.base_url} serves no model {wanted or ''} (it serves: {served})")
            return
        self.model = wanted or models[0]
        self._show_server()
        self._show_state()
        self.ask_health()
        self._health_timer.start()

    def _models_failed(self, error: str) -> None:
        self.model = None
        self._health_timer.stop()
        self.server.setText(f"{error}. Send asks again.")
        self._show_state()

    def ask_health(self) -> None:
        """Ask the server whether its chain can run the model (its failures are the requests' to tell)."""
        _request(self.client.health, self._bridge.health.emit, lambda error: self._bridge.health.emit(None))

    def _health_found(self, health: dict[str, object] | None) -> None:
        status = health.get("status") if health else None
        if status == "ok":
            stages = health.get("stages") if health else None
            self._health = f"ready on {stages} stage(s)" if isinstance(stages, int) else "ready"
        elif status == "opening":
            self._health = "opening its chain (the first reply waits for it)"
        elif status == "unavailable":
            error = health.get("error") if health else None
            self._health = "cannot run the model now" + (f": {error}" if error else "; the next message tries again")
        else:
            self._health = ""
        if self.model is not None:
            self._show_server()

    def _show_server(self) -> None:
        self.server.setText(f"{self.model} at {self.client.base_url}" + (f", {self._health}" if self._health else ""))

    def _piece(self, number: int, piece: str) -> None:
        if number == self._reply_number and self.conversation.replying:
            self.conversation.add(piece)
            self._append(piece)

    def _ended(self, number: int, finish_reason: str | None, left_out: int) -> None:
        if number == self._reply_number and self.conversation.replying:
            message = self.conversation.finished(finish_reason, left_out)
            self._reply = None
            if message is not None and not self.input.toPlainText().strip():
                self.input.setPlainText(message)  # stopped before the reply began: to send again
            self._show_state()

    def _failed(self, number: int, error: str) -> None:
        if number == self._reply_number and self.conversation.replying:
            message = self.conversation.failed(error)
            self._reply = None
            if not self.input.toPlainText().strip():
                self.input.setPlainText(message)  # to send again as it was
            self._show_state()

    # Drawing

    def _show_state(self) -> None:
        replying = self.conversation.replying
        self.send.setText("Stop" if replying else "Send")
        self.send.setEnabled(True)
        self.new.setEnabled(bool(self.conversation.turns) or replying)
        self._show_transcript()

    def _show_transcript(self) -> None:
        """Draw the whole transcript (as a turn begins or ends): where the reader was, or at its end when they were
        following it."""
        bar = self.transcript.verticalScrollBar()
        following, kept = self._following(), bar.value()
        self.transcript.setHtml(self.conversation.finished_html())
        bar.setValue(bar.maximum() if following else kept)

    def _append(self, piece: str) -> None:
        """Add a piece of the reply to the transcript's end, as plain text (drawing it all again at every piece cost
        27 ms a piece at 200 turns, and took the reader's place and selection)."""
        following = self._following()
        end = QTextCursor(self.transcript.document())
        end.movePosition(QTextCursor.MoveOperation.End)
        end.insertText(piece)
        if following:
            bar = self.transcript.verticalScrollBar()
            bar.setValue(bar.maximum())

    def _following(self) -> bool:
        """Whether the reader is at the transcript's end (one scrolled up to read is not pulled down)."""
        bar = self.transcript.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4


def run_window(client: ChatClient, options: WindowOptions) -> int:
    """Show the window until it is closed, or a signal stops it (exit 0)."""
    run_until_closed(lambda: ChatWindow(client, options)).stop()
    return 0


def _request(work: Callable[[], object], done: Callable[[object], None], failed: Callable[[str], None]) -> None:
    """Run a request on a thread of its own: a ChatClientError is said in its own words."""
    in_thread(work, done, failed, said_alone=(ChatClientError,), name="deskfleet-window-request")
