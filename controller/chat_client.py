"""A client of `deskfleet serve`'s OpenAI-compatible API for the chat window (controller/chat_window.py): the
models it serves, and a chat reply streamed as server-sent events, which another thread may cancel. Standard library
HTTP only, no Qt: the window runs it on a thread of its own.
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


class ChatClientError(Exception):
    """The server could not be asked, or refused; the message names the server and what to do."""


@dataclass(frozen=True)
class ReplySettings:
    max_tokens: int | None = None  # None: the rest of the model's context, as the API takes it
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
        self._tls = ssl.create_default_context(cafile=str(ca_file) if ca_file else None) \
            if parsed.scheme == "https" else None

    def models(self) -> list[str]:
        """The ids of the models the server serves (`GET /v1/models`)."""
        connection = self._connect()
        try:
            response = self._request(connection, "GET", "/models", None)
            try:
                body = json.loads(response.read(MAX_ERROR_BODY_BYTES))
                return [str(model["id"]) for model in body["data"]]
            except (ValueError, KeyError, TypeError) as error:
                raise ChatClientError(f"{self.base_url}/models answered what is no OpenAI model list ({error}): is "
                                      "this a deskfleet serve?") from None
        finally:
            connection.close()

    def open_reply(self, model: str, messages: list[dict[str, str]], settings: ReplySettings) -> ReplyStream:
        """Ask for the assistant's next message in `messages`, streamed; ChatClientError when it is refused."""
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                                "temperature": settings.temperature, "stream_options": {"include_usage": True}}
        if settings.max_tokens is not None:
            body["max_tokens"] = settings.max_tokens
        if settings.seed is not None:
            body["seed"] = settings.seed
        connection = self._connect()
        try:
            response = self._request(connection, "POST", "/chat/completions", json.dumps(body).encode("utf-8"))
        except BaseException:
            connection.close()
            raise
        return ReplyStream(connection, response, self.base_url)

    def _connect(self) -> http.client.HTTPConnection:
        host, port = self._parsed.hostname or "", self._parsed.port
        if self._tls is not None:
            return http.client.HTTPSConnection(host, port, timeout=CONNECT_TIMEOUT_S, context=self._tls)
        return http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)

    def _request(self, connection: http.client.HTTPConnection, method: str, path: str,
                 body: bytes | None) -> http.client.HTTPResponse:
        headers = {"Accept": "application/json, text/event-stream"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        url = f"{self.base_url}{path}"
        try:
            connection.request(method, self._path + path, body, headers)
            if connection.sock is not None:
                connection.sock.settimeout(READ_TIMEOUT_S)
            response = connection.getresponse()
        except ssl.SSLError as error:
            raise ChatClientError(f"{url}: the TLS handshake failed ({error.reason or error}); a server with a "
                                  "certificate of its own needs --ca-file") from None
        except ConnectionRefusedError:
            raise ChatClientError(f"nothing answers at {self.base_url} (connection refused): start `deskfleet serve` "
                                  "there, or give the window its --url") from None
        except (OSError, http.client.HTTPException) as error:
            raise ChatClientError(f"{url}: {getattr(error, 'strerror', None) or error or type(error).__name__}") \
                from None
        if response.status == 200:
            return response
        raise ChatClientError(_refusal(url, response))


class ReplyStream:
    """One streamed reply: iterate for its text as it comes; `cancel()` (from any thread) ends it, and the server
    stops generating it; `end` says how it ended once the iteration is over."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse,
                 base_url: str) -> None:
        self._connection = connection
        self._response = response
        self._base_url = base_url
        self._cancelled = threading.Event()
        self.end: ReplyEnd | None = None

    def cancel(self) -> None:
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
        try:
            for data in self._events():
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ChatClientError(f"{self._base_url} sent a chunk that is not JSON: {data[:80]!r}") from None
                if not isinstance(event, dict):
                    raise ChatClientError(f"{self._base_url} sent a chunk that is no object: {data[:80]!r}")
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
            if not self._cancelled.is_set():
                raise ChatClientError(f"the connection to {self._base_url} broke during the reply "
                                      f"({getattr(error, 'strerror', None) or error or type(error).__name__})") \
                    from None
        finally:
            self._connection.close()
        self.end = ReplyEnd(None if self._cancelled.is_set() else finish, tokens)

    def _events(self) -> Iterator[str]:
        """The `data` of each server-sent event, lines of one event joined."""
        lines: list[str] = []
        while not self._cancelled.is_set():
            raw = self._response.readline()
            if not raw:
                break
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line.startswith("data:"):
                lines.append(line[5:].removeprefix(" "))
            elif not line and lines:
                yield "\n".join(lines)
                lines = []
        if lines and not self._cancelled.is_set():
            yield "\n".join(lines)


def _refusal(url: str, response: http.client.HTTPResponse) -> str:
    """What a server's non-200 answer says, in words."""
    try:
        body = json.loads(response.read(MAX_ERROR_BODY_BYTES))
        said = _error_text(body) if isinstance(body, dict) else ""
    except (OSError, ValueError, http.client.HTTPException):
        said = ""
    said = said or response.reason or "no reason given"
    if response.status == 401:
        return f"{url} wants an API key ({said}): give the window the server's --api-key-file"
    return f"{url} answered {response.status}: {said}"


def _error_text(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or "")
