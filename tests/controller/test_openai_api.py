"""`deskfleet serve`'s OpenAI-compatible API over a real EngineService (f32, 2 local stages), through HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web

from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.engine import EngineOptions, StreamRequest
from deskfleet.controller.engine_service import ChainOpener, EngineService
from deskfleet.controller.openai_api import OpenAiApi, ReplyText
from deskfleet.controller.openai_requests import ApiError, parse_completion
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

from .test_engine import run_streams
from .test_engine_service import BreakingChain, _local, _wrapped

MODEL = "tiny"
STAGES = 2


@contextmanager
def serving(model: Path, api_key: str | None = None, max_streams: int = 64, opener: ChainOpener | None = None,
            hosts: frozenset[str] | None = None, name: str = "tiny", options: EngineOptions | None = None
            ) -> Iterator[tuple[str, EngineService]]:
    """The API on 127.0.0.1 at a free port, its event loop on a thread of its own; yields its base URL."""
    manifest = load_manifest(model)
    engine_options = options or EngineOptions(max_rows=4, micro_batches=2)
    service = EngineService(opener or _local(model, STAGES), manifest.spec, None,
                            lambda chain: engine_options, max_streams=max_streams)
    service.start()
    api = OpenAiApi(service, ModelTokenizer(model), manifest.spec, name, api_key, hosts)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict[str, Any] = {}

    async def run() -> None:
        runner = api.runner()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["port"] = runner.addresses[0][1]
        state["stop"] = stop = asyncio.Event()
        started.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield f"http://127.0.0.1:{state['port']}", service
    finally:
        loop.call_soon_threadsafe(state["stop"].set)
        thread.join(30)
        service.close()


def post(url: str, body: object, key: str | None = None) -> tuple[int, dict[str, Any]]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def events(url: str, body: dict[str, Any]) -> list[Any]:
    """A streamed request's server-sent events, decoded ("[DONE]" as the string)."""
    request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = response.read().decode().split("\n\n")
    found = [line.removeprefix("data: ") for line in lines if line]
    return [item if item == "[DONE]" else json.loads(item) for item in found]


def greedy(model: Path, prompt: list[int], tokens: int) -> list[int]:
    return run_streams(model, [StreamRequest(prompt, max_new_tokens=tokens)])[0]


@pytest.fixture(scope="module")
def served(tiny_export: Path) -> Iterator[tuple[str, EngineService]]:
    with serving(tiny_export) as server:
        yield server


def test_completions_give_what_the_engine_gives_alone_whole_streamed_and_concurrent(
        served: tuple[str, EngineService], tiny_export: Path) -> None:
    url, service = served
    tokenizer = ModelTokenizer(tiny_export)
    prompts = ["def add(a, b):", "import os\n", "class Point:", "x = [1, 2,"]
    expected = [tokenizer.decode(greedy(tiny_export, tokenizer.encode(text), 20)) for text in prompts]
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": prompts[0], "max_tokens": 20,
                                                  "temperature": 0})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == expected[0]
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompts[0]))
    assert body["usage"]["completion_tokens"] + body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"]
    # token ids as the prompt
    ids = tokenizer.encode(prompts[1])
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 20, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected[1]
    # four at once: streams of one engine, batched, each as alone
    with ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(lambda text: post(f"{url}/v1/completions", {"model": MODEL, "prompt": text,
                                                                          "max_tokens": 20, "temperature": 0}),
                               prompts))
    assert [body["choices"][0]["text"] for _, body in bodies] == expected
    # streamed: the pieces add up to the same text, then the finish, the usage and [DONE]
    found = events(f"{url}/v1/completions", {"model": MODEL, "prompt": prompts[2], "max_tokens": 20,
                                             "temperature": 0, "stream_options": {"include_usage": True}})
    assert found[-1] == "[DONE]"
    chunks = [item for item in found[:-1] if item["choices"]]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == expected[2]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] in ("stop", "length")
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    assert found[-2]["choices"] == [] and found[-2]["usage"]["prompt_tokens"] == len(tokenizer.encode(prompts[2]))
    assert all("usage" in item and item["usage"] is None for item in found[:-2])  # OpenAI's: null before the last
    assert service.live_streams == 0


