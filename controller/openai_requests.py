"""The OpenAI API's completion and chat-completion requests, read and checked: pure code, no I/O.

Every field the API defines is either honoured or, where deskfleet cannot do what it asks (suffix, tools),
refused naming the field; a field the API does not define is refused too, so a
client's typo is not silently ignored. A refusal is an ApiError, which the server sends as the API's error body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

from deskfleet.common.logits_adjust import MAX_BIAS, MAX_BIASED_TOKENS, MAX_PENALTY
from deskfleet.common.logprobs import MAX_TOP_LOGPROBS

from .tokenizer import ChatMessage, NotUtf8Error, check_utf8

DEFAULT_COMPLETION_TOKENS = 16  # the API's default max_tokens for /v1/completions
MAX_STOPS = 4  # the API takes up to 4 stop sequences
# A stop sequence's characters at most: far more than any stop anyone writes, and a 4 MB body's stops of a million
# characters each cost seconds of the event loop (every stream's) to make their matchers
MAX_STOP_CHARS = 1000
MAX_API_TEMPERATURE = 2.0  # the API's range is 0 to 2
MAX_SEED = 2**63 - 1
MAX_CHOICES = 16  # a request's `n`: each choice is a stream of its own, batched with the others
MAX_PROMPTS = 64  # a completion request's prompts (each with its `n` choices)

_NO_TOOLS = "deskfleet does no tool or function calling"
_TEXT_ONLY = "deskfleet generates text only"
# Fields each request may carry that change nothing here when at these values (the API's defaults): any other
# value asks for what deskfleet does not do, and is refused naming the field and why.
_NEUTRAL: dict[str, tuple[tuple[object, ...], str]] = {
    "suffix": ((None, ""), "deskfleet completes text after the prompt only"),
    "tools": ((None, []), _NO_TOOLS), "tool_choice": ((None, "none"), _NO_TOOLS),
    "parallel_tool_calls": ((None, False, True), _NO_TOOLS), "functions": ((None, []), _NO_TOOLS),
    "function_call": ((None, "none"), _NO_TOOLS),
    "modalities": ((None, ["text"]), _TEXT_ONLY), "audio": ((None,), _TEXT_ONLY),
    "reasoning_effort": ((None,), "deskfleet's models take no reasoning effort"),
    "verbosity": ((None, "medium"), "deskfleet's models take no verbosity setting"),
    "prediction": ((None,), "deskfleet takes no predicted output"),
    "web_search_options": ((None,), "deskfleet does no web search")}
# about the caller, not the text (metadata, routing and caching hints, abuse tracking): taken, checked as the API
# checks them, and unused
_CALLER_STRINGS = {"user", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
_IGNORED = {*_CALLER_STRINGS, "metadata", "store"}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # the API's limits on `metadata`
SHOWN_CHARS = 60  # a client's value said back in an error at most this long (a 3 MB field name came back twice)
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "ignore_eos"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "n", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
                                "echo", "best_of", "suffix"} | _IGNORED
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "n", "presence_penalty", "frequency_penalty",
                          "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
                          "functions", "function_call", "response_format", "modalities", "audio", "reasoning_effort",
                          "verbosity", "prediction", "web_search_options"} | _IGNORED
# a message's fields that clients send as placeholders (null or empty) for what deskfleet does not do (the SDK's
# ChatCompletionMessage.model_dump() of a reply carries each, null, as a follow-up's history)
_EMPTY_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "function_call", "refusal", "audio", "annotations")
_STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # obfuscation: no padding is sent, whatever is asked
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """A request the server refuses, as the API's error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, retry_after_s: int | None = None, closes: bool = False) -> None:
        """`retry_after_s`: sent as the Retry-After header (a client's wait before it asks again). `closes`: the
        connection closes after the answer (its request's body was not all read: what follows it is no request)."""
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.closes = closes
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Decoding:
    max_tokens: int | None  # None: up to the model's context
    temperature: float
    top_p: float
    top_k: int  # 0: all
    seed: int | None  # None: drawn where it samples
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    ignore_eos: bool = False  # non-standard, as vLLM's: run to max_tokens past the end of the text (benchmarks)
    n: int = 1  # choices: streams of the one prompt (choice i samples with seed + i)
    # each generated token's log-probability and those of the `logprobs` most likely tokens (None: none): a
    # completion's logprobs, a chat's logprobs + top_logprobs
    logprobs: int | None = None
    # a completion's echo: its text (and, with logprobs, its log-probabilities) begins with the prompt's; max_tokens
    # may then be 0 (the prompt scored, nothing generated)
    echo: bool = False
    # the candidates a prompt, n or (a completion's best_of) more: the n of the highest log-probability a token are
    # returned
    best_of: int = 1
    presence_penalty: float = 0.0  # -2 to 2, as the API's: off the logit of each token generated so far
    frequency_penalty: float = 0.0  # -2 to 2: off the logit of each token generated, times its count
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100 to 100) added to its logit
    max_tokens_field: str = "max_tokens"  # the request's name for max_tokens (a chat's max_completion_tokens too)


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]  # each text, or token ids
    decoding: Decoding


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    decoding: Decoding


