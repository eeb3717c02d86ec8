"""A client of `deskfleet serve`'s OpenAI-compatible API for the chat window (controller/chat_window.py): the
models it serves, and a chat reply streamed as server-sent events, which another thread may cancel at any moment,
also before the server has answered. Standard library HTTP only, no Qt: the window runs it on a thread of its own.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000/v1"  # `deskfleet serve`'s own default
CONNECT_TIMEOUT_S = 10.0
# between two chunks of a reply: a fleet's first token may wait for a re-plan (a minute or more); Stop ends it sooner
READ_TIMEOUT_S = 300.0
MAX_ERROR_BODY_BYTES = 64 * 1024
CONTEXT_FULL = "context_length_exceeded"  # the API's error code for a conversation past the model's context


class ChatClientError(Exception):
    """The server could not be asked, or refused; the message names the server and what to do, `code` the API's
    error code where it gave one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ReplySettings:
    max_tokens: int | None = 256  # as `deskfleet chat`'s; None: the rest of the model's context
    temperature: float = 0.7
    seed: int | None = None


@dataclass(frozen=True)
class ReplyEnd:
    """How a reply ended: `finish_reason` "stop" (the model ended it) or "length" (max tokens), None when it was
    cancelled; the server's token counts where it gave them."""

    finish_reason: str | None
    completion_tokens: int | None = None