def test_chat_completions_render_the_template_and_stream_the_reply(served: tuple[str, EngineService],
                                                                  tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Say something.")]
    stop = tokenizer.end_of_turn_ids()
    ids = tokenizer.encode_chat(messages)
    tokens = run_streams(tiny_export, [StreamRequest(ids, max_new_tokens=16, stop_token_ids=stop)])[0]
    expected = tokenizer.decode(tokens)
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": [{"type": "text", "text": "Say "},
                                                                      {"type": "text", "text": "something."}]}],
            "max_completion_tokens": 16, "temperature": 0}
    status, reply = post(f"{url}/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                              "total_tokens": len(ids) + len(tokens), "prompt_tokens_details": {"cached_tokens": 0}}
    found = events(f"{url}/v1/chat/completions", body)
    assert found[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert found[-1] == "[DONE]"
    assert "".join(item["choices"][0]["delta"].get("content", "") for item in found[:-1]) == expected


def test_a_stop_sequence_cuts_the_text_whole_and_streamed(served: tuple[str, EngineService],
                                                         tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    full = tokenizer.decode(greedy(tiny_export, tokenizer.encode("def add(a, b):"), 40))
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "the random model's text has no stop sequence to pick"
    expected = full[:full.find(stop)]
    request = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0,
               "stop": [stop, "\x00never"]}
    status, body = post(f"{url}/v1/completions", request)
    assert status == 200 and body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    found = events(f"{url}/v1/completions", request)
    assert "".join(item["choices"][0]["text"] for item in found[:-1]) == expected
    assert found[-2]["choices"][0]["finish_reason"] == "stop"


def test_sampling_with_a_seed_is_reproducible(served: tuple[str, EngineService]) -> None:
    url, _ = served
    request = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 24, "temperature": 1.0, "top_p": 0.9,
               "seed": 7}
    first, second = (post(f"{url}/v1/completions", request)[1]["choices"][0]["text"] for _ in range(2))
    assert first == second
    other = post(f"{url}/v1/completions", {**request, "seed": 8})[1]["choices"][0]["text"]
    assert other != first


def test_a_top_p_of_0_samples_the_most_likely_token_as_the_api_takes_it(served: tuple[str, EngineService],
                                                                         tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    expected = tokenizer.decode(greedy(tiny_export, tokenizer.encode("def add(a, b):"), 12))
    for seed in (1, 2):
        status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12,
                                                      "temperature": 1.5, "top_p": 0, "seed": seed})
        assert status == 200 and body["choices"][0]["text"] == expected, body


def test_several_choices_are_streams_of_one_prompt_each_as_a_request_alone(served: tuple[str, EngineService],
                                                                            tiny_export: Path) -> None:
    url, service = served
    tokenizer = ModelTokenizer(tiny_export)
    tokens = greedy(tiny_export, tokenizer.encode("def add(a, b):"), 12)
    expected = tokenizer.decode(tokens)
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12,
                                                  "temperature": 0, "n": 3})
    assert status == 200, body
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert [choice["text"] for choice in body["choices"]] == [expected] * 3
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("def add(a, b):"))  # the prompt counted once
    assert body["usage"]["completion_tokens"] == 3 * len(tokens)
    # sampled: choice i draws as a request alone with the seed + i
    request = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 1.0, "seed": 7}
    several = [choice["text"] for choice in post(f"{url}/v1/completions", {**request, "n": 2})[1]["choices"]]
    alone = [post(f"{url}/v1/completions", {**request, "seed": seed})[1]["choices"][0]["text"] for seed in (7, 8)]
    assert several == alone and alone[0] != alone[1]
    # streamed chat: each choice's chunks name its index, each ends with its finish; one usage, then [DONE]
    found = events(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 10, "temperature": 1.0, "seed": 3, "n": 2,
                                                  "stream_options": {"include_usage": True}})
    assert found[-1] == "[DONE]" and found[-2]["choices"] == []
    chunks = [item["choices"][0] for item in found[:-2]]
    assert all(len(item["choices"]) == 1 for item in found[:-2])
    made = 0
    for index in (0, 1):
        mine = [chunk for chunk in chunks if chunk["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] in ("stop", "length") and mine[-1]["delta"] == {}
        assert all(chunk["finish_reason"] is None for chunk in mine[:-1])
        alone_chat = post(f"{url}/v1/chat/completions", {"model": MODEL, "max_tokens": 10, "temperature": 1.0,
                                                         "seed": 3 + index,
                                                         "messages": [{"role": "user", "content": "hi"}]})[1]
        assert "".join(chunk["delta"].get("content", "") for chunk in mine) == \
            alone_chat["choices"][0]["message"]["content"]
        made += alone_chat["usage"]["completion_tokens"]
    assert found[-2]["usage"]["completion_tokens"] == made
    assert service.live_streams == 0


def test_several_prompts_each_get_their_choices_in_order_each_as_a_request_alone(served: tuple[str, EngineService],
                                                                                  tiny_export: Path) -> None:
    # as OpenAI's completions take a batch: evaluation harnesses send their prompts so
    url, service = served
    tokenizer = ModelTokenizer(tiny_export)
    prompts = ["def add(a, b):", "import os\n", [5, 6, 7]]
    ids = [tokenizer.encode(prompt) if isinstance(prompt, str) else prompt for prompt in prompts]
    expected = [greedy(tiny_export, prompt_ids, 10) for prompt_ids in ids]
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 10,
                                                  "temperature": 0, "n": 2})
    assert status == 200, body
    assert [choice["index"] for choice in body["choices"]] == list(range(6))  # prompt by prompt, as the API's
    assert [choice["text"] for choice in body["choices"]] == [tokenizer.decode(tokens) for tokens in expected
                                                              for _ in range(2)]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))  # each prompt once
    assert body["usage"]["completion_tokens"] == 2 * sum(map(len, expected))
    found = events(f"{url}/v1/completions", {"model": MODEL, "prompt": prompts[:2], "max_tokens": 10,
                                             "temperature": 0})
    for index in (0, 1):
        assert "".join(item["choices"][0]["text"] for item in found[:-1]
                       if item["choices"][0]["index"] == index) == tokenizer.decode(expected[index])
    assert service.live_streams == 0


@pytest.mark.parametrize(("body", "status", "says"), [
    ("not json", 400, "not JSON"),
    ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "unrecognized request argument(s): bogus"),
    ({"model": MODEL, "prompt": "x", "n": 17}, 400, "n must be a whole number from 1 to 16"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n must be a whole number from 1 to 16"),
    ({"model": MODEL, "prompt": "x", "n": True}, 400, "n must be a whole number from 1 to 16"),
    ({"model": MODEL, "prompt": "x", "best_of": 1, "n": 2}, 400, "best_of must be a whole number from n (2) to 16"),
    ({"model": MODEL, "prompt": "x", "best_of": 17}, 400, "best_of must be a whole number from n (1) to 16"),
    ({"model": MODEL, "prompt": "x", "best_of": 2.5}, 400, "best_of must be a whole number"),
    ({"model": MODEL, "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of above n is answered whole"),
    ({"model": MODEL, "prompt": "x", "best_of": 2, "suffix": "y"}, 400, "suffix='y' is not supported"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty must be a number from -2 to 2"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty must be a number from -2"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias key 'a' is not a token id"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias of token 5 must be a number from"),
    ({"model": MODEL, "prompt": "x", "logit_bias": [5]}, 400, "logit_bias must be an object of at most 300"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"10000000": 1}}, 400, "logit_bias token 10000000 is outside"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias key '1111"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"1": 10**400}}, 400, "logit_bias of token 1 must be a number"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 10**400}, 400, "presence_penalty must be a number from"),
    ({"model": MODEL, "prompt": "x", "temperature": -10**400}, 400, "temperature must be a number from 0 to 2"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' does not exist here"),
    ({"prompt": "x"}, 400, "model is required"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "exceed the model's context"),
    ({"model": MODEL, "prompt": [1, 2, 10**7]}, 400, "outside the model's vocabulary"),
    ({"model": MODEL, "prompt": ["a", []]}, 400, "prompt[1] must be a string or a non-empty list of token ids"),
    ({"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt lists 65 prompts: at most 64 a request"),
    ({"model": MODEL, "prompt": [[1, 2], "x", 5]}, 400, "prompt[2] must be a string or a non-empty list of token"),
    ({"model": MODEL, "prompt": [[1, 2], [3, 10**7]]}, 400, "prompt[1]: token id 10000000 is outside the model's"),
    ({"model": MODEL, "prompt": []}, 400, "prompt must be a string, a non-empty list of token ids, or a list of"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature must be a number from 0 to 2"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "list of up to 4"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "x" * 1001]}, 400, "a stop sequence must be at most 1,000"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "only with stream"),
    ("[" * 100_000 + "]" * 100_000, 400, "not JSON that can be read"),
    ('{"model": "tiny", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", 400,
     "not JSON that can be read: a number in it has more digits than any field takes"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2**63}, 400, "max_tokens must be at most 9223372036854775807"),
    ({"model": MODEL, "prompt": "x", "user": 5}, 400, "user must be a string"),
    ({"model": MODEL, "prompt": "x", "store": "yes"}, 400, "store must be true or false"),
    ({"model": MODEL, "prompt": "x", "metadata": {"k": 1}}, 400, "metadata must be an object of at most 16 keys"),
    ({"model": MODEL, "prompt": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata must be"),
    ({"model": MODEL, "prompt": "x", "metadata": {"k" * 65: "v"}}, 400, "metadata must be"),
    ({"model": MODEL, "prompt": "x" * 10**6}, 400, "characters cannot fit the model's context"),
])
def test_a_bad_request_gets_the_apis_error_naming_what_is_wrong(served: tuple[str, EngineService], body: object,
                                                               status: int, says: str) -> None:
    url, service = served
    got, answer = post(f"{url}/v1/completions", body)
    assert got == status and says in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert service.live_streams == 0


@pytest.mark.parametrize(("body", "says", "param"), [
    # a role that is a list or an object was a 500 (unhashable), its traceback logged at ERROR
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role must be one of", "messages[0].role"),
    ({"messages": [{"role": {}, "content": "hi"}]}, "messages[0].role must be one of", "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name must be a string",
     "messages[0].name"),
    ({"messages": [{"role": "r" * 10**6, "content": "hi"}]}, "got 'rrrr", "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi", "x" * 10**6: 1}]}, "unrecognized field(s) xxx",
     "messages[0]." + "x" * 57 + "..."),
    ({"messages": [{"role": "user", "content": "hi"}], "y" * 10**6: 1}, "unrecognized request argument(s): yyy",
     "y" * 57 + "..."),
    ({"messages": [{"role": "user", "content": "hi"}], **{f"f{i:02}": 1 for i in range(20)}},
     "f00, f01, f02, f03, f04, f05, f06, f07 and 12 more", "f00"),
])
def test_a_bad_chat_request_is_refused_naming_the_field_and_saying_back_60_characters_at_most(
        served: tuple[str, EngineService], body: dict[str, Any], says: str, param: str) -> None:
    # a 3 MB field name, model or role came back whole, twice (message and param): a 6 MB answer
    url, _ = served
    got, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, **body})
    assert got == 400 and says in answer["error"]["message"] and answer["error"]["param"] == param, answer
    assert len(answer["error"]["message"]) < 300


def test_a_model_name_that_does_not_exist_is_said_back_60_characters_at_most(served: tuple[str, EngineService]) -> None:
    url, _ = served
    got, answer = post(f"{url}/v1/completions", {"model": "m" * 10**6, "prompt": "x"})
    assert got == 404 and answer["error"]["message"].startswith("the model 'mmmm") and len(str(answer)) < 400
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/v1/models/{'m' * 7000}", timeout=30)
    assert refused.value.code == 404 and len(refused.value.read()) < 400


def test_the_prompt_size_cap_allows_the_models_longest_tokens(tiny_export: Path) -> None:
    """The cap on a prompt's characters (checked before tokenizing) was 32 a token of context: the demo model has a
    token of 64 '#'s, and 38,400 of them (601 tokens) were refused as unable to fit its 1,024."""
    tokenizer = ModelTokenizer(Path(__file__).resolve().parents[2] / "assets" / "models" / "target")
    assert tokenizer.longest_token_chars == 64 == len(tokenizer.decode(tokenizer.encode("#" * 64)[-1:]))
    context = 1024
    api = OpenAiApi(cast(EngineService, None), tokenizer, replace(load_manifest(tiny_export).spec, max_context=context),
                    MODEL)
    api._check_length(38_400, "prompt")
    assert len(tokenizer.encode("#" * 38_400)) == 601 <= context
    api._check_length(64 * context, "prompt")
    with pytest.raises(ApiError, match=r"prompt: 65537 characters cannot fit the model's context of 1024 tokens "
                                       r"\(more than 64 characters a token, its longest token's length\)"):
        api._check_length(64 * context + 1, "prompt")


def test_a_prompt_that_fills_the_context_is_refused_in_words_that_fit_what_was_asked(
        served: tuple[str, EngineService], tiny_export: Path) -> None:
    # a scoring request (echo, max_tokens 0) was told its prompt "leaves no room for a reply", which it had not asked
    url, _ = served
    context = load_manifest(tiny_export).spec.max_context
    for extra, says in [({}, "which leaves no room for a reply"),
                        ({"echo": True, "logprobs": 1, "max_tokens": 0},
                         "which leaves no room for the one token that scoring it makes (also with max_tokens 0)")]:
        status, answer = post(f"{url}/v1/completions", {"model": MODEL, "prompt": [5] * context, **extra})
        assert status == 400 and answer["error"]["message"] == (
            f"the prompt is {context} tokens: the model's context is {context}, {says}"), answer


def test_chat_errors(served: tuple[str, EngineService]) -> None:
    url, _ = served
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]})
    assert status == 400 and answer["error"]["param"] == "messages[0].tool_calls"
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "content": "x", "colour": "red"}]})
    assert status == 400 and answer["error"]["param"] == "messages[0].colour"
    # the placeholders clients send for what is not used: taken
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "x", "name": "ann"},
        {"role": "assistant", "content": "y", "tool_calls": [], "refusal": None, "audio": None},
        {"role": "user", "content": "z"}]})
    assert status == 200, answer
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "x" * 10**6}]})
    assert status == 400 and "characters cannot fit" in answer["error"]["message"]
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool",
                                                                                      "content": "x"}]})
    assert status == 400 and answer["error"]["param"] == "messages[0].role"
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400 and "non-empty list" in answer["error"]["message"]
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert status == 400 and "images and audio are not supported" in answer["error"]["message"]
    status, answer = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                        "response_format": {"type": "json_object"}})
    assert status == 400 and answer["error"]["param"] == "response_format"


