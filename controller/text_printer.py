"""Streams decoded text to a terminal as tokens arrive."""

from __future__ import annotations

import re
from typing import TextIO

from .tokenizer import ModelTokenizer

# The characters a terminal acts on instead of showing: C0 controls but newline and tab (ESC starts the
# sequences that move the cursor, recolour, retitle the window, set the clipboard (OSC 52) or hide text; CR and
# backspace overwrite what was shown), DEL and the C1 controls (U+009B is a one-character CSI to some terminals);
# and Unicode's bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069), which make a
# terminal show text in another order than it was written ("Trojan source").
_TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def visible_controls(text: str) -> str:
    """`text` with every terminal control but newline and tab written as its escape (ESC as `\\x1b`), so
    what a model writes is shown, not obeyed, by the terminal."""
    return _TERMINAL_CONTROLS.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def is_terminal(out: TextIO) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):  # a closed or stream-like object without a descriptor
        return False


class TextPrinter:
    """Writes a reply's text as its tokens arrive; what it writes adds up to the reply's decoded text.

    Each token decodes a short window, not the whole reply (decoding the whole tail made a 4000-token reply
    cost 159 µs a token, more than a quarter of the demo target's step): the tokens already written since
    the window began, and the new ones. The window's own text is told apart by decoding it without the new
    tokens, so a tokenizer's spacing rules at the window's start apply alike to both. A window whose text
    ends inside a multi-byte character (U+FFFD) waits for the next token. Call finish() when the reply ends:
    a reply cut inside a character shows it as U+FFFD, as its text does.

    On a terminal (`out.isatty()`, or `show_controls`) the text's control characters but newline and tab are
    written as escapes (visible_controls): a model's ESC sequences must not drive the user's terminal. `text`
    holds what was written, before that escaping.
    """

    def __init__(self, tokenizer: ModelTokenizer, out: TextIO, show_controls: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.show_controls = is_terminal(out) if show_controls is None else show_controls
        self.tokens: list[int] = []
        self.text = ""  # what was written so far (unescaped)
        self._window_start = 0  # the first token of the window decoded each time
        self._written_until = 0  # tokens before this one are written

    @property
    def written_tokens(self) -> int:
        """How many of the tokens pushed have had their text written (one ending inside a character waits)."""
        return self._written_until

    def push(self, stream_id: int, token: int) -> None:
        self.tokens.append(token)
        self._write(final=False)

    def finish(self) -> None:
        """Write what push() held back: the bytes of a character the reply ended inside of."""
        if self._written_until < len(self.tokens):
            self._write(final=True)

    def _write(self, final: bool) -> None:
        written = self.tokenizer.decode(self.tokens[self._window_start:self._written_until])
        text = self.tokenizer.decode(self.tokens[self._window_start:])
        if len(text) <= len(written) or (text.endswith("\ufffd") and not final):
            return  # nothing new yet, or an incomplete UTF-8 sequence: wait for the next token
        # The window moves on before the write: a Ctrl-C while the write or the flush blocks (a stalled
        # terminal) leaves the text in the stream's buffer, shown when the terminal drains, so finish()
        # must not write it a second time.
        self._window_start, self._written_until = self._written_until, len(self.tokens)
        piece = text[len(written):]
        self.text += piece
        self.out.write(visible_controls(piece) if self.show_controls else piece)
        self.out.flush()
