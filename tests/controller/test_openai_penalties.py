"""The API's presence_penalty, frequency_penalty and logit_bias: a completion and a chat give the text the engine
gives with the same penalties and bias (greedy, f32), whole and streamed, and a bias of -100 keeps a token out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deskfleet.controller.engine import StreamRequest
from deskfleet.controller.engine_service import EngineService
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

from .test_engine import run_streams
from .test_openai_api import MODEL, events, post, serving

ADJUST = {"presence_penalty": 0.6, "frequency_penalty": 1.1}


@pytest.fixture(scope="module")
def served(tiny_export: Path) -> Iterator[tuple[str, EngineService]]:
    with serving(tiny_export) as server:
        yield server


def test_a_completion_with_penalties_and_a_bias_gives_the_engines_text(served: tuple[str, EngineService],
                                                                      tiny_export: Path) -> None:
    url, service = served
    tokenizer = ModelTokenizer(tiny_export)
    ids = tokenizer.encode("the quick brown fox")
    plain = run_streams(tiny_export, [StreamRequest(ids, max_new_tokens=20, ignore_eos=True)])[0]
    banned = plain[0]
    bias = ((banned, -100.0), (plain[5], 3.0))
    expected = run_streams(tiny_export, [StreamRequest(ids, max_new_tokens=20, ignore_eos=True, logit_bias=bias,
                                                       **ADJUST)])[0]  # type: ignore[arg-type]
    assert expected != plain and banned not in expected
    body = {"model": MODEL, "prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(token): value for token, value in bias}, **ADJUST}
    status, reply = post(f"{url}/v1/completions", body)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == tokenizer.decode(expected)
    found = events(f"{url}/v1/completions", body)
    assert "".join(item["choices"][0]["text"] for item in found[:-1]) == tokenizer.decode(expected)
    assert service.live_streams == 0


def test_a_chat_with_penalties_gives_the_engines_reply(served: tuple[str, EngineService], tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    messages = [ChatMessage("user", "Say something long.")]
    ids = tokenizer.encode_chat(messages)
    stops = tokenizer.end_of_turn_ids()
    expected = run_streams(tiny_export, [StreamRequest(ids, max_new_tokens=16, stop_token_ids=stops,
                                                       **ADJUST)])[0]  # type: ignore[arg-type]
    assert expected != run_streams(tiny_export, [StreamRequest(ids, max_new_tokens=16, stop_token_ids=stops)])[0]
    status, reply = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content":
                                                         "Say something long."}], "max_tokens": 16,
                                                         "temperature": 0, **ADJUST})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(expected)