def test_what_the_openai_sdk_sends_is_taken_as_the_api_takes_it(served: tuple[str, EngineService]) -> None:
    """From an exploratory test with the official openai package: each of these was refused with a 400, or named
    the wrong field."""
    url, _ = served
    chat = f"{url}/v1/chat/completions"
    hello = [{"role": "user", "content": "hi"}]
    # a follow-up that replays the reply as the SDK's ChatCompletionMessage.model_dump() gives it
    reply = {"role": "assistant", "content": "y", "refusal": None, "annotations": None, "audio": None,
             "function_call": None, "tool_calls": None}
    status, answer = post(chat, {"model": MODEL, "max_tokens": 2, "messages": [*hello, reply, *hello]})
    assert status == 200, answer
    # caller metadata the SDK offers as arguments, and the API's defaults as clients send them: taken
    status, answer = post(chat, {"model": MODEL, "max_tokens": 2, "messages": hello, "safety_identifier": "u1",
                                 "prompt_cache_key": "k", "modalities": ["text"], "verbosity": "medium", "stop": []})
    assert status == 200, answer
    found = events(chat, {"model": MODEL, "max_tokens": 2, "messages": hello,
                          "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert found[-1] == "[DONE]" and found[-2]["usage"]["completion_tokens"] == 2
    # the API's seed is any int64: a negative one counts modulo 2**63
    sampled = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 1.0}
    texts = [post(f"{url}/v1/completions", {**sampled, "seed": seed})[1]["choices"][0]["text"]
             for seed in (-1, 2**63 - 1)]
    assert texts[0] == texts[1]
    status, answer = post(f"{url}/v1/completions", {**sampled, "seed": -2**63 - 1})
    assert status == 400 and answer["error"]["param"] == "seed"
    # an over-long max_completion_tokens is named as it was sent
    status, answer = post(chat, {"model": MODEL, "messages": hello, "max_completion_tokens": 10**6})
    assert status == 400 and answer["error"]["param"] == "max_completion_tokens" and \
        "+ max_completion_tokens 1000000 exceed the model's context" in answer["error"]["message"], answer
    # what deskfleet does not do is refused naming the field and why, and says back at most a line of the value
    for field, value, why in [("modalities", ["text", "audio"], "deskfleet generates text only"),
                              ("reasoning_effort", "low", "deskfleet's models take no reasoning effort"),
                              ("tools", [{"type": "function", "function": {"name": "f" * 20_000}}],
                               "deskfleet does no tool or function calling")]:
        status, answer = post(chat, {"model": MODEL, "messages": hello, field: value})
        message = answer["error"]["message"]
        assert status == 400 and answer["error"]["param"] == field and message.endswith(f" is not supported: {why}") \
            and len(message) < 150, answer
    # a lone surrogate (JSON's "\\ud800") is named where it is, in the message's own characters
    status, answer = post(chat, {"model": MODEL, "messages": [*hello, {"role": "user", "content": "ab\ud800"}]})
    assert status == 400 and answer["error"]["param"] == "messages[1].content" and answer["error"]["message"] == \
        "messages[1].content is not valid UTF-8 text (character '\\ud800' at character 2)", answer
    # a model that is not here: the same error whichever route asks
    status, answer = post(chat, {"model": "gpt-4", "messages": hello})
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{url}/v1/models/gpt-4", timeout=30)
    retrieved = json.loads(missing.value.read())["error"]
    assert status == missing.value.code == 404
    assert (retrieved["type"], retrieved["code"]) == (answer["error"]["type"], answer["error"]["code"]) == \
        ("invalid_request_error", "model_not_found")
    # every answer names itself for a report, as the API's do
    assert missing.value.headers["x-request-id"].startswith("req_")
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        first = response.headers["x-request-id"]
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        assert response.headers["x-request-id"] != first


def test_models_health_and_unknown_paths(served: tuple[str, EngineService]) -> None:
    url, _ = served
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        listed = json.loads(response.read())
    assert [model["id"] for model in listed["data"]] == [MODEL]
    with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
        health = json.loads(response.read())
    assert health["status"] == "ok" and health["chains_reopened"] == 0 and health["chains_switched"] == 0
    assert health["stages"] == STAGES  # the chain it runs on now: a fleet's after a failover or a take-back
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{url}/v1/embeddings", timeout=30)
    assert missing.value.code == 404 and json.loads(missing.value.read())["error"]["type"] == "not_found_error"


def test_ignore_eos_runs_to_max_tokens(served: tuple[str, EngineService], tiny_export: Path) -> None:
    # non-standard, as vLLM's: what a benchmark needs for every user to make the same number of tokens
    url, _ = served
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 40,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 40
    tokens = run_streams(tiny_export, [StreamRequest([1, 2, 3], max_new_tokens=40, ignore_eos=True)])[0]
    assert body["choices"][0]["text"] == ModelTokenizer(tiny_export).decode(tokens)
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "ignore_eos": "yes"})
    assert status == 400 and body["error"]["param"] == "ignore_eos"


def test_a_completions_max_tokens_of_null_is_the_apis_default(served: tuple[str, EngineService]) -> None:
    url, _ = served
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": None,
                                                  "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] <= 16
    assert body["choices"][0]["finish_reason"] == "length" or body["usage"]["completion_tokens"] < 16


