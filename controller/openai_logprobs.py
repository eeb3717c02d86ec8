"""Generated tokens' log-probabilities (common/logprobs.TokenLogprob) in the OpenAI API's shapes: pure code.

Each token is shown as its own text, the tokenizer's decoding of it alone (a token that holds part of a character
shows U+FFFD, and its `bytes` are that text's UTF-8, as other OpenAI-compatible servers give them). A value that is
not finite (a token the model rules out) is shown as OpenAI shows one, -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from deskfleet.common.logprobs import TokenLogprob

Decode = Callable[[int], str]  # one token id -> its text
UNLIKELY = -9999.0  # OpenAI's log-probability for a token it rules out


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Decode) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    return {"content": [dict(_chat_token(entry.token, entry.logprob, decode),
                             top_logprobs=[_chat_token(token, logprob, decode) for token, logprob in entry.top])
                        for entry in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], decode: Decode, offsets: Sequence[int]) -> dict[str, Any]:
    """A completion choice's (or chunk's) `logprobs`: tokens, token_logprobs, top_logprobs (each position's most
    likely tokens and the chosen one, by text: alternatives whose texts are the same show once) and text_offset
    (`offsets`: where each token's text starts in the completion's text)."""
    tokens = [decode(entry.token) for entry in entries]
    return {"tokens": tokens,
            "token_logprobs": [_shown(entry.logprob) for entry in entries],
            "top_logprobs": [{**{decode(token): _shown(logprob) for token, logprob in entry.top},
                              text: _shown(entry.logprob)}
                             for entry, text in zip(entries, tokens, strict=True)],
            "text_offset": list(offsets)}


# Private functions

def _chat_token(token: int, logprob: float, decode: Decode) -> dict[str, Any]:
    text = decode(token)
    return {"token": text, "logprob": _shown(logprob), "bytes": list(text.encode("utf-8"))}


def _shown(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY
