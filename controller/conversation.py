"""The chat window's conversation (controller/chat_window.py), without Qt: the turns sent and received, the reply
coming in, and the transcript as HTML. A reply that fails, or is stopped before any text came, leaves the
conversation as it was and gives the message back to be sent again; a reply stopped midway keeps what came, as
`deskfleet chat` does.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "note": ""}


@dataclass(frozen=True)
class Turn:
    role: str  # "user", "assistant", or "note" (the window's own words: an error, a stop; never sent)
    text: str


class Conversation:
    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.turns: list[Turn] = []
        self.asking: str | None = None  # the message whose reply is coming in
        self.reply = ""  # the reply so far

    @property
    def replying(self) -> bool:
        return self.asking is not None

    def ask(self, text: str) -> list[dict[str, str]]:
        """Begin a reply to `text`; the messages to send for it (notes left out)."""
        if self.replying:
            raise RuntimeError("a reply is still coming in")
        self.asking, self.reply = text, ""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages += [{"role": turn.role, "content": turn.text} for turn in self.turns if turn.role != "note"]
        return [*messages, {"role": "user", "content": text}]

    def add(self, piece: str) -> None:
        self.reply += piece

    def finished(self, finish_reason: str | None) -> None:
        """The reply ended: "stop" or "length" as the server said, None when it was stopped here."""
        assert self.asking is not None
        if not self.reply and finish_reason is None:  # stopped before any text: as if never sent
            self.turns.append(Turn("note", "Stopped before the reply began: not sent."))
            self.asking = None
            return
        self.turns += [Turn("user", self.asking), Turn("assistant", self.reply)]
        if finish_reason == "length":
            self.turns.append(Turn("note", "The reply reached its maximum length and was cut there."))
        elif finish_reason is None:
            self.turns.append(Turn("note", "Stopped: the reply so far stays in the conversation."))
        self.asking, self.reply = None, ""

    def failed(self, error: str) -> str:
        """The reply failed: the conversation is as before it; returns the message, to be given back for a retry."""
        assert self.asking is not None
        message, self.asking, self.reply = self.asking, None, ""
        self.turns.append(Turn("note", f"{error}. Not sent: the conversation is unchanged."))
        return message

    def reset(self) -> None:
        if self.replying:
            raise RuntimeError("a reply is still coming in")
        self.turns = []

    def html(self) -> str:
        """The transcript as the window shows it: each turn under its speaker, text as typed (escaped, its line
        breaks and indentation kept), notes in grey italics, the reply coming in last."""
        shown = list(self.turns)
        if self.asking is not None:
            shown += [Turn("user", self.asking), Turn("assistant", self.reply + " \u258d")]  # a cursor while it comes
        return "".join(_turn_html(turn) for turn in shown)


def _turn_html(turn: Turn) -> str:
    text = html.escape(turn.text)
    if turn.role == "note":
        return f'<p style="color:#777;"><i>{text}</i></p>'
    colour = "#1565c0" if turn.role == "user" else "#2e7d32"
    font = "sans-serif" if turn.role == "user" else "monospace"  # replies are often code
    return (f'<p style="margin-bottom:2px;"><b style="color:{colour};">{ROLE_NAMES[turn.role]}</b></p>'
            f'<pre style="white-space:pre-wrap; font-family:{font}; margin-top:0;">{text}</pre>')