def test_a_web_page_cannot_drive_a_keyless_server(tiny_export: Path) -> None:
    # no key on loopback: a page's form or text/plain POST needs no preflight, and a DNS name rebound to 127.0.0.1
    # reaches the port with its own Host
    body = json.dumps({"model": "org/model-1", "prompt": "x", "max_tokens": 2, "temperature": 0}).encode()
    with serving(tiny_export, hosts=frozenset({"127.0.0.1", "localhost", "::1"}), name="org/model-1") as (url, _):
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "text/plain"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 415
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json",
                                                                        "Host": "evil.example:8000"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403 and "DNS rebinding" in json.loads(refused.value.read())["error"]["message"]
        # no Host header at all (HTTP/1.0): aiohttp stood the socket's address in for it, and it was answered
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
            answer = b""
            while chunk := raw.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.0 403") and b"no Host header: a request must name one of 127.0.0.1, ::1, " \
            b"localhost" in answer, answer[:300]
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json",
                                                                        "Host": "LocalHost"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        # the body is read as UTF-8 whatever charset the header names: an unknown one was a server error
        request = urllib.request.Request(f"{url}/v1/completions", body, {
            "Content-Type": "application/json; charset=bogus"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"{url}/v1/models/org/model-1", timeout=30) as response:  # an id with a slash
            assert json.loads(response.read())["id"] == "org/model-1"
        # a wrong path or method is named as such, not as a body that is not JSON (415 misled a client)
        for path, code in (("/v1/nothing", 404), ("/health", 405), ("/v1/models", 405)):
            request = urllib.request.Request(f"{url}{path}", b"", {"Content-Type": "text/plain"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == code, path


def test_a_request_aiohttp_cannot_parse_is_answered_400_and_its_log_goes_through_the_filter(
        served: tuple[str, EngineService]) -> None:
    # any client could fill the server's log with aiohttp's tracebacks (a duplicate Host header); what the filter
    # makes of such a record: the test below (in the whole suite, records of the server's thread did not reach caplog)
    from aiohttp.log import server_logger

    from deskfleet.controller.openai_api import _MALFORMED_REQUESTS

    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil\r\n\r\n")
        answer = client.recv(4096)
    assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request") and b"Duplicate 'Host'" in answer
    assert _MALFORMED_REQUESTS in server_logger.filters  # the logger aiohttp's request handlers log with


def test_the_malformed_request_filter_lowers_a_record_to_a_warning_at_most() -> None:
    from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod

    from deskfleet.controller.openai_api import _MALFORMED_REQUESTS

    def record(level: int, error: BaseException) -> logging.LogRecord:
        made = logging.LogRecord("aiohttp.server", level, __file__, 1, "Error handling request from %s",
                                 ("127.0.0.1",), (type(error), error, None))
        assert _MALFORMED_REQUESTS.filter(made)
        return made

    loud = record(logging.ERROR, BadHttpMessage("Duplicate 'Host' header found."))
    assert (loud.levelname, loud.exc_info) == ("WARNING", None)
    assert loud.getMessage() == "Error handling request from 127.0.0.1: refused (400 Duplicate 'Host' header found.)"
    quiet = record(logging.DEBUG, BadHttpMethod("\x16\x03"))  # aiohttp's own choice for TLS bytes: kept
    assert quiet.levelname == "DEBUG" and quiet.exc_info is None
    other = record(logging.ERROR, RuntimeError("a bug"))  # not a client's fault: its traceback stays
    assert other.levelname == "ERROR" and other.exc_info is not None
    # the rest of a body its Content-Encoding cannot decode, read by aiohttp after the 400 went: a traceback at ERROR
    # a request before, any client's to send
    undecodable = record(logging.ERROR, web.RequestPayloadError("Can not decode content-encoding: gzip"))
    assert (undecodable.levelname, undecodable.exc_info) == ("WARNING", None)
    assert undecodable.getMessage().endswith("a request body that cannot be read (Can not decode content-encoding: "
                                             "gzip)")


def test_an_api_key_is_required_once_set(tiny_export: Path) -> None:
    with serving(tiny_export, api_key="s3cret") as (url, _):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0}
        assert post(f"{url}/v1/completions", body)[0] == 401
        status, answer = post(f"{url}/v1/completions", body, key="wrong")
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        assert post(f"{url}/v1/completions", body, key="s3cret")[0] == 200
        port = int(url.rsplit(":", 1)[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Authorization", b"Bearer \xff")  # not ASCII: refused, not a server error
        connection.putheader("Content-Length", str(len(json.dumps(body))))
        connection.endheaders(json.dumps(body).encode())
        assert connection.getresponse().status == 401
        connection.close()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/v1/models", timeout=30)
        assert refused.value.code == 401
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:  # says nothing a client sends
            assert response.status == 200


def slow(model: Path) -> ChainOpener:
    """Local stages whose every step takes 20 ms more: a reply of hundreds of tokens outlasts the test's client."""
    return _wrapped(model, 2, lambda pipeline: BreakingChain(pipeline, delay=0.02))[0]


def long_stream(url: str, service: EngineService,
                n: int = 1) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion (of `n` choices) to the context's end, once its first event came."""
    connection = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": [1, 2, 3], "max_tokens": service.spec.max_context - 3, "temperature": 0,
        "stream": True, "n": n}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # it runs
    return connection, response


def test_a_client_that_goes_away_has_its_stream_cancelled_and_a_full_server_says_429(tiny_export: Path) -> None:
    with serving(tiny_export, max_streams=1, opener=slow(tiny_export)) as (url, service):
        connection, _ = long_stream(url, service)
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "x", "max_tokens": 2}).encode(), {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        answer = json.loads(refused.value.read())
        assert refused.value.code == 429 and "--max-streams 1" in answer["error"]["message"]
        assert refused.value.headers["Retry-After"] == "1"  # the OpenAI clients wait that long and ask again
        assert service.live_streams == 1
        connection.close()  # the client goes away mid-reply
        deadline = time.monotonic() + 30
        while service.live_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.live_streams == 0 and service.streams_cancelled == 1, "the stream of a client that went " \
            "away ran on"
        assert post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                              "temperature": 0})[0] == 200


def test_choices_are_taken_all_or_none_and_a_client_that_goes_away_cancels_them_all(tiny_export: Path) -> None:
    with serving(tiny_export, max_streams=2, opener=slow(tiny_export)) as (url, service):
        status, answer = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 3})
        assert status == 400 and answer["error"]["param"] == "n"  # never fits: no use retrying it
        assert "n=3 choices are more streams than this server takes at once (--max-streams 2)" in \
            answer["error"]["message"]
        status, answer = post(f"{url}/v1/completions", {"model": MODEL, "prompt": ["x", "y", "z"], "max_tokens": 2})
        assert status == 400 and answer["error"]["param"] == "prompt"
        assert "3 prompts of n=1 choices each are more streams than this server takes at once" in \
            answer["error"]["message"]
        connection, _ = long_stream(url, service)  # 1 of 2 taken
        status, answer = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2})
        assert status == 429 and "1 streams are running or waiting: 2 more would pass what this server takes " \
            "(--max-streams 2)" in answer["error"]["message"]
        assert service.live_streams == 1 and service.streams_cancelled == 0  # none of the 2 was queued
        connection.close()
        _wait_until_idle(service)
        before = service.streams_cancelled
        connection, _ = long_stream(url, service, n=2)
        assert service.live_streams == 2
        connection.close()  # the client goes away mid-reply
        _wait_until_idle(service)
        assert service.streams_cancelled == before + 2, "a choice of a client that went away ran on"


