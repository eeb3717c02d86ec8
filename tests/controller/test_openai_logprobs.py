"""`deskfleet serve`'s log-probabilities: a completion's `logprobs` and a chat's `logprobs` + `top_logprobs` give the
engine's figures (themselves transformers', test_engine_logprobs.py) in the API's shapes, whole and streamed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deskfleet.common.logprobs import TokenLogprob
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.engine import Engine, StreamRequest
from deskfleet.controller.engine_service import EngineService
from deskfleet.controller.openai_api import OpenAiApi, ReplyText, _Choice, unseen_ends
from deskfleet.controller.openai_logprobs import UNLIKELY, chat_logprobs, completion_logprobs
from deskfleet.controller.openai_requests import parse_completion
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.token_bytes import token_text
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

from .test_engine import F32
from .test_openai_api import MODEL, events, post, serving


@pytest.fixture(scope="module")
def served(tiny_export: Path) -> Iterator[tuple[str, EngineService]]:
    with serving(tiny_export) as server:
        yield server


def engine_logprobs(model: Path, request: StreamRequest) -> tuple[list[int], list[TokenLogprob]]:
    """The request run alone on one local stage: its tokens and their log-probabilities."""
    manifest = load_manifest(model)
    with LocalPipeline(model, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        engine.add(request)
        result = engine.run()[0]
    assert result.logprobs is not None
    return result.tokens, list(result.logprobs)


def test_a_completions_logprobs_are_the_engines_whole_and_streamed(served: tuple[str, EngineService],
                                                                   tiny_export: Path) -> None:
    url, service = served
    tokenizer = ModelTokenizer(tiny_export)
    prompt = "def add(a, b):"
    tokens, expected = engine_logprobs(tiny_export, StreamRequest(tokenizer.encode(prompt), max_new_tokens=12,
                                                                  logprobs=3))
    text_of = [token_text(tokenizer.token_bytes(token)) for token in tokens]
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    status, body = post(f"{url}/v1/completions", request)
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == text_of
    assert logprobs["token_logprobs"] == pytest.approx([entry.logprob for entry in expected], abs=1e-5)
    # where each token's text starts in the completion's text: the length of what the tokens before it decode to
    assert logprobs["text_offset"] == [len(tokenizer.decode(tokens[:at])) for at in range(len(tokens))]
    assert logprobs["text_offset"][-1] <= len(body["choices"][0]["text"])
    for top, entry, text in zip(logprobs["top_logprobs"], expected, text_of, strict=True):
        # the 3 most likely and the chosen one (greedy: the most likely, so 3 in all), by text
        shown = {token_text(tokenizer.token_bytes(token)): value for token, value in entry.top}
        assert top == pytest.approx({**shown, text: entry.logprob}, abs=1e-5)
        assert text in top and max(top.values()) == pytest.approx(top[text])
    # streamed: the chunks' logprobs add up to the whole reply's, the offsets going on from chunk to chunk
    found = [item for item in events(f"{url}/v1/completions", request)[:-1] if item["choices"]]
    pieces = [item["choices"][0]["logprobs"] for item in found]
    assert all(piece is not None for piece in pieces), "a chunk said null where the request asked"
    assert sum(bool(piece["tokens"]) for piece in pieces) >= 2, "one chunk: the offsets' carrying over is not tested"
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [value for piece in pieces for value in piece[name]] == logprobs[name], name
    assert service.live_streams == 0


def test_a_chats_logprobs_and_top_logprobs_are_the_engines_whole_and_streamed(served: tuple[str, EngineService],
                                                                             tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    ids = tokenizer.encode_chat([ChatMessage("user", "Say something.")])
    tokens, expected = engine_logprobs(tiny_export, StreamRequest(ids, max_new_tokens=10, logprobs=2,
                                                                  stop_token_ids=tokenizer.end_of_turn_ids()))
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 10,
               "temperature": 0, "logprobs": True, "top_logprobs": 2}
    status, body = post(f"{url}/v1/chat/completions", request)
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["logprobs"]["refusal"] is None
    assert len(content) == len(tokens)
    for shown, token, entry in zip(content, tokens, expected, strict=True):
        text = token_text(tokenizer.token_bytes(token))
        assert shown["token"] == text and shown["bytes"] == list(tokenizer.token_bytes(token))
        assert shown["logprob"] == pytest.approx(entry.logprob, abs=1e-5)
        assert [alternative["token"] for alternative in shown["top_logprobs"]] == \
            [token_text(tokenizer.token_bytes(token)) for token, _ in entry.top]
        assert [alternative["logprob"] for alternative in shown["top_logprobs"]] == \
            pytest.approx([value for _, value in entry.top], abs=1e-5)
    found = events(f"{url}/v1/chat/completions", request)[:-1]
    streamed: list[dict[str, Any]] = [entry for item in found for entry in item["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    # every chunk carries them, the role's first one too: empty lists where no token came, never null
    assert found[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert found[0]["choices"][0]["logprobs"] == {"content": [], "refusal": None}


def test_no_logprobs_unless_asked(served: tuple[str, EngineService]) -> None:
    url, _ = served
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert status == 200 and body["choices"][0]["logprobs"] is None
    # top_logprobs 0 is the API's default, which some clients send as it is
    status, body = post(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 3, "logprobs": False, "top_logprobs": 0})
    assert status == 200 and body["choices"][0]["logprobs"] is None
    found = events(f"{url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 3})
    # as OpenAI's chunks: "logprobs": null on each, and no "usage" without include_usage
    assert all(item["choices"][0]["logprobs"] is None and "usage" not in item for item in found[:-1])


def test_a_completions_logprobs_false_asks_for_none(served: tuple[str, EngineService]) -> None:
    url, _ = served
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": False})
    assert status == 200 and body["choices"][0]["logprobs"] is None


def test_a_token_that_ends_the_text_unseen_gets_no_entry(tiny_export: Path) -> None:
    """EOS or a chat's end of turn ends the reply without text: no entry, as the reply shows no token for it."""
    tokenizer = ModelTokenizer(tiny_export)
    choice = _Choice(0, StreamRequest([1], logprobs=0), None, ReplyText(tokenizer, ()),  # type: ignore[arg-type]
                     ends=frozenset({2}))
    choice.take((65, TokenLogprob(65, -0.5)))
    choice.take((2, TokenLogprob(2, -0.1)))
    assert choice.logprobs == [TokenLogprob(65, -0.5)]


