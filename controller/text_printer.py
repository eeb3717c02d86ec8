"""Streams decoded text to a terminal as tokens arrive."""

from __future__ import annotations

from typing import TextIO

from .tokenizer import ModelTokenizer


class TextPrinter:
    """Writes a reply's text as its tokens arrive; what it writes adds up to the reply's decoded text.

    Each token decodes a short window, not the whole reply (decoding the whole tail made a 4000-token reply
    cost 159 µs a token, more than a quarter of the demo target's step): the tokens already written since
    the window began, and the new ones. The window's own text is told apart by decoding it without the new
    tokens, so a tokenizer's spacing rules at the window's start apply alike to both. A window whose text
    ends inside a multi-byte character (U+FFFD) waits for the next token. Call finish() when the reply ends:
    a reply cut inside a character shows it as U+FFFD, as its text does.
    """

    def __init__(self, tokenizer: ModelTokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.tokens: list[int] = []
        self._window_start = 0  # the first token of the window decoded each time
        self._written_until = 0  # tokens before this one are written

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
        self.out.write(text[len(written):])
        self.out.flush()
