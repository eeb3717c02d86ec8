"""A screenshot of `deskfleet window` for docs/images/ (README, "Chat in a window"): one exchange with a running
`deskfleet serve`, greedy.

    .venv/bin/deskfleet serve --model out/demo/target-int4 --prompt-lookup &
    xvfb-run -a -s "-screen 0 1024x768x24" .venv/bin/python docs/runs/window-screenshot.py docs/images \
        "def fibonacci(n):"
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from PySide6.QtWidgets import QApplication

from deskfleet.controller.chat_client import ChatClient, ReplySettings
from deskfleet.controller.chat_window import ChatWindow, WindowOptions


def main() -> None:
    out, message = Path(sys.argv[1]), sys.argv[2]
    app = QApplication([])
    window = ChatWindow(ChatClient(), WindowOptions(settings=ReplySettings(max_tokens=96, temperature=0.0)))
    window.show()
    deadline = time.monotonic() + 60
    while window.model is None and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)
    window.input.setPlainText(message)
    window.send.click()
    while window.conversation.replying and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)
    window.input.setPlainText("and now with a loop")
    for _ in range(20):
        app.processEvents()
        time.sleep(0.02)
    window.grab().save(str(out / "chat-window.png"))


if __name__ == "__main__":
    main()
