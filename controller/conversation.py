"""The chat window's conversation (controller/chat_window.py), without Qt: the turns sent and received, the reply
coming in, and the transcript as HTML. A reply that fails, or is stopped before any text came, leaves the
conversation as it was and gives the message back to be sent again; a reply stopped midway keeps what came, as
`deskfleet chat` does. A conversation past the model's context leaves out its oldest exchanges, as `chat` does:
they stay in the transcript, greyed, and are no longer sent.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, replace

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "note": ""}


@dataclass(frozen=True)
class Turn:
    role: str  # "user", "assistant", or "note" (the window's own words: an error, a stop; never sent)
    text: str
    forgotten: bool = False  # left out of what is sent: the conversation outgrew the model's context


class Conversation:
    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.turns: list[Turn] = []
        self.asking: str | None = None  # the message whose reply is coming in
        self.reply = ""  # the reply so far

    @property
    def replying(self) -> bool:
        return self.asking is not None

    @property
    def exchanges(self) -> int:
        """The exchanges (a message and its reply) still sent with each message."""
        return sum(turn.role == "user" and not turn.forgotten for turn in self.turns)

    def ask(self, text: str) -> list[list[dict[str, str]]]:
        """Begin a reply to `text`. Returns what to send for it: the whole conversation first, then the same
        without its oldest exchange, without its two oldest, ... down to the message alone (notes never sent), for
        the caller to send the first the model's context takes (`finished` is then told how many it left out)."""
        if self.replying:
            raise RuntimeError("a reply is still coming in")
        self.asking, self.reply = text, ""
        system = [{"role": "system", "content": self.system}] if self.system else []
        live = [turn for turn in self.turns if turn.role != "note" and not turn.forgotten]
        starts = [index for index, turn in enumerate(live) if turn.role == "user"] + [len(live)]
        return [[*system, *({"role": turn.role, "content": turn.text} for turn in live[start:]),
                 {"role": "user", "content": text}] for start in starts]

    def add(self, piece: str) -> None:
        self.reply += piece

    def finished(self, finish_reason: str | None, left_out: int = 0) -> str | None:
        """The reply ended: "stop" or "length" as the server said, None when it was stopped here; `left_out` the
        oldest exchanges its request went without. Returns the message where it is given back (stopped before any
        text came: as if never sent), else None."""
        assert self.asking is not None
        message = self.asking
        self.asking = None
        if not self.reply and finish_reason is None:
            self.turns.append(Turn("note", "Stopped before the reply began: not sent."))
            return message
        if left_out:
            self._forget(left_out)
        self.turns += [Turn("user", message), Turn("assistant", self.reply)]
        if finish_reason == "length":
            self.turns.append(Turn("note", "The reply reached its maximum length (--max-tokens) and was cut there."))
        elif finish_reason is None:
            self.turns.append(Turn("note", "Stopped: the reply so far stays in the conversation."))
        self.reply = ""
        return None

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

    def finished_html(self) -> str:
        """The transcript of the turns so far, with the message being answered and its speaker's heading after them
        where a reply is coming in (its text is added to the end as it comes: see chat_window)."""
        text = "".join(_turn_html(turn) for turn in self.turns)
        if self.asking is not None:
            text += _turn_html(Turn("user", self.asking)) + _heading("assistant") + _body("assistant", self.reply)
        return text

    def _forget(self, exchanges: int) -> None:
        """Leave the oldest `exchanges` of those still sent out from now on, and say so."""
        left = exchanges
        for index, turn in enumerate(self.turns):
            if turn.role == "note" or turn.forgotten:
                continue
            if turn.role == "user":
                if left == 0:
                    break
                left -= 1
            self.turns[index] = replace(turn, forgotten=True)
        which = "exchange" if exchanges == 1 else f"{exchanges} exchanges"
        self.turns.append(Turn("note", f"The conversation outgrew the model's context: its oldest {which} (greyed) "
                                       "no longer go with the messages. New conversation starts over."))


def _turn_html(turn: Turn) -> str:
    if turn.role == "note":
        return f'<p style="color:#777;"><i>{html.escape(turn.text)}</i></p>'
    return _heading(turn.role, turn.forgotten) + _body(turn.role, turn.text, turn.forgotten)


def _heading(role: str, forgotten: bool = False) -> str:
    colour = "#9e9e9e" if forgotten else "#1565c0" if role == "user" else "#2e7d32"
    return f'<p style="margin-bottom:2px;"><b style="color:{colour};">{ROLE_NAMES[role]}</b></p>'


def _body(role: str, text: str, forgotten: bool = False) -> str:
    font = "sans-serif" if role == "user" else "monospace"  # replies are often code
    grey = " color:#9e9e9e;" if forgotten else ""
    return (f'<pre style="white-space:pre-wrap; font-family:{font}; margin-top:0;{grey}">'
            f"{html.escape(text)}</pre>")
