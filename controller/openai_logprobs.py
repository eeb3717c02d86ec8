"""Generated tokens' log-probabilities (common/logprobs.TokenLogprob) in the OpenAI API's shapes: pure code.

Each token is shown as its own text, the tokenizer's decoding of it alone (a token that holds part of a character
shows U+FFFD, and its `bytes` are that text's UTF-8, as other OpenAI-compatible servers give them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from deskfleet.common.logprobs import TokenLogprob

Decode = Callable[[int], str]  # one token id -> its text


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Decode) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    return {"content": [dict(_chat_token(entry.token, entry.logprob, decode),
                             top_logprobs=[_chat_token(token, logprob, decode) for token, logprob in entry.top])
                        for entry in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], decode: Decode, offset: int = 0) -> dict[str, Any]:
    """A completion choice's (or chunk's) `logprobs`: tokens, token_logprobs, top_logprobs (each position's most
    likely tokens and the chosen one, by text) and text_offset (each token's start in the completion's text, the
    tokens' texts counted from `offset`: a streamed chunk's first token's)."""
    tokens = [decode(entry.token) for entry in entries]
    offsets: list[int] = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{**{decode(token): logprob for token, logprob in entry.top}, text: entry.logprob}
                             for entry, text in zip(entries, tokens, strict=True)],
            "text_offset": offsets}


# Private functions

def _chat_token(token: int, logprob: float, decode: Decode) -> dict[str, Any]:
    text = decode(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