def test_choices_running_when_the_server_stops_end_the_reply_with_an_error(tiny_export: Path) -> None:
    with serving(tiny_export, opener=slow(tiny_export)) as (url, service):
        connection, response = long_stream(url, service, n=3)
        service.close()
        rest = response.read().decode()
        connection.close()
    assert rest.count('"error"') == 1 and "the server stopped" in rest  # said once, not once a choice
    assert rest.rstrip().endswith("data: [DONE]")


def test_a_choice_whose_reply_fails_ends_the_stream_with_its_error_not_a_hang(tiny_export: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pieces = OpenAiApi._pieces

    async def failing(self: OpenAiApi, choice: Any, chat: bool) -> AsyncIterator[Any]:
        if choice.index == 1:
            raise RuntimeError("boom")
        async for item in pieces(self, choice, chat):
            yield item

    monkeypatch.setattr(OpenAiApi, "_pieces", failing)
    with serving(tiny_export) as (url, service):
        found = events(f"{url}/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8,
                                                 "temperature": 0, "n": 2})
        _wait_until_idle(service)  # the other choice is cancelled, not left running
    errors = [item["error"]["message"] for item in found[:-1] if "error" in item]
    assert errors == ["the generation failed: RuntimeError: boom"] and found[-1] == "[DONE]"


def _wait_until_idle(service: EngineService) -> None:
    deadline = time.monotonic() + 30
    while service.live_streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.live_streams == 0


def test_reply_text_holds_back_what_may_begin_a_stop_sequence(tiny_export: Path) -> None:
    tokenizer = ModelTokenizer(tiny_export)
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    whole = tokenizer.decode(ids)
    reply = ReplyText(tokenizer, ("gamma",))
    sent = "".join(reply.push(token) for token in ids) + reply.finish()
    assert sent == whole[:whole.find("gamma")] and reply.stopped
    plain = ReplyText(tokenizer, ())
    assert "".join(plain.push(token) for token in ids) + plain.finish() == whole
    assert plain.text == whole and not plain.stopped


def test_streams_running_when_the_server_stops_end_with_an_error_their_clients_get(tiny_export: Path) -> None:
    with serving(tiny_export, opener=slow(tiny_export)) as (url, service):
        connection, response = long_stream(url, service)
        service.close()  # what `deskfleet serve` does first on SIGTERM
        rest = response.read().decode()
        connection.close()
    assert '"error"' in rest and "the server stopped" in rest and rest.rstrip().endswith("data: [DONE]")


def test_best_of_returns_the_candidates_of_the_highest_log_probability_a_token(
        served: tuple[str, EngineService]) -> None:
    url, _ = served
    request = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 1.2, "ignore_eos": True}
    for seed in range(40, 60):  # a seed whose best candidates are not its first ones: the ranking must reorder
        # candidate j samples with seed + j, as a request alone with that seed: its text and its tokens' figures
        alone = []
        for j in range(4):
            status, body = post(f"{url}/v1/completions", {**request, "seed": seed + j, "logprobs": 0})
            assert status == 200, body
            figures = body["choices"][0]["logprobs"]["token_logprobs"]
            alone.append((sum(figures) / len(figures), j, body["choices"][0]["text"]))
        ranked = sorted(alone, key=lambda item: (-item[0], item[1]))
        if [j for _, j, _ in ranked[:2]] != [0, 1]:
            break
    else:
        pytest.fail("no seed reorders the candidates: the test would not tell a ranking from the first n")
    expected = [text for _, _, text in ranked[:2]]
    request["seed"] = seed
    status, body = post(f"{url}/v1/completions", {**request, "best_of": 4, "n": 2})
    assert status == 200, body
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert [choice["text"] for choice in body["choices"]] == expected
    assert all(choice["logprobs"] is None for choice in body["choices"])  # ranked by them, not asked for
    assert body["usage"]["completion_tokens"] == 4 * 8  # every candidate was generated
    status, body = post(f"{url}/v1/completions", {**request, "best_of": 4, "logprobs": 1})
    assert status == 200 and [choice["text"] for choice in body["choices"]] == expected[:1]
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 8


def test_best_of_with_greedy_decoding_makes_n_choices_only(served: tuple[str, EngineService],
                                                           tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    expected = tokenizer.decode(greedy(tiny_export, tokenizer.encode("def add(a, b):"), 6))
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6,
                                                  "temperature": 0, "best_of": 5, "ignore_eos": True})
    assert status == 200 and [choice["text"] for choice in body["choices"]] == [expected]
    assert body["usage"]["completion_tokens"] == 6  # the 4 others would be the same text


def test_best_of_past_what_the_server_takes_is_named(tiny_export: Path) -> None:
    with serving(tiny_export, max_streams=4) as (url, _):
        status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                      "temperature": 1, "best_of": 5})
    assert status == 400 and body["error"]["param"] == "best_of"
    assert "best_of=5 candidates are more streams than this server takes at once (--max-streams 4)" in \
        body["error"]["message"]


