"""An OpenAI-compatible HTTP API over an EngineService: what `deskfleet serve` listens with.

GET /v1/models, POST /v1/completions and POST /v1/chat/completions (whole or streamed as server-sent events),
and GET /health. Every request is a stream of the service's one running engine: requests that arrive together
are batched, a client that goes away has its stream cancelled. With an API key, every /v1 request must carry it
as `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import bisect
import hmac
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from deskfleet.common.log_limit import as_one_line
from deskfleet.common.logprobs import TokenLogprob
from deskfleet.common.model_spec import ModelSpec
from deskfleet.common.speculative import SamplingParams

from .chat_template import ChatTemplateError
from .decoding_options import random_seed
from .engine import StreamRequest
from .engine_service import EngineService, ServiceBusy, ServiceClosed, StreamEnd
from .generation import GenerationError, check_request
from .openai_logprobs import chat_logprobs, completion_logprobs
from .openai_requests import (
    MAX_SEED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Decoding,
    parse_chat,
    parse_completion,
    shown,
)
from .stop_sequences import StopMatcher, StopSequences
from .text_printer import TextPrinter
from .token_bytes import token_text
from .tokenizer import ModelTokenizer, NotUtf8Error

log = logging.getLogger(__name__)
_Token = tuple[int, "TokenLogprob | None"]  # a token from the engine's thread, and its log-probabilities where asked


@dataclass(frozen=True)
class _PromptScores:
    """The prompt's log-probabilities (its tokens after the first), handed over before its stream's first token."""

    entries: tuple[TokenLogprob, ...]


_Event = _Token | _PromptScores | StreamEnd

MAX_BODY_BYTES = 4 * 1024 * 1024  # a request body: a long conversation's text, far from the model's context in bytes
# A request body none of which comes for this long is refused (408): one that stopped midway held its connection for
# good (KEEPALIVE_S closes connections that send no request, or half a header)
BODY_TIMEOUT_S = 60.0
# A reply, streamed or whole, whose client reads none of it for this long is given up, its streams cancelled and its
# connection closed: a client that stopped reading held its whole reply in the server's memory (13 MB for n 16 x
# 1,000 tokens with 20 logprobs each) until it went away
WRITE_TIMEOUT_S = 60.0
# A connection that sends no request (or half a header) for this long is closed, as an idle keep-alive one is
# (aiohttp's default is 3,630 s: 200 silent sockets, which need no API key, took every file handle a lowered limit
# left); clients keep idle connections 5 s (httpx's default), so their reuse is kept
KEEPALIVE_S = 15.0
# What a 429 (every stream the server takes is running or waiting) tells a client to wait before it asks again
# (Retry-After: the OpenAI clients honour it): a reply of the demo model takes about that, a real model's longer
BUSY_RETRY_AFTER_S = 1
# A prompt's characters a token of the model's context at most, unless the model has longer tokens
# (ModelTokenizer.longest_token_chars: the demo's has one of 64 '#'): more cannot fit, and tokenizing a few MB holds
# the event loop, every client's stream with it, for seconds. With 32 alone, 38,400 '#'s (601 tokens) were refused.
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class _Prepared:
    prompt_ids: list[int]
    decoding: Decoding
    max_tokens: int  # 0: an echo that only scores the prompt (one token is made and not shown)
    stop_ids: frozenset[int]
    prompt_text: str | None = None  # a completion's prompt as sent, where it was text (what an echo shows)


class ReplyText:
    """A reply's text as its tokens arrive, cut at the first stop sequence: what each new token adds that can be
    sent. Text that begins a stop sequence and may yet complete it is held back until the text goes on past it,
    with the tokens it came from: what is sent is the text of whole tokens (`released_tokens` of them), so that a
    streamed chunk's log-probabilities are those of the tokens whose text it carries."""

    def __init__(self, tokenizer: ModelTokenizer, stops: StopSequences | tuple[str, ...]) -> None:
        self._stops = StopMatcher(stops)
        self._text: list[str] = []
        self._length = 0
        self._joined = ""
        self._sent = 0
        self._token_ends: list[int] = []  # the text's length once each token's text had been written
        self.released_tokens = 0  # the tokens pushed whose text has all been sent
        self.stopped = False  # a stop sequence was met: nothing more is sent
        self._printer = TextPrinter(tokenizer, cast(Any, self), show_controls=False)

    def write(self, text: str) -> None:  # TextPrinter's output: the text of every token up to written_tokens
        self._text.append(text)
        self._length += len(text)
        self._stops.feed(text)
        self._token_ends += [self._length] * (self._printer.written_tokens - len(self._token_ends))

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        """The reply as sent so far (and, once finished, the whole reply up to any stop sequence)."""
        return self._full()[:self._sent]

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self._printer.push(0, token)
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._printer.finish()
        return self._release(final=True)

    def _full(self) -> str:
        if len(self._joined) != self._length:
            self._joined = "".join(self._text)
            self._text = [self._joined]
        return self._joined

    def _release(self, final: bool) -> str:
        text = self._full()
        if self._stops.found is not None:  # every token pushed: the one that completed it among them
            end, self.stopped = self._stops.found, True
            self.released_tokens = len(self._printer.tokens)
        elif final:
            end, self.released_tokens = len(text), len(self._printer.tokens)
        else:  # whole tokens whose text is written, up to the text that may begin a stop sequence
            self.released_tokens = bisect.bisect_right(self._token_ends, len(text) - self._stops.pending)
            end = self._token_ends[self.released_tokens - 1] if self.released_tokens else 0
        piece, self._sent = text[self._sent:end], max(self._sent, end)
        return piece