def test_a_value_the_model_rules_out_is_shown_as_openai_shows_it() -> None:
    entries = [TokenLogprob(3, float("-inf"), ((4, -0.1), (5, float("nan"))))]
    chat = chat_logprobs(entries, lambda token: str(token).encode())
    assert chat["content"][0]["logprob"] == UNLIKELY and chat["content"][0]["top_logprobs"][1]["logprob"] == UNLIKELY
    completion = completion_logprobs(entries, lambda token: str(token).encode(), [0])
    assert completion["token_logprobs"] == [UNLIKELY] and completion["top_logprobs"] == [{"4": -0.1, "5": UNLIKELY,
                                                                                           "3": UNLIKELY}]


@pytest.mark.parametrize(("path", "body", "says"), [
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs must be null or a whole number from 0 to 20"),
    ("completions", {"prompt": "x", "logprobs": True}, "logprobs must be null or a whole number from 0 to 20"),
    ("completions", {"prompt": "x", "echo": "yes"}, "echo must be true or false"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be a whole number of at least 1"),
    ("chat/completions", {"logprobs": 1}, "logprobs must be true or false"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be a whole number from 0 to 20"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs needs logprobs set to true"),
])
def test_bad_logprobs_are_named(served: tuple[str, EngineService], path: str, body: dict[str, Any],
                                says: str) -> None:
    url, _ = served
    messages = {"messages": [{"role": "user", "content": "x"}]} if path.startswith("chat") else {}
    status, answer = post(f"{url}/v1/{path}", {"model": MODEL, **messages, **body})
    assert status == 400 and says in answer["error"]["message"], answer


def test_a_stop_sequence_ends_the_logprobs_with_the_token_that_completes_it(served: tuple[str, EngineService],
                                                                           tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    tokens, expected = engine_logprobs(tiny_export, StreamRequest(tokenizer.encode("def add(a, b):"),
                                                                  max_new_tokens=40, logprobs=0))
    full = tokenizer.decode(tokens)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "the random model's text has no stop sequence to pick"
    through = next(count for count in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:count]))
    request = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 40, "temperature": 0, "stop": [stop],
               "logprobs": 0}
    status, body = post(f"{url}/v1/completions", request)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["logprobs"]["token_logprobs"] == \
        pytest.approx([entry.logprob for entry in expected[:through]], abs=1e-5)
    streamed = [value for item in events(f"{url}/v1/completions", request)[:-1] if item["choices"]
                for value in (item["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == body["choices"][0]["logprobs"]["token_logprobs"]


def test_text_offsets_point_into_the_text_where_a_character_spans_tokens(tiny_export: Path) -> None:
    """Each token's text_offset is where its text starts in the completion: counting the tokens' own texts would put
    " b" at 5 in "aé b" (é's two bytes each decode alone to U+FFFD, and "é" is one character)."""
    tokenizer = ModelTokenizer(tiny_export)
    text = "aé b"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text), "the tokenizer holds é in one token: the test proves nothing"
    offsets = OpenAiApi._decoded_lengths(SimpleNamespace(tokenizer=tokenizer), ids, 0, len(ids))  # type: ignore[arg-type]
    assert len(ids) == 5 and offsets == [0, 1, 2, 2, 3]  # a, é's two bytes (the second within "a" + U+FFFD), " ", b
    assert text[offsets[-1]:] == "b" and text[offsets[-2]:] == " b"


def test_an_echo_of_max_tokens_0_scores_the_prompt_as_evaluation_harnesses_ask(served: tuple[str, EngineService],
                                                                              tiny_export: Path) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt's tokens and log-probabilities (the first none),
    nothing generated."""
    url, service = served
    tokenizer = ModelTokenizer(tiny_export)
    prompt = "def add(a, b):\n    return a + b"
    ids = tokenizer.encode(prompt)
    manifest = load_manifest(tiny_export)
    with LocalPipeline(tiny_export, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        engine.add(StreamRequest(ids, max_new_tokens=1, logprobs=1, prompt_logprobs=True))
        scored = engine.run()[0].prompt_logprobs
    assert scored is not None and len(scored) == len(ids) - 1
    for sent in (prompt, ids):
        status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": sent, "max_tokens": 0, "echo": True,
                                                      "logprobs": 1, "temperature": 0})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["text"] == (prompt if isinstance(sent, str) else tokenizer.decode(ids))
        assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [token_text(tokenizer.token_bytes(token)) for token in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx([entry.logprob for entry in scored], abs=1e-5)
        assert logprobs["text_offset"] == [len(tokenizer.decode(ids[:at])) for at in range(len(ids))]
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    assert service.live_streams == 0


def test_an_echo_begins_the_text_and_logprobs_with_the_prompts(served: tuple[str, EngineService],
                                                              tiny_export: Path) -> None:
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    prompt = "import os\n"
    ids = tokenizer.encode(prompt)
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    _, plain = post(f"{url}/v1/completions", request)
    status, echoed = post(f"{url}/v1/completions", {**request, "echo": True})
    assert status == 200, echoed
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    mine, theirs = echoed["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
    assert mine["tokens"][len(ids):] == theirs["tokens"]
    assert mine["token_logprobs"][len(ids):] == theirs["token_logprobs"]
    assert mine["text_offset"][len(ids):] == [len(prompt) + at for at in theirs["text_offset"]]
    assert len(mine["tokens"]) == len(ids) + len(theirs["tokens"]) and mine["token_logprobs"][0] is None
    # streamed, without logprobs: the prompt's text first, then the reply's
    found = events(f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                             "echo": True})
    chunks = [item["choices"][0]["text"] for item in found[:-1] if item["choices"]]
    assert chunks[0] == prompt and "".join(chunks) == echoed["choices"][0]["text"]


@pytest.mark.parametrize("max_tokens", [6, 0])
def test_an_echo_with_logprobs_streams_what_the_whole_reply_gives(served: tuple[str, EngineService],
                                                                  max_tokens: int) -> None:
    # it was refused ("answered whole"): the prompt's figures come once it is fed, before the first token
    url, _ = served
    request = {"model": MODEL, "prompt": "import os\n", "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
               "echo": True}
    status, whole = post(f"{url}/v1/completions", request)
    assert status == 200, whole
    found = [item for item in events(f"{url}/v1/completions", request)[:-1] if item["choices"]]
    texts = [item["choices"][0]["text"] for item in found]
    assert texts[0] == "import os\n" and "".join(texts) == whole["choices"][0]["text"]  # the prompt's chunk first
    expected = whole["choices"][0]["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [value for item in found for value in (item["choices"][0]["logprobs"] or {}).get(key, [])]
        assert streamed == expected[key], key
    assert found[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_an_echo_keeps_the_entry_of_a_token_that_ends_the_text(tiny_export: Path) -> None:
    """lm-evaluation-harness sends max_tokens 1 with echo and drops the last entry as the generated token's: an EOS
    made there must keep its entry, or the prompt's last token would be dropped instead."""
    spec = load_manifest(tiny_export).spec
    def decoding(**fields: Any) -> Any:
        return parse_completion({"model": "m", "prompt": "x", **fields}, "m").decoding
    assert unseen_ends(spec, decoding(logprobs=1), frozenset({7})) == frozenset(spec.eos_token_ids) | {7}
    assert unseen_ends(spec, decoding(logprobs=1, echo=True, max_tokens=1), frozenset()) == frozenset()
    assert unseen_ends(spec, decoding(ignore_eos=True), frozenset({7})) == frozenset()


def test_an_echoed_text_prompts_offsets_are_where_its_tokens_are_in_it(served: tuple[str, EngineService],
                                                                      tiny_export: Path) -> None:
    """A special token's text in the prompt is that token: it shows in the echoed text, and the tokens after it
    start past it (offsets decoded without special tokens put "there" at 2)."""
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    prompt = "Hi</s>there"
    ids = tokenizer.encode(prompt)
    assert 2 in ids, "the tokenizer does not take </s> in text as its token: the test proves nothing"
    status, body = post(f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True,
                                                  "logprobs": 0, "temperature": 0})
    assert status == 200, body
    logprobs, text = body["choices"][0]["logprobs"], body["choices"][0]["text"]
    assert text.startswith(prompt) and len(logprobs["tokens"]) == len(ids) + 1
    starts = logprobs["text_offset"][: len(ids)]
    assert text[starts[ids.index(2)]:].startswith("</s>there")
    assert text[starts[ids.index(2) + 1]:].startswith("there")


@pytest.mark.parametrize("extra", [{"best_of": 3}, {"n": 3}])
def test_a_whole_replys_candidates_share_one_scoring_of_their_prompt(served: tuple[str, EngineService],
                                                                    tiny_export: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    extra: dict[str, int]) -> None:
    # each candidate scored the prompt: fed whole past the prefix cache, every position's logits returned, best_of
    # times over for figures that are the same for all of them
    url, service = served
    tokenizer = ModelTokenizer(tiny_export)
    asked: list[bool] = []
    submit_all = service.submit_all

    def spy(requests: list[tuple[StreamRequest, object]]) -> list[int]:
        asked.extend(request.prompt_logprobs for request, _ in requests)
        return submit_all(requests)  # type: ignore[arg-type]

    monkeypatch.setattr(service, "submit_all", spy)
    prompts = ["import os\n", "def add(a, b):"]
    request = {"model": MODEL, "max_tokens": 3, "temperature": 1.0, "seed": 4, "logprobs": 1, "echo": True}
    status, body = post(f"{url}/v1/completions", {**request, "prompt": prompts, **extra})
    assert status == 200, body
    assert asked == [True, False, False] * 2  # one scoring a prompt
    assert len(body["choices"]) == (2 if "best_of" in extra else 6)
    for number, prompt in enumerate(prompts):
        status, alone = post(f"{url}/v1/completions", {**request, "prompt": prompt})
        assert status == 200, alone
        head = len(tokenizer.encode(prompt))
        expected = {key: alone["choices"][0]["logprobs"][key][:head]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert expected["token_logprobs"][0] is None and len(expected["token_logprobs"]) == head
        for choice in body["choices"][number * (len(body["choices"]) // 2):][:len(body["choices"]) // 2]:
            assert choice["text"].startswith(prompt)
            assert {key: choice["logprobs"][key][:head] for key in expected} == expected
    asked.clear()
    streamed = events(f"{url}/v1/completions", {**request, "prompt": prompts[0], "n": 2, "stream": True})
    assert asked == [True, True]  # streamed, each choice's chunks begin with the prompt's figures: each scores
    assert len([item for item in streamed[:-1] if item["choices"] and item["choices"][0]["text"] == prompts[0]]) == 2


def test_tokens_holding_part_of_a_character_show_their_own_bytes_and_top_map_keeps_each(
        served: tuple[str, EngineService], tiny_export: Path) -> None:
    # every such token showed U+FFFD with U+FFFD's bytes [239, 191, 189], and in a completion's top_logprobs map,
    # keyed by text, the least likely U+FFFD overwrote the most likely one's figure
    url, _ = served
    tokenizer = ModelTokenizer(tiny_export)
    partial = [token for token in range(tokenizer.vocab_size) if len(tokenizer.token_bytes(token)) == 1
               and tokenizer.token_bytes(token)[0] >= 0x80][:4]
    assert len(partial) == 4
    forced = tokenizer.token_bytes(partial[0])
    for stream in (False, True):
        request = {"model": MODEL, "messages": [{"role": "user", "content": "Ünïcödé"}], "max_tokens": 3,
                   "temperature": 0, "logprobs": True, "top_logprobs": 2, "logit_bias": {str(partial[0]): 100},
                   "stream": stream}
        if stream:
            content = [entry for item in events(f"{url}/v1/chat/completions", request)[:-1] if item["choices"]
                       for entry in (item["choices"][0].get("logprobs") or {}).get("content", [])]
        else:
            status, body = post(f"{url}/v1/chat/completions", request)
            assert status == 200, body
            content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 3
        for entry in content:
            assert entry["bytes"] == list(forced) and entry["token"] == f"\\x{forced[0]:02x}"
            for alternative in entry["top_logprobs"]:
                assert bytes(alternative["bytes"]).decode("utf-8", "backslashreplace") == alternative["token"]
    # the figures are the model's own (the bias only chooses): a position whose most likely are such tokens
    entries = [TokenLogprob(partial[3], -3.07, tuple((token, -0.07 - rank) for rank, token in enumerate(partial)))]
    top = completion_logprobs(entries, tokenizer.token_bytes, [0])["top_logprobs"][0]
    assert top == {token_text(tokenizer.token_bytes(token)): -0.07 - rank for rank, token in enumerate(partial)}
    assert len(set(top)) == 4 and top[token_text(tokenizer.token_bytes(partial[3]))] == -3.07
    # two tokens of one text (an added token's text is a plain token's too): the higher figure shows
    same = completion_logprobs([TokenLogprob(1, -4.0, ((2, -1.0), (1, -4.0)))], lambda token: b"x", [0])
    assert same["top_logprobs"] == [{"x": -1.0}]