class ChatClient:
    """`base_url` is the API's root as OpenAI clients take it (http://HOST:PORT/v1)."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, ca_file: Path | None = None) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{base_url!r:.80} is no http:// or https:// address of a server: give the API's root, "
                             f"such as {DEFAULT_URL}")
        try:
            parsed.port  # noqa: B018  # a port out of range raises here
        except ValueError as error:
            raise ValueError(f"{base_url!r:.80}: {error}") from None
        self.base_url = base_url.rstrip("/")
        self._parsed = parsed
        self._path = parsed.path.rstrip("/")
        self._api_key = api_key
        self._ca_file = ca_file
        self._tls: ssl.SSLContext | None = None
        if parsed.scheme == "https":
            try:
                self._tls = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            except (OSError, ssl.SSLError) as error:
                raise ValueError(f"--ca-file {ca_file}: {getattr(error, 'strerror', None) or error}: give a "
                                 "certificate in PEM") from None

    def models(self) -> list[str]:
        """The ids of the models the server serves (`GET /v1/models`)."""
        connection = self.connection()
        try:
            response = self.request(connection, "GET", "/models", None)
            try:
                body = json.loads(response.read(MAX_ERROR_BODY_BYTES))
                return [str(model["id"]) for model in body["data"]]
            except (ValueError, KeyError, TypeError) as error:
                raise ChatClientError(f"{self.base_url}/models answered what is no OpenAI model list ({error}): is "
                                      "this a deskfleet serve?") from None
        finally:
            connection.close()

    def health(self) -> dict[str, Any] | None:
        """What the server's `GET /health` says (its chain's status and stages), beside the API's root; None where
        the API's root does not end in /v1, so that there is no telling where /health is."""
        if not self._path.endswith("/v1"):
            return None
        connection = self.connection()
        try:
            response = self.request(connection, "GET", "/health", None, root=self._path.removesuffix("/v1"))
            try:
                body = json.loads(response.read(MAX_ERROR_BODY_BYTES))
            except ValueError as error:
                raise ChatClientError(f"{self.base_url}: its /health is not JSON ({error})") from None
            return body if isinstance(body, dict) else None
        finally:
            connection.close()

    def reply(self, model: str, messages: list[dict[str, str]], settings: ReplySettings) -> ReplyStream:
        """The assistant's next message in `messages`, to be streamed: nothing is sent before its `open()`."""
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                                "temperature": settings.temperature, "stream_options": {"include_usage": True}}
        if settings.max_tokens is not None:
            body["max_tokens"] = settings.max_tokens
        if settings.seed is not None:
            body["seed"] = settings.seed
        return ReplyStream(self, json.dumps(body).encode("utf-8"))

    def connection(self) -> http.client.HTTPConnection:
        """A connection to the server, not yet made."""
        host, port = self._parsed.hostname or "", self._parsed.port
        if self._tls is not None:
            return http.client.HTTPSConnection(host, port, timeout=CONNECT_TIMEOUT_S, context=self._tls)
        return http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)

    def request(self, connection: http.client.HTTPConnection, method: str, path: str,
                body: bytes | None, root: str | None = None) -> http.client.HTTPResponse:
        """Send a request for `path` under the API's root (`root`: another) on `connection` (made now where it is
        not yet) and take the answer's head; ChatClientError when nothing answers or the answer is not 200."""
        headers: dict[str, str | bytes] = {"Accept": "application/json, text/event-stream"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._api_key:  # UTF-8, as `serve` compares it (http.client would send a str as Latin-1)
            headers["Authorization"] = b"Bearer " + self._api_key.encode("utf-8")
        url = f"{self.base_url}{path}"
        try:
            if connection.sock is None:
                connection.connect()
            if connection.sock is not None:
                connection.sock.settimeout(READ_TIMEOUT_S)
            connection.request(method, (self._path if root is None else root) + path, body, headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as error:
            raise self.failure(url, error) from None
        if response.status == 200:
            return response
        raise _refusal(url, response, path)

    def failure(self, url: str, error: OSError | http.client.HTTPException) -> ChatClientError:
        """Why `url` could not be asked, in words, with what to do."""
        if isinstance(error, ssl.SSLCertVerificationError):
            trust = f"is --ca-file {self._ca_file} the certificate it serves (or its CA's)?" if self._ca_file else \
                "a server with a certificate of its own needs --ca-file"
            return ChatClientError(f"{url}: its certificate is not trusted ({error.verify_message}): {trust}")
        if isinstance(error, ssl.SSLError):
            plain = " (a plain http:// server? give --url http://...)" if error.reason == "WRONG_VERSION_NUMBER" else ""
            return ChatClientError(f"{url}: the TLS handshake failed ({error.reason or error}){plain}")
        if isinstance(error, ConnectionRefusedError):
            return ChatClientError(f"nothing answers at {self.base_url} (connection refused): start `deskfleet serve` "
                                   "there, or give the window its --url")
        return ChatClientError(f"{url}: {_said(error)}")


class ReplyStream:
    """One streamed reply: `open()` asks for it, iterating gives its text as it comes; `cancel()`, from any thread at
    any moment (before `open()`, while it waits for the server's answer, during the reply), ends it, and the server
    stops generating it; `end` says how it ended once the iteration is over."""

    def __init__(self, client: ChatClient, body: bytes) -> None:
        self._client = client
        self._body = body
        self._connection = client.connection()
        self._response: http.client.HTTPResponse | None = None
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self.end: ReplyEnd | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def open(self) -> None:
        """Send the request and take the answer's head: ChatClientError where it is refused (`code` the API's),
        nothing where the stream was cancelled meanwhile (the iteration then ends at once)."""
        try:
            with self._lock:
                if self.cancelled:
                    return
            self._connection.connect()  # made here, not in request(): cancel() can now shut it
            if self.cancelled:
                return
            self._response = self._client.request(self._connection, "POST", "/chat/completions", self._body)
        except ChatClientError:
            self._connection.close()
            if self.cancelled:  # the shut socket's error: the user's Stop, not the server's refusal
                return
            raise
        except OSError as error:  # in connect(): refused, unreachable, a TLS handshake
            self._connection.close()
            if self.cancelled:
                return
            raise self._client.failure(f"{self._client.base_url}/chat/completions", error) from None

    def cancel(self) -> None:
        with self._lock:
            self._cancelled.set()
            sock = self._connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread reading it; the server sees the client go
            except OSError:
                pass

    def __iter__(self) -> Iterator[str]:
        finish: str | None = None
        tokens: int | None = None
        done = False
        try:
            for data in self._events():
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ChatClientError(f"{self._client.base_url} sent a chunk that is not JSON: {data[:80]!r}") \
                        from None
                if not isinstance(event, dict):
                    raise ChatClientError(f"{self._client.base_url} sent a chunk that is no object: {data[:80]!r}")
                if "error" in event:  # a reply that failed on the way (the fleet lost a PC past what re-planning mends)
                    raise ChatClientError(f"the server's reply failed: {_error_text(event)}")
                if isinstance(event.get("usage"), dict):
                    tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece
                    finish = choice.get("finish_reason") or finish
        except (OSError, http.client.HTTPException) as error:
            if not self.cancelled:
                raise ChatClientError(f"the connection to {self._client.base_url} broke during the reply "
                                      f"({_said(error)})") from None
        finally:
            self._connection.close()
        if not done and not self.cancelled:  # http.client reads a cut chunked body as its end, without a word
            raise ChatClientError(f"the connection to {self._client.base_url} broke during the reply (it ended "
                                  "before the reply did: the server stopped?)")
        self.end = ReplyEnd(None if self.cancelled else finish, tokens)

    def _events(self) -> Iterator[str]:
        """The `data` of each server-sent event, lines of one event joined."""
        if self._response is None:  # cancelled before it was asked
            return
        lines: list[str] = []
        while not self.cancelled:
            raw = self._response.readline()
            if not raw:
                break
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line.startswith("data:"):
                lines.append(line[5:].removeprefix(" "))
            elif not line and lines:
                yield "\n".join(lines)
                lines = []
        if lines and not self.cancelled:
            yield "\n".join(lines)


def _refusal(url: str, response: http.client.HTTPResponse, path: str) -> ChatClientError:
    """A server's non-200 answer, in words, with its error code."""
    code = None
    try:
        body = json.loads(response.read(MAX_ERROR_BODY_BYTES))
        said = _error_text(body) if isinstance(body, dict) else ""
        error = body.get("error") if isinstance(body, dict) else None
        code = error.get("code") if isinstance(error, dict) and isinstance(error.get("code"), str) else None
    except (OSError, ValueError, http.client.HTTPException):
        said = ""
    said = said or response.reason or "no reason given"
    if response.status == 401:
        return ChatClientError(f"{url} wants an API key ({said}): give the window the server's --api-key-file", code)
    if response.status == 404 and path == "/models":
        return ChatClientError(f"{url} answered 404 ({said}): is --url the API's root, ending in /v1?", code)
    return ChatClientError(f"{url} answered {response.status}: {said}", code)


def _error_text(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or "")


def _said(error: BaseException) -> str:
    return getattr(error, "strerror", None) or str(error) or type(error).__name__
