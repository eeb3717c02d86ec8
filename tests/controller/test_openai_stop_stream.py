"""A streamed reply with stop sequences: only text that may begin one is held back, each chunk carries whole tokens'
text with those tokens' log-probabilities, and usage counts the reply's tokens up to the stop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from deskfleet.common.logprobs import TokenLogprob
from deskfleet.controller.engine import StreamRequest
from deskfleet.controller.engine_service import StreamEnd
from deskfleet.controller.openai_api import OpenAiApi, ReplyText, _Choice
from deskfleet.controller.openai_requests import ApiError
from deskfleet.controller.tokenizer import ModelTokenizer

WORDS = ["alpha", " beta", " gamma", " delta", " epsilon", " zeta"]  # a token each: a token's text spans characters
TEXT = "".join(WORDS)


class _WordTokenizer:
    """A tokenizer whose token i is WORDS[i] (what TextPrinter asks of one)."""

    @staticmethod
    def decode(tokens: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(WORDS[token] for token in tokens)

    @staticmethod
    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        assert text == TEXT
        return list(range(len(WORDS)))

    @staticmethod
    def token_bytes(token: int) -> bytes:
        return WORDS[token].encode()


def _tokenizer() -> ModelTokenizer:
    return cast(ModelTokenizer, _WordTokenizer())


class _Bridge:
    """The events a stream's sink got, handed over in the batches given."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self._batches = batches

    async def take(self) -> list[Any]:
        return self._batches.pop(0)


