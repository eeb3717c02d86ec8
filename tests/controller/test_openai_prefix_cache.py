"""A server with a prefix cache (`serve --prefix-cache-tokens`): a chat's next turn, which sends the conversation
again, starts from the KV state the last turn left on the stages; its reply is the one a fresh engine gives the whole
conversation, and its usage says how many prompt tokens came from the cache, whole and streamed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deskfleet.controller.engine import EngineOptions, StreamRequest
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

from .test_engine import run_streams
from .test_openai_api import MODEL, events, post, serving

SYSTEM = "You answer in one line. " * 12


def _reply(model: Path, tokenizer: ModelTokenizer, messages: list[ChatMessage]) -> str:
    tokens = run_streams(model, [StreamRequest(tokenizer.encode_chat(messages), max_new_tokens=12,
                                               stop_token_ids=tokenizer.end_of_turn_ids())])[0]
    return tokenizer.decode(tokens)


def _body(messages: list[ChatMessage], **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": m.role, "content": m.content} for m in messages],
            "max_completion_tokens": 12, "temperature": 0, **more}


def test_a_chats_next_turn_takes_the_last_turns_state_and_says_so_in_its_usage(tiny_export: Path) -> None:
    tokenizer = ModelTokenizer(tiny_export)
    first = [ChatMessage("system", SYSTEM), ChatMessage("user", "Name a colour.")]
    with serving(tiny_export, options=EngineOptions(max_rows=4, micro_batches=2, prefix_cache_tokens=4096)) as (
            url, service):
        status, reply = post(f"{url}/v1/chat/completions", _body(first))
        assert status == 200, reply
        said = reply["choices"][0]["message"]["content"]
        assert said == _reply(tiny_export, tokenizer, first)
        assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = [*first, ChatMessage("assistant", said), ChatMessage("user", "And another.")]
        status, reply = post(f"{url}/v1/chat/completions", _body(second))
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"] == _reply(tiny_export, tokenizer, second)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        # at least the first turn's whole prompt: its reply re-encodes to tokens of its own
        assert len(tokenizer.encode_chat(first)) <= cached < reply["usage"]["prompt_tokens"]
        # the same turn again, streamed: the state the second turn left serves it
        found = events(f"{url}/v1/chat/completions", _body(second, stream_options={"include_usage": True}))
        assert found[-1] == "[DONE]"
        assert "".join(item["choices"][0]["delta"].get("content", "") for item in found[:-2]) == \
            reply["choices"][0]["message"]["content"]
        assert found[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokenizer.encode_chat(second)) - 1
        assert service.live_streams == 0


def test_best_ofs_cached_tokens_count_every_candidate_whichever_wins(tiny_export: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # only the returned candidates were counted: with echo and logprobs the first candidate scores the prompt, fed
    # whole past the cache, so the same request said 0 or the whole prefix by which candidate ranked best
    from deskfleet.controller import openai_api

    def first_n(ended: list[Any], n: int) -> list[Any]:
        return ended[:n]  # the prompt's scorer wins

    monkeypatch.setattr(openai_api, "_best", first_n)
    prompt = "def add(a, b):\n    return a + b\n" * 4
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 1.0, "seed": 3}
    with serving(tiny_export, options=EngineOptions(max_rows=4, micro_batches=1, prefix_cache_tokens=4096)) as (
            url, _):
        status, reply = post(f"{url}/v1/completions", request)  # leaves the prompt's state in the cache
        assert status == 200, reply
        status, reply = post(f"{url}/v1/completions", {**request, "best_of": 3, "echo": True, "logprobs": 0})
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, reply["usage"]