def parse_completion(body: object, model_name: str) -> CompletionRequest:
    fields = _object(body, _COMPLETION_FIELDS)
    _check_model(fields, model_name)
    prompts = _prompts(fields.get("prompt"))
    max_tokens = fields.get("max_tokens")
    logprobs = fields.get("logprobs")
    if logprobs is False:  # taken as "none" before the field was honoured: clients send it
        logprobs = None
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"logprobs must be null or a whole number from 0 to {MAX_TOP_LOGPROBS} (the most likely "
                            "tokens listed beside each generated one)", "logprobs")
    echo = fields.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise ApiError(400, "echo must be true or false", "echo")
    scores_only = echo and max_tokens == 0 and _is_int(max_tokens)  # the prompt scored, nothing generated
    decoding = _decoding(fields, 1 if scores_only else DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens,
                         "max_tokens")
    best_of = fields.get("best_of")
    best_of = decoding.n if best_of is None else best_of
    if not _is_int(best_of) or not decoding.n <= best_of <= MAX_CHOICES:
        raise ApiError(400, f"best_of must be a whole number from n ({decoding.n}) to {MAX_CHOICES}", "best_of")
    if best_of > decoding.n and decoding.stream:
        raise ApiError(400, "best_of above n is answered whole: send it with stream false (the best are known once "
                            "every candidate has ended)", "best_of")
    if best_of > decoding.n and scores_only:
        raise ApiError(400, "best_of above n with max_tokens 0 generates nothing to choose from", "best_of")
    return CompletionRequest(prompts, replace(decoding, logprobs=logprobs, echo=echo, best_of=best_of,
                                              max_tokens=0 if scores_only else decoding.max_tokens))


def parse_chat(body: object, model_name: str) -> ChatRequest:
    fields = _object(body, _CHAT_FIELDS)
    _check_model(fields, model_name)
    format_ = fields.get("response_format")
    if format_ is not None and format_ != {"type": "text"}:
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported (no JSON mode)",
                       "response_format")
    if fields.get("max_completion_tokens") is not None and fields.get("max_tokens") is not None:
        raise ApiError(400, "give max_completion_tokens or max_tokens, not both", "max_completion_tokens")
    name = "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    decoding = _decoding(fields, fields.get(name), name)
    return ChatRequest(_messages(fields.get("messages")), replace(decoding, logprobs=_chat_logprobs(fields)))


# Private functions

def _chat_logprobs(fields: dict[str, Any]) -> int | None:
    """A chat request's logprobs (true or false) and top_logprobs (0 to MAX_TOP_LOGPROBS, only with logprobs)."""
    asked = fields.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise ApiError(400, "logprobs must be true or false", "logprobs")
    top = fields.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"top_logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
    if top and not asked:  # 0 alone is the API's default, which clients send as it is
        raise ApiError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if asked else None


def shown(value: object) -> str:
    """repr(value) cut to SHOWN_CHARS: how an error says back what a client sent."""
    if isinstance(value, str) and len(value) > SHOWN_CHARS:  # not the repr of 3 MB to cut
        return f"{value[:SHOWN_CHARS - 5]!r}..."
    said = repr(value)
    return said if len(said) <= SHOWN_CHARS else f"{said[:SHOWN_CHARS - 3]}..."


