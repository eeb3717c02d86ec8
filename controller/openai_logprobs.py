"""Generated tokens' log-probabilities (common/logprobs.TokenLogprob) in the OpenAI API's shapes: pure code.

Each token is shown as the text of the bytes it stands for (token_bytes): where those bytes are not UTF-8 on their
own (part of a multi-byte character) the bytes that are not are backslash escapes (`\\xe3\\x81`), and a chat entry's
`bytes` are the token's own, which joined give the text back. (Until December 2026 such a token showed U+FFFD, with
U+FFFD's bytes, and in a completion's `top_logprobs` map, keyed by text, the least likely of several U+FFFD
alternatives overwrote the others.) A value that is not finite (a token the model rules out) is shown as OpenAI
shows one, -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from deskfleet.common.logprobs import TokenLogprob

from .token_bytes import token_text

TokenBytesOf = Callable[[int], bytes]  # one token id -> the bytes it stands for (ModelTokenizer.token_bytes)
UNLIKELY = -9999.0  # OpenAI's log-probability for a token it rules out


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytesOf) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    return {"content": [dict(_chat_token(entry.token, entry.logprob, token_bytes),
                             top_logprobs=[_chat_token(token, logprob, token_bytes) for token, logprob in entry.top])
                        for entry in entries],
            "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytesOf,
                        offsets: Sequence[int]) -> dict[str, Any]:
    """A completion choice's (or chunk's) `logprobs`: tokens, token_logprobs, top_logprobs (each position's most
    likely tokens and the chosen one, by text; two tokens of the same text, which only an added token and a plain
    one can be, show once, with the higher figure) and text_offset (`offsets`: where each token's text starts in
    the completion's text)."""
    tokens = [token_text(token_bytes(entry.token)) for entry in entries]
    return {"tokens": tokens,
            "token_logprobs": [_shown(entry.logprob) for entry in entries],
            "top_logprobs": [_top_map([*entry.top, (entry.token, entry.logprob)], token_bytes) for entry in entries],
            "text_offset": list(offsets)}


# Private functions

def _chat_token(token: int, logprob: float, token_bytes: TokenBytesOf) -> dict[str, Any]:
    raw = token_bytes(token)
    return {"token": token_text(raw), "logprob": _shown(logprob), "bytes": list(raw)}


def _top_map(pairs: Sequence[tuple[int, float]], token_bytes: TokenBytesOf) -> dict[str, float]:
    """Texts to figures, in the order given (the most likely first, the chosen token last), a text met again keeping
    the higher figure."""
    shown: dict[str, float] = {}
    for token, logprob in pairs:
        text = token_text(token_bytes(token))
        figure = _shown(logprob)
        if text not in shown or figure > shown[text]:
            shown[text] = figure
    return shown


def _shown(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY
