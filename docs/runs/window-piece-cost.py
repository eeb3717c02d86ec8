"""What a piece of a streamed reply costs the chat window to show, at conversations of several lengths (offscreen Qt,
no server: the pieces are fed as the request thread would). Prints JSON: ms per piece, and ms to draw the whole
transcript again as the reply ends.

    .venv/bin/python docs/runs/window-piece-cost.py
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtWidgets import QApplication

from deskfleet.controller.chat_client import ChatClient
from deskfleet.controller.chat_window import ChatWindow, WindowOptions

PIECES = 200


def main() -> None:
    app = QApplication([])
    report: dict[str, float] = {}
    for turns, chars in ((0, 0), (20, 1000), (200, 300), (200, 2000)):
        window = ChatWindow(ChatClient("http://127.0.0.1:9/v1"), WindowOptions())
        window.resize(760, 620)
        window.show()
        for number in range(turns):
            window.conversation.ask(f"question {number}")
            window.conversation.add("x" * chars)
            window.conversation.finished("stop")
        window.conversation.ask("go on")
        window._reply_number = 1
        window._show_transcript()
        started = time.perf_counter()
        for _ in range(PIECES):
            window._piece(1, "word ")
        report[f"{turns} turns of {chars} characters: ms a piece"] = round(
            (time.perf_counter() - started) / PIECES * 1e3, 3)
        started = time.perf_counter()
        window._ended(1, "stop", 0)
        report[f"{turns} turns of {chars} characters: ms to draw it all as the reply ends"] = round(
            (time.perf_counter() - started) * 1e3, 1)
        window.close()
    app.quit()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
