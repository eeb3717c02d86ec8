"""A server with a prefix cache (`serve --prefix-cache-tokens`): a chat's next turn, which sends the conversation
again, starts from the KV state the last turn left on the stages; its reply is the one a fresh engine gives the whole
conversation, and its usage says how many prompt tokens came from the cache, whole and streamed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