class _Bridge:
    """A stream's sink: hands its tokens and its end from the engine's thread to the request's event loop. What
    arrives while the loop is busy is handed over together, one wake-up of the loop for all of it (a wake-up a token,
    and an event written a token, cost the demo target's 8 users half their tokens a second: `bench serve`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[_Event] = []
        self._ready = asyncio.Event()

    def token(self, token: int, logprob: TokenLogprob | None) -> None:
        self._put((token, logprob))

    def prompt_scored(self, entries: tuple[TokenLogprob, ...]) -> None:
        self._put(_PromptScores(entries))

    def end(self, end: StreamEnd) -> None:
        self._put(end)

    async def take(self) -> list[_Event]:
        """Every token (and the end) that came since the last take; at least one."""
        while True:
            await self._ready.wait()
            with self._lock:
                events, self._pending = self._pending, []
                self._ready.clear()
            if events:
                return events

    def _put(self, event: _Event) -> None:
        with self._lock:
            self._pending.append(event)
            if len(self._pending) > 1:  # the wake-up of the first is on its way
                return
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop closed: the server stopped under the stream
            pass


class OpenAiApi:
    """The API's routes over `service`; `model_name` is the id clients give as `model`."""

    def __init__(self, service: EngineService, tokenizer: ModelTokenizer, spec: ModelSpec, model_name: str,
                 api_key: str | None = None, hosts: frozenset[str] | None = None) -> None:
        """`hosts`: the Host header names a request may carry (a keyless server on loopback: its own names, so a
        web page cannot reach it through a DNS name that resolves to 127.0.0.1); None: any."""
        self.service = service
        self._hosts = hosts
        self.tokenizer = tokenizer
        self.spec = spec
        self.model_name = model_name
        self._api_key = api_key.encode() if api_key else None
        self._created = int(time.time())
        self._render_lock = threading.Lock()  # the chat template renders in one child process, a request at a time
        self._end_of_turn: frozenset[int] | None = None
        # read once here, not on the event loop at the first request (~70 ms for a 150k vocabulary)
        self._max_chars_per_token = max(MAX_CHARS_PER_TOKEN, tokenizer.longest_token_chars)

    @property
    def has_api_key(self) -> bool:
        return self._api_key is not None

    def runner(self) -> web.AppRunner:
        """The aiohttp runner of app() that `deskfleet serve` listens with: a client that goes away cancels its
        request's handler (its streams), a connection that sends no request for KEEPALIVE_S is closed, and a stop
        waits at most 5 s for replies still being written."""
        return web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                             keepalive_timeout=KEEPALIVE_S)

    def app(self) -> web.Application:
        logging.getLogger("aiohttp.server").addFilter(_MALFORMED_REQUESTS)  # once: a filter is added once
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(_name_the_request)
        app.add_routes([web.get("/v1/models", self._models), web.get("/v1/models/{model:.+}", self._model),
                        web.post("/v1/completions", self._completions),
                        web.post("/v1/chat/completions", self._chat_completions), web.get("/health", self._health)])
        return app

    # Middlewares

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return cast(web.StreamResponse, await handler(request))
        except ApiError as error:
            headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
            response = web.json_response(error.body(), status=error.status, headers=headers)
            if error.closes:
                response.force_close()
            return response
        except web.HTTPException as error:  # aiohttp's own: unknown path, wrong method, body too large
            if error.status < 400:
                raise
            kind = "not_found_error" if error.status == 404 else "invalid_request_error"
            message, headers, closes = error.reason, None, False
            if isinstance(error, web.HTTPMethodNotAllowed):  # the Allow header RFC 9110 asks for, kept
                allowed = ", ".join(sorted(error.allowed_methods))
                message = f"{request.method} is not allowed on {request.path}: use {allowed}"
                headers = {"Allow": allowed}
            elif isinstance(error, web.HTTPRequestEntityTooLarge):  # the rest of the body is no request: closes
                message = f"the request body is larger than this server takes ({MAX_BODY_BYTES // 2**20} MiB)"
                closes = True
            response = web.json_response(ApiError(error.status, message, kind=kind).body(), status=error.status,
                                         headers=headers)
            if closes:
                response.force_close()
            return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        # the header itself: aiohttp's request.host stands in the socket's own address where there is none
        host = request.headers.get("Host")
        if self._hosts is not None and (host is None or _host_name(host) not in self._hosts):
            named = "no Host header: a request must name" if host is None else \
                f"the Host {host[:100]!r} is not this server's: a request must name"
            raise ApiError(403, f"{named} one of {', '.join(sorted(self._hosts))} (a request through another name, a "
                                "web page's by DNS rebinding, is refused)", kind="permission_error")
        if request.method == "POST" and request.content_type != "application/json" and \
                request.match_info.http_exception is None:  # an unknown path or method is answered 404 / 405
            # a web page can POST text/plain or a form to any address without asking first; JSON it cannot
            raise ApiError(415, f"the request body must be JSON, sent as Content-Type: application/json (got "
                                f"{shown(request.content_type)})")
        if self._api_key is not None and request.path.startswith("/v1/"):
            if not self._keyed(request):
                raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                               kind="authentication_error", code="invalid_api_key")
        return cast(web.StreamResponse, await handler(request))

    # Routes

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def _model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            raise ApiError(404, f"the model {shown(request.match_info['model'])} does not exist here: this server runs "
                                f"{self.model_name!r}", "model", code="model_not_found")  # the API's type
        return web.json_response(self._model_object())

    async def _health(self, request: web.Request) -> web.Response:
        """Always 200 while the server runs (a liveness probe's answer: a 503 after a failed run kept a balancer's
        traffic, and with it the request that opens the chain again, away for good). `status` is the service's:
        "ok" (a chain is open), "opening" or "unavailable" (the last run failed or its chain did not open; the next
        request opens it again), with `error`, why, for a client that may use the API: it names PCs, addresses and
        paths. It said "ok" with no chain to serve on, which monitoring could not tell."""
        body: dict[str, Any] = {
            "status": self.service.state, "model": self.model_name, "live_streams": self.service.live_streams,
            "streams_cancelled": self.service.streams_cancelled, "runs_failed": self.service.runs_failed,
            "stages": self.service.chain_stages, "chains_reopened": self.service.chains_reopened,
            "chains_switched": self.service.chains_switched}
        if self.service.state == "unavailable" and self.service.last_failure is not None and self._keyed(request):
            body["error"] = self.service.last_failure
        return web.json_response(body)

    def _keyed(self, request: web.Request) -> bool:
        """Whether the request carries this server's API key, or the server has none."""
        if self._api_key is None:
            return True
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode("utf-8", "surrogateescape"),
                                                                  self._api_key)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completion(await self._json(request), self.model_name)
        self._check_streams(parsed.decoding, len(parsed.prompts))  # before tokenizing prompts that cannot run
        # in a worker thread: 64 prompts of 64,000 characters held the event loop (every stream) for 3.3 s
        prepared = await asyncio.to_thread(self._prepare_prompts, parsed)
        return await self._respond(request, prepared, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(await self._json(request), self.model_name)
        prepared = await asyncio.to_thread(self._prepare_chat, parsed)
        return await self._respond(request, [prepared], chat=True)

    # Private methods

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "deskfleet",
                "max_context": self.spec.max_context}

    @staticmethod
    async def _json(request: web.Request) -> object:
        body = await _read_body(request)
        try:
            # UTF-8 whatever charset the header names (JSON is UTF-8; an unknown one was a 500, latin-1 garbled text)
            return json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, a number past int's digits, too deep
            said = "a number in it has more digits than any field takes" if "integer string conversion" in str(error) \
                else str(error)[:200]  # (not Python's advice to raise its limit)
            raise ApiError(400, f"the request body is not JSON that can be read: {said}") from None

    def _prepare_prompts(self, parsed: CompletionRequest) -> list[_Prepared]:
        """Every prompt of a completion request, encoded and checked (in a worker thread)."""
        return [self._prepare_prompt(prompt, parsed.decoding, "prompt" if len(parsed.prompts) == 1 else
                                     f"prompt[{index}]") for index, prompt in enumerate(parsed.prompts)]

    def _prepare_prompt(self, prompt: str | tuple[int, ...], decoding: Decoding, where: str) -> _Prepared:
        """One prompt of a completion request, encoded and checked against the context (`where`: how the errors
        name it, "prompt" or "prompt[i]")."""
        if isinstance(prompt, str):
            self._check_length(len(prompt), "prompt", where)
            try:
                ids = self.tokenizer.encode(prompt)
            except (NotUtf8Error, ValueError) as error:
                raise ApiError(400, f"{where}: {error}", "prompt") from None
            if not ids:  # an empty prompt where the tokenizer adds no BOS: nothing to begin from
                raise ApiError(400, f"{where} is empty, and this model's tokenizer adds no token to begin a text "
                                    "with: give some text", "prompt")
        else:
            ids = list(prompt)
            bad = [token for token in ids if not 0 <= token < self.spec.vocab_size]
            if bad:
                raise ApiError(400, f"{where}: token id {bad[0]} is outside the model's vocabulary of "
                                    f"{self.spec.vocab_size}", "prompt")
        prepared = self._prepared(ids, decoding, frozenset(), "prompt", where)
        return replace(prepared, prompt_text=prompt if isinstance(prompt, str) else None)

    def _prepare_chat(self, parsed: ChatRequest) -> _Prepared:
        """Render and encode the conversation (in a worker thread: the template renders in a child process)."""
        self._check_length(sum(len(message.content) for message in parsed.messages), "messages")
        with self._render_lock:
            try:
                self.tokenizer.require_chat_template("this model has no chat template: use /v1/completions")
                ids = self.tokenizer.encode_chat(list(parsed.messages))
                if self._end_of_turn is None:
                    self._end_of_turn = self.tokenizer.end_of_turn_ids()
            except (ChatTemplateError, NotUtf8Error) as error:
                raise ApiError(400, f"messages: {error}", "messages") from None
        return self._prepared(ids, parsed.decoding, self._end_of_turn, "messages")

    def _check_length(self, chars: int, param: str, where: str | None = None) -> None:
        per_token = self._max_chars_per_token
        if chars > per_token * self.spec.max_context:
            why = "its longest token's length" if per_token > MAX_CHARS_PER_TOKEN else "the cap"
            raise ApiError(400, f"{where or param}: {chars} characters cannot fit the model's context of "
                                f"{self.spec.max_context} tokens (more than {per_token} characters a token, {why})",
                           param, code="context_length_exceeded")

    def _prepared(self, ids: list[int], decoding: Decoding, stop_ids: frozenset[int], param: str,
                  where: str | None = None) -> _Prepared:
        """`where`: how the errors name the prompt where a request has several ("prompt[2]")."""
        which = f"{where}: " if where is not None and where != param else ""
        room = self.spec.max_context - len(ids)
        if room < 1:
            scoring = decoding.max_tokens == 0  # an echo of max_tokens 0 makes one token, unshown (_Choice.hidden)
            raise ApiError(400, f"{which}the prompt is {len(ids)} tokens: the model's context is "
                                f"{self.spec.max_context}, which leaves no room for " +
                                ("the one token that scoring it makes (also with max_tokens 0)" if scoring
                                 else "a reply"), param, code="context_length_exceeded")
        max_tokens = decoding.max_tokens if decoding.max_tokens is not None else room
        if max_tokens > room:  # said in the API's words: check_request names the CLI's --max-new-tokens
            field = decoding.max_tokens_field
            raise ApiError(400, f"{which}{len(ids)} prompt tokens + {field} {max_tokens} exceed the model's "
                                f"context of {self.spec.max_context}: ask for at most {room}", field,
                           code="context_length_exceeded")
        try:
            check_request(self.spec, ids, max(1, max_tokens))  # 0: an echo that makes one token and shows none
        except GenerationError as error:
            raise ApiError(400, f"{which}{error}", param) from None
        outside = [token for token, _ in decoding.logit_bias if token >= self.spec.vocab_size]
        if outside:
            raise ApiError(400, f"logit_bias token {outside[0]} is outside the model's vocabulary of "
                                f"{self.spec.vocab_size}", "logit_bias")
        return _Prepared(ids, decoding, max_tokens, stop_ids)

    async def _respond(self, request: web.Request, prompts: list[_Prepared], chat: bool) -> web.StreamResponse:
        """Run each prompt's `n` choices (a chat has one prompt) and answer with them all, whole or streamed."""
        decoding = prompts[0].decoding
        prompt_tokens = sum(len(prepared.prompt_ids) for prepared in prompts)  # each counted once, not per choice
        choices = self._submit(prompts)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        ended = False
        try:
            if decoding.stream:
                response = await self._stream(request, choices, ident, chat, decoding, prompt_tokens)
            else:
                try:
                    async with asyncio.TaskGroup() as group:
                        gathering = [group.create_task(self._gather(choice)) for choice in choices]
                except* ApiError as errors:  # a choice's generation failed: the others are cancelled below
                    raise errors.exceptions[0] from None
                ended_choices = [(choice, *task.result()) for choice, task in zip(choices, gathering, strict=True)]
                cached = _cached_tokens(choices, {choice.index: end.result.reused_tokens if end.result is not None
                                                  else 0 for choice, end, _ in ended_choices})  # before _best renumbers
                whole = web.json_response(self._whole(ident, chat, _best(ended_choices, decoding.n), prompt_tokens,
                                                      sum(tokens for _, _, tokens in ended_choices), cached))
                # sent here, bounded as a streamed reply is (aiohttp's own write is not)
                response = await _write_whole(request, whole)
            ended = True
            return response
        except ConnectionResetError as error:  # the client went away while its reply was written (or stopped reading)
            if isinstance(error, ClientStalled):
                log.info("%s: its streams are cancelled and its connection closed", error)
            if request.transport is not None:  # one that stopped reading: its connection goes, and its buffers
                request.transport.abort()
            return web.Response(status=499)
        finally:
            if not ended:  # the client went away (the handler was cancelled), writing to it failed, or a choice failed
                for choice in choices:
                    self.service.cancel(choice.ticket)

    def _submit(self, prompts: list[_Prepared]) -> list[_Choice]:
        """A stream for each of the `n` choices of each prompt, or each of its `best_of` candidates where they sample
        (greedy ones would all be the same text: n of them are made), choice j of a prompt sampling with the seed +
        j, as a request alone with that seed would; indexes run prompt by prompt, as the API's. Queued all or none:
        ApiError 400 for more than the server ever takes, 429 or 503 where it takes none now."""
        decoding = prompts[0].decoding
        per_prompt = self._check_streams(decoding, len(prompts))
        # candidates are ranked by their tokens' log-probabilities, which the last stage then returns for each
        ranked = per_prompt > decoding.n
        sampling = SamplingParams(temperature=decoding.temperature, top_k=decoding.top_k if decoding.temperature else 0,
                                  top_p=decoding.top_p if decoding.temperature else 1.0)
        loop = asyncio.get_running_loop()
        stops = StopSequences(decoding.stop)  # once: every choice's matcher shares its tables
        echo_scores = decoding.echo and decoding.logprobs is not None
        choices: list[_Choice] = []
        for prepared in prompts:
            scorer: _Choice | None = None
            for index in range(per_prompt):
                # A whole reply's choices of one prompt show the same prompt figures: the first scores the prompt,
                # the others take its (a scored prompt is fed whole, past the prefix cache, every position's logits
                # returned). Streamed, each choice's chunks begin with them: each scores its own.
                scores = echo_scores and (scorer is None or decoding.stream)
                seed = (decoding.seed + index) % (MAX_SEED + 1) if decoding.seed is not None else \
                    (random_seed() if decoding.temperature else 0)
                request = StreamRequest(prompt_ids=prepared.prompt_ids, max_new_tokens=max(1, prepared.max_tokens),
                                        ignore_eos=decoding.ignore_eos, stop_token_ids=prepared.stop_ids,
                                        sampling=sampling, seed=seed,
                                        logprobs=(decoding.logprobs or 0) if ranked else decoding.logprobs,
                                        presence_penalty=decoding.presence_penalty,
                                        frequency_penalty=decoding.frequency_penalty, logit_bias=decoding.logit_bias,
                                        prompt_logprobs=scores)
                ends = unseen_ends(self.spec, decoding, prepared.stop_ids)
                echoed = (prepared.prompt_text if prepared.prompt_text is not None
                          else self.tokenizer.decode(prepared.prompt_ids)) if decoding.echo else ""
                choices.append(_Choice(len(choices), request, _Bridge(loop), ReplyText(self.tokenizer, stops),
                                       prompt_index=len(choices) // per_prompt,
                                       show_logprobs=decoding.logprobs is not None,
                                       ends=ends, echoed=echoed, prompt_text=prepared.prompt_text if decoding.echo
                                       else None, hidden=prepared.max_tokens == 0, echo_scores=echo_scores,
                                       scorer=None if scores else scorer))
                scorer = scorer or choices[-1]
        try:
            tickets = self.service.submit_all([(choice.request, choice.bridge) for choice in choices])
        except ServiceBusy as error:
            raise ApiError(429, str(error), kind="server_busy", retry_after_s=BUSY_RETRY_AFTER_S) from None
        except ServiceClosed as error:
            raise ApiError(503, str(error), kind="server_error") from None
        for choice, ticket in zip(choices, tickets, strict=True):
            choice.ticket = ticket
        return choices

    def _check_streams(self, decoding: Decoding, prompts: int) -> int:
        """The streams each of `prompts` prompts takes (its `n` choices, or its `best_of` candidates where they sample);
        ApiError 400 where all of them are more than the server ever takes at once."""
        per_prompt = decoding.best_of if decoding.temperature else decoding.n
        if prompts * per_prompt > self.service.max_streams:
            what = f"best_of={per_prompt} candidates" if per_prompt > decoding.n else f"n={decoding.n} choices"
            asked = what if prompts == 1 else f"{prompts} prompts of {what} each"
            raise ApiError(400, f"{asked} are more streams than this server takes at once (--max-streams "
                                f"{self.service.max_streams})", "prompt" if prompts > 1 else
                           "best_of" if per_prompt > decoding.n else "n")
        return per_prompt

    async def _gather(self, choice: _Choice) -> tuple[StreamEnd, int]:
        """The choice's end, and its reply's tokens."""
        while True:
            for event in await choice.bridge.take():
                if isinstance(event, StreamEnd):
                    event = _settled(choice, event)
                    if event.error is not None:
                        raise ApiError(503, f"the generation failed: {event.error}", kind="server_error")
                    choice.reply.finish()
                    return event, choice.tokens
                if isinstance(event, _PromptScores):  # kept for the choices of its prompt (the scorer's siblings)
                    choice.prompt_scores = event.entries
                    continue
                choice.take(event)
                if choice.reply.stopped:
                    self.service.cancel(choice.ticket)  # a stop sequence: the rest is not wanted

    async def _stream(self, request: web.Request, choices: list[_Choice], ident: str, chat: bool,
                      decoding: Decoding, prompt_tokens: int) -> web.StreamResponse:
        """The choices' chunks as their tokens come, each naming its choice's index; each choice's last chunk gives
        its finish_reason, and [DONE] follows the last choice's (a failed choice: an error event, then [DONE])."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        created = int(time.time())

        def chunk(piece: str | dict[str, str] | None, finish: str | None = None, index: int = 0,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            # with include_usage every chunk but the last carries "usage": null, as OpenAI's
            return self._chunk(ident, created, chat, piece, finish, index, logprobs, decoding.include_usage)

        for choice in choices:
            if chat:
                # with logprobs asked, empty lists: a chunk of no tokens carries them, never null
                await self._event(response, chunk({"role": "assistant", "content": ""}, index=choice.index,
                                                  logprobs=self._logprobs(choice, chat, [])))
            elif choice.echoed and not choice.request.prompt_logprobs:  # an echo's prompt first (with its
                # log-probabilities, once they come: _pieces)
                await self._event(response, chunk(choice.echoed, index=choice.index,
                                                  logprobs=self._logprobs(choice, chat, [])))
        arrived: asyncio.Queue[tuple[_Choice, str, dict[str, Any] | None, StreamEnd | None]] = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for piece, logprobs, end in self._pieces(choice, chat):
                    arrived.put_nowait((choice, piece, logprobs, end))
            except Exception as error:  # the reply ends with it, not waits for a choice that will say nothing more
                log.exception("choice %d of %s failed", choice.index, ident)
                arrived.put_nowait((choice, "", None, StreamEnd(None, f"{type(error).__name__}: {error}")))

        pumps = [asyncio.create_task(pump(choice)) for choice in choices]
        finished: set[int] = set()  # the choices whose stream has ended
        reused: dict[int, int] = {}  # by choice: prompt tokens its stream took from the prefix cache
        try:
            while len(finished) < len(choices):
                choice, piece, logprobs, end = await arrived.get()
                if end is None:
                    if piece or _has_entries(logprobs):
                        await self._event(response, chunk(piece, index=choice.index, logprobs=logprobs))
                    continue
                finished.add(choice.index)
                reused[choice.index] = end.result.reused_tokens if end.result is not None else 0
                if end.error is not None:
                    await self._event(response, ApiError(503, f"the generation failed: {end.error}",
                                                         kind="server_error").body())
                    break
                none = self._logprobs(choice, chat, [])  # a chunk of no tokens: empty where asked, not null
                if piece or _has_entries(logprobs):
                    await self._event(response, chunk(piece, index=choice.index, logprobs=logprobs))
                await self._event(response, chunk(None, _finish(choice, end), index=choice.index, logprobs=none))
            else:
                if decoding.include_usage:
                    await self._event(response, {"id": ident, "object": self._chunk_kind(chat), "created": created,
                                                 "model": self.model_name, "choices": [],
                                                 "usage": _usage(prompt_tokens,
                                                                 sum(choice.tokens for choice in choices),
                                                                 _cached_tokens(choices, reused))})
        finally:
            for task in pumps:
                task.cancel()
            for choice in choices:  # a failed choice ends the reply: the others are not wanted
                if choice.index not in finished:
                    self.service.cancel(choice.ticket)
        await _write(response, b"data: [DONE]\n\n")
        async with _client_reads():
            await response.write_eof()
        return response

    async def _pieces(self, choice: _Choice, chat: bool) -> AsyncIterator[tuple[str, dict[str, Any] | None,
                                                                               StreamEnd | None]]:
        """(text to send, the `logprobs` of the tokens whose text it ends with (release_logprobs), None) for the
        tokens that came together, then (the text held back, its tokens' `logprobs`, the end). An echo with
        log-probabilities begins with its prompt's text and theirs, once the prompt is fed."""
        while True:
            pieces: list[str] = []
            for event in await choice.bridge.take():
                if isinstance(event, _PromptScores):
                    yield choice.echoed, self._prompt_logprobs(choice, list(event.entries)), None
                    continue
                if isinstance(event, StreamEnd):
                    event = _settled(choice, event)
                    if pieces:
                        yield "".join(pieces), self._released_logprobs(choice, chat), None
                    text = choice.reply.finish() if event.error is None else ""
                    yield text, self._released_logprobs(choice, chat), event
                    return
                pieces.append(choice.take(event))
                if choice.reply.stopped:
                    self.service.cancel(choice.ticket)
            yield "".join(pieces), self._released_logprobs(choice, chat), None

    def _released_logprobs(self, choice: _Choice, chat: bool) -> dict[str, Any] | None:
        """The `logprobs` of a streamed chunk: those of the tokens whose text the reply sent since the last chunk
        (_Choice.release_logprobs), offsets counted after an echo's prompt text."""
        first, entries = choice.release_logprobs()
        return self._logprobs(choice, chat, entries, first, shift=len(choice.echoed))

    @staticmethod
    async def _event(response: web.StreamResponse, body: dict[str, Any]) -> None:
        await _write(response, b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n")

    def _chunk(self, ident: str, created: int, chat: bool, piece: str | dict[str, str] | None,
               finish: str | None = None, index: int = 0, logprobs: dict[str, Any] | None = None,
               null_usage: bool = False) -> dict[str, Any]:
        """A streamed chunk of one choice, in OpenAI's shape: `logprobs` null where the request asked for none (a chat
        chunk's too), and `usage` null where `null_usage` (stream_options.include_usage: the usage comes last)."""
        if chat:
            delta: dict[str, str] = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        body = {"id": ident, "object": self._chunk_kind(chat), "created": created, "model": self.model_name,
                "choices": [choice]}
        if null_usage:
            body["usage"] = None
        return body

    def _logprobs(self, choice: _Choice, chat: bool, entries: list[TokenLogprob], first: int = 0,
                  shift: int = 0) -> dict[str, Any] | None:
        """The API's `logprobs` of a choice's tokens `entries`, choice.logprobs[first:] (None where its request did
        not ask): a streamed chunk's, whose completion text_offset goes on from the choice's earlier chunks, or the
        whole reply's (first 0); a completion's offsets `shift`ed (an echo's prompt text comes before)."""
        if not choice.show_logprobs:
            return None
        if chat:
            return chat_logprobs(entries, self.tokenizer.token_bytes)
        tokens = [entry.token for entry in choice.logprobs]
        return completion_logprobs(entries, self.tokenizer.token_bytes,
                                   [shift + at for at in self._decoded_lengths(tokens, first, len(entries))])

    def _completion_logprobs(self, choice: _Choice) -> dict[str, Any] | None:
        """A whole completion's `logprobs`; with an echo, the prompt's (_prompt_logprobs), then the generated tokens',
        offsets counted after the echoed text."""
        if not choice.show_logprobs or not choice.echo_scores:
            return self._logprobs(choice, False, choice.logprobs)
        head = self._prompt_logprobs(choice, list((choice.scorer or choice).prompt_scores))
        shown = self._logprobs(choice, False, choice.logprobs, shift=len(choice.echoed))
        assert head is not None and shown is not None
        return {key: [*head[key], *shown[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def _prompt_logprobs(self, choice: _Choice, scored: list[TokenLogprob]) -> dict[str, Any] | None:
        """An echo's prompt tokens' `logprobs`, the first with none (nothing comes before it), the others' `scored`;
        offsets in the echoed text."""
        if not choice.show_logprobs:
            return None
        prompt = choice.request.prompt_ids
        # a prompt sent as text: where its tokenizer put each token in it; as token ids: what the ids before decode to
        starts = self.tokenizer.token_starts(choice.prompt_text) if choice.prompt_text is not None else []
        if len(starts) != len(prompt):
            starts = self._decoded_lengths(prompt, 0, len(prompt))
        head = completion_logprobs(scored, self.tokenizer.token_bytes, starts[1:])
        return {"tokens": [token_text(self.tokenizer.token_bytes(prompt[0])), *head["tokens"]],
                "token_logprobs": [None, *head["token_logprobs"]], "top_logprobs": [None, *head["top_logprobs"]],
                "text_offset": [starts[0], *head["text_offset"]]}

    def _decoded_lengths(self, tokens: list[int], first: int, count: int) -> list[int]:
        """Where the text of each of tokens first..first+count starts in the text they make: the length of the text
        the tokens before it decode to together (a token's text alone, counted, goes astray where a character spans
        tokens or a tokenizer drops a word's leading space)."""
        return [len(self.tokenizer.decode(tokens[:at])) for at in range(first, first + count)]

    @staticmethod
    def _chunk_kind(chat: bool) -> str:
        return "chat.completion.chunk" if chat else "text_completion"

    def _whole(self, ident: str, chat: bool, ended: list[tuple[_Choice, StreamEnd, int]],
               prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """The whole reply of the choices `ended`; `completion_tokens` and `cached_tokens`: every stream's, best_of's
        candidates left out too (they were generated, as OpenAI counts them; which candidate won says nothing of the
        prompt tokens the prefix cache gave)."""
        choices: list[dict[str, Any]] = []
        for choice, end, _ in ended:
            if chat:
                choices.append({"index": choice.index, "message": {"role": "assistant", "content": choice.reply.text},
                                "logprobs": self._logprobs(choice, chat, choice.logprobs),
                                "finish_reason": _finish(choice, end)})
            else:
                choices.append({"index": choice.index, "text": choice.echoed + choice.reply.text,
                                "logprobs": self._completion_logprobs(choice),
                                "finish_reason": _finish(choice, end)})
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens, cached_tokens)}


class _MalformedRequestLog(logging.Filter):
    """aiohttp answers a request it cannot parse (a duplicate Host header, a bad request line) 400 and logs it at
    ERROR with a traceback: any client could fill the server's log with them. Such a record becomes one line naming
    the fault, at WARNING at most (aiohttp says TLS bytes on the port at DEBUG: they stay there)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, web.RequestPayloadError):  # the rest of a body its Content-Encoding cannot decode,
            # read by aiohttp after the 400 went (a traceback at ERROR a request, no key needed)
            as_one_line(record, f"a request body that cannot be read ({error})", logging.WARNING)
        elif isinstance(error, HttpProcessingError) and (error.code or 400) < 500:
            as_one_line(record, f"refused ({error.code} {error.message})", logging.WARNING)
        return True


_MALFORMED_REQUESTS = _MalformedRequestLog()


@dataclass
class _Choice:
    """One of a request's choices: its stream's request, sink and ticket, and its text as far as it goes."""

    index: int
    request: StreamRequest
    bridge: _Bridge
    reply: ReplyText
    prompt_index: int = 0  # which of the request's prompts it answers
    ticket: int = -1  # the service's, once submitted
    ends: frozenset[int] = frozenset()  # the tokens that end its text unseen (EOS, a chat's end of turn)
    echoed: str = ""  # an echo's prompt text, which its text begins with
    prompt_text: str | None = None  # an echo's prompt as sent, where it was text (None: token ids)
    hidden: bool = False  # an echo of max_tokens 0: the one token made is not shown
    show_logprobs: bool = False  # the request asked for them (best_of's ranking asks the stages for them besides)
    echo_scores: bool = False  # an echo with log-probabilities: the reply shows the prompt tokens' too
    # the choice of the same prompt whose stream scores the prompt for this one (a whole reply's); None: its own
    scorer: _Choice | None = None
    prompt_scores: tuple[TokenLogprob, ...] = ()  # the prompt's figures, once its stream scored the prompt
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its tokens', where the request asked
    # the reply's tokens: those made up to the one that completed a stop sequence (usage.completion_tokens: the
    # tokens a drafted round or a step in flight made past it are not the reply's, and how many there are is timing)
    tokens: int = 0
    # the log-probability of each of the reply's tokens, an end's (EOS, a stop token) too, where the stream was given
    # them: what best_of ranks candidates by, whatever the reply shows (echo keeps an end's entry, a reply without
    # one drops it)
    scores: list[float] = field(default_factory=list)
    _kept: list[int] = field(default_factory=list)  # len(logprobs) once each token had been pushed to the reply
    _logprobs_sent: int = 0  # the entries of logprobs released so far (release_logprobs)

    def take(self, event: _Token) -> str:
        """A token that arrived: counted, its log-probabilities kept (up to the token that completes a stop sequence,
        and not for a token that ends the text unseen), its text given to the reply; the text it adds."""
        token, logprob = event
        if self.hidden or self.reply.stopped:
            return ""
        self.tokens += 1
        if logprob is not None:
            self.scores.append(logprob.logprob)
            if token not in self.ends:
                self.logprobs.append(logprob)
        self._kept.append(len(self.logprobs))
        return self.reply.push(token)

    def release_logprobs(self) -> tuple[int, list[TokenLogprob]]:
        """The entries of the tokens whose text the reply has sent since the last call, and the index of the first:
        a streamed chunk's, which go with the text it carries (text held back for a stop sequence holds its
        tokens' entries)."""
        released = self._kept[self.reply.released_tokens - 1] if self.reply.released_tokens else 0
        first, self._logprobs_sent = self._logprobs_sent, max(self._logprobs_sent, released)
        return first, self.logprobs[first:self._logprobs_sent]


def unseen_ends(spec: ModelSpec, decoding: Decoding, stop_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end a reply's text unseen (EOS, a chat's end of turn), which get no log-probability entry;
    none with an echo, whose entries evaluation harnesses read up to the last, the one generated token's
    (lm-evaluation-harness: token_logprobs[ctxlen:-1]), or where the reply runs past them (ignore_eos)."""
    if decoding.ignore_eos or decoding.echo:
        return frozenset()
    return frozenset(spec.eos_token_ids) | stop_ids


async def _read_body(request: web.Request) -> bytes:
    """The request's body, read as it comes: 408 where none of it comes for BODY_TIMEOUT_S (a client that stopped
    midway held its connection with no limit; one that sends steadily, however slowly, is read on), 413 past
    MAX_BODY_BYTES, 400 for bytes its Content-Encoding cannot decode (a 500 before)."""
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                part = await request.content.read(_READ_PART_BYTES)
            if not part:
                return b"".join(parts)
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=size)
            parts.append(part)
    except TimeoutError:
        raise ApiError(408, f"the request body stopped coming: nothing of it for {BODY_TIMEOUT_S:g} s",
                       closes=True) from None
    except web.RequestPayloadError as error:
        raise ApiError(400, f"the request body cannot be read: {str(error)[:200]}", closes=True) from None


async def _write_whole(request: web.Request, response: web.Response) -> web.StreamResponse:
    """Send a whole reply here, a part at a time, each under _client_reads (aiohttp writes it in one go, with no
    limit, after the handler): a client that reads none of it for WRITE_TIMEOUT_S is given up, one that reads
    steadily however slowly is not (a 9 MB reply read at 32 KB/s was cut at 60 s when the limit was the whole's)."""
    body = response.body
    assert isinstance(body, bytes)
    streamed = web.StreamResponse(status=response.status, headers=response.headers)
    streamed.content_length = len(body)
    async with _client_reads():
        await streamed.prepare(request)
    for start in range(0, len(body), _WRITE_PART_BYTES):
        await _write(streamed, body[start:start + _WRITE_PART_BYTES])
    async with _client_reads():
        await streamed.write_eof()
    return streamed


_READ_PART_BYTES = 64 * 1024
_WRITE_PART_BYTES = 64 * 1024


class ClientStalled(ConnectionResetError):
    """A reply's client read none of it for WRITE_TIMEOUT_S."""


@asynccontextmanager
async def _client_reads() -> AsyncIterator[None]:
    """A write to a client, given up (ClientStalled) where it reads nothing for WRITE_TIMEOUT_S."""
    try:
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            yield
    except TimeoutError:
        raise ClientStalled(f"the client read nothing of its reply for {WRITE_TIMEOUT_S:.0f} s") from None


async def _write(response: web.StreamResponse, data: bytes) -> None:
    async with _client_reads():
        await response.write(data)


async def _name_the_request(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer carries an x-request-id, as the API's do: the OpenAI SDKs show it (`_request_id`) for a report."""
    response.headers.setdefault("x-request-id", f"req_{secrets.token_hex(16)}")


def _best(ended: list[tuple[_Choice, StreamEnd, int]], n: int) -> list[tuple[_Choice, StreamEnd, int]]:
    """Of each prompt's candidates (best_of), the `n` whose tokens have the highest mean log-probability (the API's
    "highest log probability per token"; a tie: the lower index), numbered again prompt by prompt. Where there are
    only n a prompt (n choices, or greedy ones), all, as they are."""
    by_prompt: dict[int, list[tuple[_Choice, StreamEnd, int]]] = {}
    for item in ended:
        by_prompt.setdefault(item[0].prompt_index, []).append(item)
    if all(len(items) <= n for items in by_prompt.values()):
        return ended
    chosen: list[tuple[_Choice, StreamEnd, int]] = []
    for prompt_index in sorted(by_prompt):
        ranked = sorted(by_prompt[prompt_index], key=lambda item: (-_mean_logprob(item[0]), item[0].index))[:n]
        for rank, (choice, end, tokens) in enumerate(ranked):
            choice.index = prompt_index * n + rank
            chosen.append((choice, end, tokens))
    return chosen


def _mean_logprob(choice: _Choice) -> float:
    """The mean log-probability of a candidate's tokens, the one that ended it (EOS, a stop token) included; -inf for
    one with none (a failed stream)."""
    return sum(choice.scores) / len(choice.scores) if choice.scores else -math.inf


def _settled(choice: _Choice, end: StreamEnd) -> StreamEnd:
    """A stream's end as its choice takes it: a choice whose stop sequence had ended its text takes a failure that
    came before its cancel was reaped (the run failed within that feed) as its normal end, with no result: its reply
    was whole, and failing the request for it threw away every choice's."""
    if end.error is not None and choice.reply.stopped:
        return StreamEnd(None, cancelled=True)
    return end


def _finish(choice: _Choice, end: StreamEnd) -> str:
    """The API's finish_reason: "stop" (a stop sequence, or the end of the text) or "length" (an echo of max_tokens
    0 too)."""
    if choice.hidden:
        return "length"
    return "stop" if choice.reply.stopped or (end.result is not None and end.result.stopped_by_eos) else "length"


def _has_entries(logprobs: dict[str, Any] | None) -> bool:
    """Whether a chunk's `logprobs` (chat's or a completion's) name a token."""
    return bool(logprobs and (logprobs.get("content") or logprobs.get("tokens")))


def _host_name(host: str) -> str:
    """A Host header's name without its port, lowercase ("LocalHost:8000" -> "localhost", "[::1]:8000" -> "::1")."""
    host = host.lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _cached_tokens(choices: list[_Choice], reused: dict[int, int]) -> int:
    """The prompt tokens the request's streams took from the prefix cache (usage.prompt_tokens_details.cached_tokens):
    a prompt's, counted once as its prompt_tokens are, is the most any of its choices took."""
    by_prompt: dict[int, int] = {}
    for choice in choices:
        by_prompt[choice.prompt_index] = max(by_prompt.get(choice.prompt_index, 0), reused.get(choice.index, 0))
    return sum(by_prompt.values())


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
