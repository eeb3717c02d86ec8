"""Streams decoded text to a terminal as tokens arrive."""

from __future__ import annotations

from typing import TextIO

from .tokenizer import ModelTokenizer


class TextPrinter:
    """Writes decoded text as tokens arrive (decoding the whole tail keeps multi-byte characters whole).
    Call finish() when the reply ends: a reply cut inside a character shows it as U+FFFD, as its text does."""

    def __init__(self, tokenizer: ModelTokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.tokens: list[int] = []
        self.printed = ""

    def push(self, stream_id: int, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text

    def finish(self) -> None:
        """Write what push() held back: the bytes of a character the reply ended inside of."""
        text = self.tokenizer.decode(self.tokens)
        if text != self.printed:
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text