def _tokens(tokenizer: ModelTokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def _choice(tokenizer: ModelTokenizer, stops: tuple[str, ...], batches: list[list[Any]]) -> _Choice:
    return _Choice(0, StreamRequest([1], logprobs=0), _Bridge(batches), ReplyText(tokenizer, stops),  # type: ignore[arg-type]
                   show_logprobs=True)


def _api(cancelled: list[int], tokenizer: Any = None) -> OpenAiApi:
    """An OpenAiApi with what _pieces and _gather use: the service's cancel, and the tokenizer."""
    api = OpenAiApi.__new__(OpenAiApi)
    api.service = SimpleNamespace(cancel=cancelled.append)  # type: ignore[assignment]
    api.tokenizer = tokenizer
    return api


def _event(token: int) -> Any:
    """A token as the engine hands it over, with a log-probability that names it (see _chunk_tokens)."""
    return token, TokenLogprob(token, -(token + 1.0))


def _chunk_tokens(logprobs: dict[str, Any]) -> list[int]:
    return [int(-value - 1) for value in logprobs["token_logprobs"]]


def _streamed(tokenizer: ModelTokenizer, stops: tuple[str, ...], batch: int = 1) -> list[tuple[str, list[int]]]:
    """(text, the tokens of its log-probabilities) of each piece a stream of TEXT's tokens, `batch` a hand-over,
    makes."""
    events = [_event(token) for token in _tokens(tokenizer)]
    batches = [events[at:at + batch] for at in range(0, len(events), batch)] + [[StreamEnd(None)]]
    choice = _choice(tokenizer, stops, batches)

    async def run() -> list[tuple[str, list[int]]]:
        return [(piece, _chunk_tokens(logprobs))
                async for piece, logprobs, _ in _api([], tokenizer)._pieces(choice, chat=False)]

    return asyncio.run(run())


def test_a_stop_that_never_comes_holds_nothing_back() -> None:
    # a 20-character stop held back the last 19 characters of the stream all along, cutting chunks mid-token
    tokenizer = _tokenizer()
    assert _streamed(tokenizer, ("Z" * 20,)) == _streamed(tokenizer, ())
    pieces = _streamed(tokenizer, ("Z" * 20,))
    assert all(len(tokens) == 1 for _, tokens in pieces[:-1])  # a chunk a token, each with its own entry


def test_text_that_may_begin_a_stop_waits_with_its_tokens_and_chunks_carry_their_tokens_entries() -> None:
    tokenizer = _tokenizer()
    ids = _tokens(tokenizer)
    stop = "gamma dX"  # begins at " gamma", and the text goes past it at "delta"
    pieces = _streamed(tokenizer, (stop,))
    assert "".join(piece for piece, _ in pieces) == tokenizer.decode(ids)
    shown: list[int] = []
    sent = ""
    for piece, tokens in pieces:  # each piece is the text of the tokens whose entries it carries
        shown += tokens
        sent += piece
        assert tokenizer.decode(shown) == sent
    assert shown == ids
    held = [piece for piece, tokens in pieces if len(tokens) > 1]
    assert held and all("gamma" in piece for piece in held)  # only the text that began the stop waited


def test_a_stop_met_ends_the_text_before_it_and_its_entries_with_the_token_that_completed_it() -> None:
    tokenizer = _tokenizer()
    ids = _tokens(tokenizer)
    pieces = _streamed(tokenizer, ("a de",))
    text = "".join(piece for piece, _ in pieces)
    assert text == TEXT[:TEXT.find("a de")]
    entries = [token for _, tokens in pieces for token in tokens]
    completing = next(at for at in range(len(ids)) if "a de" in tokenizer.decode(ids[:at + 1]))
    assert entries == ids[:completing + 1]


def test_usage_counts_the_tokens_up_to_the_stop_not_those_made_past_it() -> None:
    # a drafted round or a step in flight made tokens past the stop before the stream was cancelled: all counted,
    # 17 for a reply of 3, and a different count for the same greedy request
    tokenizer = _tokenizer()
    ids = _tokens(tokenizer)
    completing = next(at for at in range(len(ids)) if "beta" in tokenizer.decode(ids[:at + 1]))
    events = [_event(token) for token in ids]
    cancelled: list[int] = []
    choice = _choice(tokenizer, ("beta",), [events, [StreamEnd(None)]])  # every token handed over at once
    _, tokens = asyncio.run(_api(cancelled, tokenizer)._gather(choice))
    assert tokens == completing + 1 == choice.tokens < len(ids)
    assert [entry.token for entry in choice.logprobs] == ids[:completing + 1]
    assert choice.reply.text == TEXT[:TEXT.find("beta")] and cancelled


class _ByteTokenizer:
    """A tokenizer whose tokens are bytes: `é` (c3 a9) is two tokens, the first of which decodes to U+FFFD alone."""

    PIECES = (b"ab", b"\xc3", b"\xa9", b"cd")

    @classmethod
    def decode(cls, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(cls.PIECES[token] for token in tokens).decode("utf-8", errors="replace")

    @classmethod
    def token_bytes(cls, token: int) -> bytes:
        return cls.PIECES[token]


def _pieces_of(tokenizer: Any, tokens: list[int], stops: tuple[str, ...]) -> list[tuple[str, list[int]]]:
    batches = [[_event(token)] for token in tokens] + [[StreamEnd(None)]]
    choice = _choice(cast(ModelTokenizer, tokenizer), stops, batches)

    async def run() -> list[tuple[str, list[int]]]:
        return [(piece, _chunk_tokens(logprobs))
                async for piece, logprobs, _ in _api([], tokenizer)._pieces(choice, chat=False)]

    return asyncio.run(run())


def test_a_tokens_entry_waits_for_its_text_when_it_ends_inside_a_character() -> None:
    # the first byte of "é" was released (its entry sent) in a chunk of no text, before its character was written
    pieces = _pieces_of(_ByteTokenizer, [0, 1, 2, 3], ())
    assert [piece for piece in pieces if piece != ("", [])] == [("ab", [0]), ("é", [1, 2]), ("cd", [3])]
    # and with a stop that "é" begins, the entries of both its bytes wait with it
    pieces = _pieces_of(_ByteTokenizer, [0, 1, 2, 3], ("é!",))
    assert [piece for piece in pieces if piece != ("", [])] == [("ab", [0]), ("écd", [1, 2, 3])]


def test_a_failure_after_a_stop_ended_the_text_is_the_choices_normal_end() -> None:
    # the run failed within the feed that reaped the stop's cancel: the stream ended with the error, and the whole
    # request was answered 503 (a streamed one cut its other choices off), its complete text thrown away
    tokenizer = _tokenizer()
    events = [_event(token) for token in _tokens(tokenizer)]
    failed = StreamEnd(None, "the run failed: a PC went away")
    choice = _choice(tokenizer, ("beta",), [events, [failed]])
    end, _ = asyncio.run(_api([], tokenizer)._gather(choice))
    assert end.error is None and choice.reply.text == TEXT[:TEXT.find("beta")]
    choice = _choice(tokenizer, ("beta",), [events, [failed]])

    async def streamed() -> list[tuple[str, StreamEnd | None]]:
        return [(piece, end) async for piece, _, end in _api([], tokenizer)._pieces(choice, chat=False)]

    pieces = asyncio.run(streamed())
    assert "".join(piece for piece, _ in pieces) == TEXT[:TEXT.find("beta")]
    last = pieces[-1][1]
    assert last is not None and last.error is None
    # a choice whose text did not end fails as before
    choice = _choice(tokenizer, (), [events[:2], [failed]])
    with pytest.raises(ApiError, match="the generation failed: the run failed: a PC went away"):
        asyncio.run(_api([], tokenizer)._gather(choice))