def test_best_of_ranks_a_candidate_by_its_tokens_with_the_one_that_ended_it_whatever_echo_says(
        served: tuple[str, EngineService], tiny_export: Path) -> None:
    # the ranking read the entries shown: a reply ended by EOS lost the EOS's figure (and one of EOS alone ranked
    # last whatever its figure), while an echo, which shows it, kept it: echo changed which candidate came back
    url, _ = served
    eos = load_manifest(tiny_export).spec.eos_token_ids[0]
    tokenizer = ModelTokenizer(tiny_export)
    prompts = ["def add(a, b):", "import os"]
    request = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, "logit_bias": {str(eos): 3}, "seed": 9}
    best = []
    ended_by_eos = 0
    for prompt in prompts:
        skip = len(tokenizer.encode(prompt))  # an echo's entries: the prompt's, then the reply's, EOS included
        alone = []
        for j in range(4):
            status, body = post(f"{url}/v1/completions", {**request, "prompt": prompt, "seed": 9 + j, "echo": True,
                                                          "logprobs": 0})
            assert status == 200, body
            figures = body["choices"][0]["logprobs"]["token_logprobs"][skip:]
            ended_by_eos += body["choices"][0]["finish_reason"] == "stop"
            alone.append((sum(figures) / len(figures), j, body["choices"][0]["text"].removeprefix(prompt)))
        best.append(sorted(alone, key=lambda item: (-item[0], item[1]))[0][2])
    assert ended_by_eos >= 2  # the case at hand: candidates that EOS ended
    for echo in (False, True):
        status, body = post(f"{url}/v1/completions", {**request, "prompt": prompts, "best_of": 4, "echo": echo})
        assert status == 200, body
        assert [choice["index"] for choice in body["choices"]] == [0, 1]  # numbered again, prompt by prompt
        assert [choice["text"] for choice in body["choices"]] == [(prompt if echo else "") + text
                                                                  for prompt, text in zip(prompts, best, strict=True)]


@pytest.mark.parametrize("api_key", [None, "s3cret"])
def test_health_says_unavailable_and_why_while_no_chain_is_open(tiny_export: Path, api_key: str | None) -> None:
    # it said "ok" with every PC gone and every request answered 503: monitoring could not tell. It stays 200 (a
    # liveness probe's answer), and says why only to a client that may use the API (the error names PCs, paths)
    from deskfleet.controller.engine_service import OpenedChain
    from deskfleet.controller.pipeline import LocalPipeline

    from .test_engine import F32

    manifest = load_manifest(tiny_export)
    chains: list[BreakingChain] = []

    @contextmanager
    def flaky() -> Iterator[OpenedChain]:
        if chains:
            raise RuntimeError("no PC answers")
        with LocalPipeline(tiny_export, 1, F32, manifest) as pipeline:
            chains.append(BreakingChain(pipeline))
            yield OpenedChain(chains[-1])

    def health(url: str, key: str | None = None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with urllib.request.urlopen(urllib.request.Request(f"{url}/health", headers=headers), timeout=30) as response:
            assert response.status == 200
            return dict(json.loads(response.read()))

    with serving(tiny_export, opener=flaky, api_key=api_key) as (url, service):
        deadline = time.monotonic() + 30
        while (body := health(url))["stages"] is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the service opens its chain on a thread of its own: a loaded host took a while
        assert (body["status"], body["stages"]) == ("ok", 1) and "error" not in body
        chains[0].breaks.set()
        request = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
        assert post(f"{url}/v1/completions", request, key=api_key)[0] == 503  # the run failed
        _wait_until_idle(service)
        body = health(url, api_key)
        assert (body["status"], body["stages"]) == ("unavailable", None)
        assert "a stage went away" in body["error"] and body["runs_failed"] == 1
        assert post(f"{url}/v1/completions", request, key=api_key)[0] == 503  # the chain does not open again
        body = health(url, api_key)
        assert body["status"] == "unavailable" and body["error"] == "no PC answers"
        if api_key is not None:  # without the key: the status, not the error
            assert health(url)["status"] == "unavailable" and "error" not in health(url)


def test_an_empty_prompt_begins_at_the_tokenizers_bos(served: tuple[str, EngineService], tiny_export: Path) -> None:
    # it was refused ("prompt is empty"), where OpenAI takes it
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    begin = tokenizer.encode("")
    assert begin, "the tokenizer adds no BOS: the test proves nothing"
    tokens = run_streams(tiny_export, [StreamRequest(begin, max_new_tokens=5)])[0]
    for prompt in ("", ["", "x"]):
        status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == tokenizer.decode(tokens)
    # a tokenizer that adds nothing leaves nothing to begin from: named
    api = OpenAiApi.__new__(OpenAiApi)
    api.tokenizer = SimpleNamespace(encode=lambda text: [])  # type: ignore[assignment]
    api.spec = load_manifest(tiny_export).spec
    api._max_chars_per_token = 32
    with pytest.raises(ApiError, match=r"prompt\[1\] is empty, and this model's tokenizer adds no token to begin"):
        api._prepare_prompt("", parse_completion({"model": MODEL, "prompt": ""}, MODEL).decoding, "prompt[1]")