def _cut(name: str) -> str:
    """A client's name (a field's) cut to SHOWN_CHARS."""
    return name if len(name) <= SHOWN_CHARS else f"{name[:SHOWN_CHARS - 3]}..."


def _listed(names: list[str], most: int = 8) -> str:
    """Names a client sent, each cut, at most `most` of them."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(_cut(name) for name in names[:most]) + more


def _object(body: object, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unrecognized request argument(s): {_listed(unknown)}", _cut(unknown[0]))
    for name, (neutral, why) in _NEUTRAL.items():
        if name in allowed and name in body and \
                not any(body[name] == value and type(body[name]) is type(value) for value in neutral):
            raise ApiError(400, f"{name}={shown(body[name])} is not supported: {why}", name)
    _check_caller_fields(body)
    return body


def _check_caller_fields(body: dict[str, Any]) -> None:
    """The fields about the caller, unused here, typed as the API types them (a client's bug is not hidden)."""
    for name in _CALLER_STRINGS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(400, f"{name} must be a string", name)
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise ApiError(400, "store must be true or false", "store")
    metadata = body.get("metadata")
    if metadata is not None and (
            not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS
            or not all(len(key) <= MAX_METADATA_KEY for key in metadata)
            or not all(isinstance(value, str) and len(value) <= MAX_METADATA_VALUE for value in metadata.values())):
        raise ApiError(400, f"metadata must be an object of at most {MAX_METADATA_PAIRS} keys of up to "
                            f"{MAX_METADATA_KEY} characters, each to a string of up to {MAX_METADATA_VALUE}",
                       "metadata")


def _check_model(fields: dict[str, Any], model_name: str) -> None:
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name GET /v1/models lists", "model")
    if model != model_name:
        raise ApiError(404, f"the model {shown(model)} does not exist here: this server runs {model_name!r}", "model",
                       code="model_not_found")


def _prompts(value: object) -> tuple[str | tuple[int, ...], ...]:
    """The prompts of a completion request: a string, a list of token ids, or a list of up to MAX_PROMPTS of
    either."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(token) for token in value)):
        return (_prompt(value, "prompt"),)
    if not isinstance(value, list) or not value:
        raise ApiError(400, "prompt must be a string, a non-empty list of token ids, or a list of such prompts",
                       "prompt")
    if len(value) > MAX_PROMPTS:
        raise ApiError(400, f"prompt lists {len(value)} prompts: at most {MAX_PROMPTS} a request", "prompt")
    return tuple(_prompt(item, f"prompt[{index}]") for index, item in enumerate(value))


def _prompt(value: object, where: str) -> str | tuple[int, ...]:
    if isinstance(value, str):  # "" too, as OpenAI takes it: the text begins at the tokenizer's BOS
        return value
    if isinstance(value, list) and value and all(_is_int(token) for token in value):
        return tuple(value)
    raise ApiError(400, f"{where} must be a string or a non-empty list of token ids", "prompt")


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with a role and a content", where)
        unknown = sorted(set(message) - {"role", "content", "name"} - set(_EMPTY_MESSAGE_FIELDS))
        if unknown:
            raise ApiError(400, f"{where}: unrecognized field(s) {_listed(unknown)}", f"{where}.{_cut(unknown[0])}")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise ApiError(400, f"{where}.name must be a string", f"{where}.name")
        for name in _EMPTY_MESSAGE_FIELDS:
            if message.get(name) not in (None, [], ""):
                raise ApiError(400, f"{where}.{name} is not supported by deskfleet (no tools, function calls, "
                                    "audio or annotations): leave it out, or null", f"{where}.{name}")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a list or an object was a 500 (unhashable)
            raise ApiError(400, f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {shown(role)} (tools "
                                "are not supported)", f"{where}.role")
        content = _content(message.get("content"), f"{where}.content")
        try:  # named here, in the message's own characters: the template's rendering counted in its whole text
            check_utf8(content, f"{where}.content")
        except NotUtf8Error as error:
            raise ApiError(400, str(error), f"{where}.content") from None
        messages.append(ChatMessage(_ROLES[role], content))
    return tuple(messages)


def _content(value: object, where: str) -> str:
    """A message's text: a string, or a list of text parts (their texts joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{index}] must be a text part ({{\"type\": \"text\", \"text\": ...}}): "
                                    "images and audio are not supported", f"{where}[{index}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", where)


