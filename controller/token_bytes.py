"""The bytes each token of a tokenizer stands for, which decoding it alone cannot give: a token that holds part of
a multi-byte character decodes to U+FFFD (its bytes lost, and every such token the same text), and a SentencePiece
decoder strips the leading space of a text's first token. The API's `bytes` field, and a token's text where its
bytes are not UTF-8 on their own (backslash escapes, as other OpenAI-compatible servers show them), come from here.

Read from tokenizer.json's decoder, as the tokenizers library applies it:
- ByteLevel (GPT-2, Llama 3, Qwen): each character of the token's string is one byte, through GPT-2's table of
  printable stand-ins for the 256 bytes;
- ByteFallback (Llama 2, Mistral): a token `<0xC3>` is that byte;
- Metaspace, or a Replace of `▁` by a space: `▁` is a space;
- any other: the token decoded alone, as UTF-8.
An added token (BOS, a chat's markers) is its text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the character that stands for each byte -> the byte. The bytes
    that print as themselves (! to ~, ¡ to ¬, ® to ÿ) keep their code point; the others take 256, 257, ... in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(byte): byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


class TokenBytes:
    """A token id -> the bytes it stands for, for one tokenizer (`decoder`: tokenizer.json's "decoder" entry;
    `piece`: the token's string in the vocabulary, None for an id outside it; `decode_alone`: the tokenizer's
    decoding of the token by itself; `added`: the ids of added tokens, with their text)."""

    def __init__(self, decoder: object, piece: Any, decode_alone: Any, added: dict[int, str]) -> None:
        kinds = set(_decoder_kinds(decoder))
        self._byte_level = byte_level_table() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        self._metaspace = "Metaspace" in kinds or any(
            isinstance(part, dict) and part.get("type") == "Replace" and part.get("content") == " "
            and SENTENCEPIECE_SPACE in str(part.get("pattern", {}).get("String", ""))
            for part in _decoder_parts(decoder))
        self._piece = piece
        self._decode_alone = decode_alone
        self._added = added
        self._known: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        known = self._known.get(token)
        if known is None:
            known = self._known[token] = self._bytes_of(token)
        return known

    def _bytes_of(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode("utf-8")
        piece = self._piece(token)
        if not isinstance(piece, str):
            return str(self._decode_alone(token)).encode("utf-8")
        if self._byte_level is not None and piece and all(char in self._byte_level for char in piece):
            return bytes(self._byte_level[char] for char in piece)
        if self._byte_fallback and (match := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        if self._metaspace:
            return piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")
        return str(self._decode_alone(token)).encode("utf-8")


def token_text(raw: bytes) -> str:
    """A token's text as the API shows it: its bytes as UTF-8, a byte that is not (part of a character the token
    holds only some of) as a backslash escape, `\\xc3`: one distinct text a token, where U+FFFD made every such
    token the same."""
    return raw.decode("utf-8", errors="backslashreplace")


# Private functions

def _decoder_parts(decoder: object) -> Iterator[object]:
    """The decoder and, for a Sequence, each decoder in it (nested Sequences flattened)."""
    if isinstance(decoder, dict) and decoder.get("type") == "Sequence":
        for part in decoder.get("decoders") or ():
            yield from _decoder_parts(part)
    elif decoder is not None:
        yield decoder


def _decoder_kinds(decoder: object) -> Iterator[str]:
    for part in _decoder_parts(decoder):
        if isinstance(part, dict) and isinstance(part.get("type"), str):
            yield part["type"]