def _decoding(fields: dict[str, Any], max_tokens: object, max_name: str) -> Decoding:
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):  # type: ignore[operator]
        raise ApiError(400, f"{max_name} must be a whole number of at least 1", max_name)
    if max_tokens is not None and max_tokens > MAX_SEED:  # type: ignore[operator]
        raise ApiError(400, f"{max_name} must be at most {MAX_SEED}, far past any model's context", max_name,
                       code="context_length_exceeded")
    temperature = _number(fields, "temperature", 1.0, 0.0, MAX_API_TEMPERATURE)
    top_p = _number(fields, "top_p", 1.0, 0.0, 1.0)
    top_k = fields.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < 0:
        raise ApiError(400, "top_k must be a whole number, 0 (all) or more", "top_k")
    if top_p == 0:  # the API takes 0: the smallest set of tokens whose probability passes 0, the most likely one
        top_p, top_k = 1.0, 1
    seed = fields.get("seed")
    if seed is not None and (not _is_int(seed) or not -MAX_SEED - 1 <= seed <= MAX_SEED):
        raise ApiError(400, f"seed must be a whole number from {-MAX_SEED - 1} to {MAX_SEED}", "seed")
    if seed is not None and seed < 0:  # the API's seed is any int64: a negative one counts modulo 2**63
        seed %= MAX_SEED + 1
    stream = fields.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    options = fields.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - _STREAM_OPTIONS
                                or not all(isinstance(options.get(name, False), bool) for name in _STREAM_OPTIONS)):
        raise ApiError(400, "stream_options takes only include_usage and include_obfuscation (true or false), and "
                            "only with stream", "stream_options")
    ignore_eos = fields.get("ignore_eos", False)
    if ignore_eos is None:
        ignore_eos = False
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be true or false", "ignore_eos")
    n = fields.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be a whole number from 1 to {MAX_CHOICES}", "n")
    return Decoding(max_tokens if max_tokens is not None else None, temperature,  # type: ignore[arg-type]
                    top_p, top_k, seed, _stops(fields.get("stop")), stream,
                    bool(options and options.get("include_usage")), ignore_eos, n, best_of=n,
                    presence_penalty=_number(fields, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
                    frequency_penalty=_number(fields, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
                    logit_bias=_logit_bias(fields.get("logit_bias")), max_tokens_field=max_name)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias: an object of up to MAX_BIASED_TOKENS token ids (as JSON keys, strings) to biases from -100 to
    100; null or {} for none. The ids are checked against the vocabulary where the prompt is."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_BIASED_TOKENS:
        raise ApiError(400, f"logit_bias must be an object of at most {MAX_BIASED_TOKENS} token ids to biases",
                       "logit_bias")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        # at most 19 digits: int() of a longer string is slow, and past 4,300 digits refused with a ValueError
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19 else None
        if token is None or token > MAX_SEED:
            raise ApiError(400, f"logit_bias key {key[:40]!r} is not a token id", "logit_bias")
        if not _finite_number(bias) or abs(bias) > MAX_BIAS:
            raise ApiError(400, f"logit_bias of token {token} must be a number from {-MAX_BIAS:g} to {MAX_BIAS:g}",
                           "logit_bias")
        if token in biases:
            raise ApiError(400, f"logit_bias names token {token} twice", "logit_bias")
        biases[token] = float(bias)
    return tuple(biases.items())


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(stop, str) and stop for stop in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    if any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise ApiError(400, f"a stop sequence must be at most {MAX_STOP_CHARS:,} characters", "stop")
    return tuple(stops)


def _number(fields: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = fields.get(name, default)
    if value is None:
        return default
    if not _finite_number(value) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}", name)
    return float(value)


def _finite_number(value: object) -> TypeGuard[int | float]:
    """A JSON number that is not a bool, infinite or NaN (an integer of 400 digits too: math.isfinite raised
    OverflowError on it, a 500)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) < 2**63 if isinstance(value, int) else math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
