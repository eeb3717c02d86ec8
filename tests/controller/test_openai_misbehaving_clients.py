"""`deskfleet serve`'s API against clients that misbehave at the HTTP level (found by a fuzzer): bodies that cannot be
decoded or never finish, connections that send nothing, a streamed reply nobody reads, a wrong method, a body too
large, and a request whose prompts cannot all run."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from deskfleet.controller import openai_api
from deskfleet.controller.engine_service import EngineService
from deskfleet.controller.openai_api import MAX_BODY_BYTES, OpenAiApi

from .test_openai_api import MODEL, post, serving


@pytest.fixture
def quick_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_api, "WRITE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(openai_api, "KEEPALIVE_S", 0.5)


@pytest.fixture
def server(tiny_export: Path, quick_timeouts: None) -> Iterator[tuple[str, EngineService]]:
    with serving(tiny_export) as served:
        yield served


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _answer(raw: socket.socket) -> bytes:
    answer = b""
    while chunk := raw.recv(65536):
        answer += chunk
    return answer


def _read_to_the_end(raw: socket.socket) -> tuple[bytes, str]:
    """What the server sent until the connection ended, and how it ended: "reset", "closed", or "kept open" (nothing
    more came for 10 s)."""
    raw.settimeout(10)
    got = b""
    try:
        while chunk := raw.recv(1 << 20):
            got += chunk
    except ConnectionResetError:
        return got, "reset"
    except TimeoutError:
        return got, "kept open"
    return got, "closed"


def test_a_body_that_does_not_decode_under_its_content_encoding_is_a_400(server: tuple[str, EngineService]) -> None:
    # aiohttp's RequestPayloadError went unanswered: a plain-text 500, logged twice at ERROR
    url, _ = server
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1}).encode()
    for encoding in ("gzip", "deflate"):
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json",
                                                                        "Content-Encoding": encoding})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400, encoding
        assert "the request body cannot be read" in json.loads(refused.value.read())["error"]["message"]
    request = urllib.request.Request(f"{url}/v1/completions", gzip.compress(body),  # a real gzip body is read
                                     {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def test_a_body_that_stops_midway_is_refused_408_once_its_time_is_up_and_its_connection_closed(
        server: tuple[str, EngineService], monkeypatch: pytest.MonkeyPatch) -> None:
    # Content-Length 100 and one byte sent: the connection was held with no timeout at all
    monkeypatch.setattr(openai_api, "BODY_TIMEOUT_S", 0.5)  # (not for the other tests: a 4 MiB upload under load)
    url, _ = server
    with socket.create_connection(_address(url), timeout=30) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{")
        started = time.monotonic()
        answer = raw.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and b"stopped coming: nothing of it for" in answer, answer[:300]
        assert b"Connection: close" in answer
        # what the client sends next is the rest of that body, no request: it is not answered, the connection goes
        raw.sendall(b"}" * 99 + b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        after, ended = _read_to_the_end(raw)
    assert after == b"" and ended == "closed", (after[:300], ended)
    assert time.monotonic() - started < 10


def test_a_body_that_comes_slowly_but_steadily_is_read(server: tuple[str, EngineService],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the limit is on a silence, not on the whole upload: a 4 MB body under ~70 KB/s was refused at 60 s
    monkeypatch.setattr(openai_api, "BODY_TIMEOUT_S", 0.5)
    url, _ = server
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 2}).encode()
    parts = [body[start:start + 16] for start in range(0, len(body), 16)]
    with socket.create_connection(_address(url), timeout=30) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        started = time.monotonic()
        for part in parts:  # each 0.3 s after the last: the whole takes longer than the limit
            time.sleep(0.3)
            raw.sendall(part)
        answer, _ = _read_to_the_end(raw)
    assert time.monotonic() - started > 1.0 and answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_a_connection_that_sends_no_request_is_closed(server: tuple[str, EngineService]) -> None:
    # aiohttp's default kept it 3,630 s: 200 such sockets took every file handle a lowered limit left
    url, _ = server
    for first in (b"", b"GET /v1/models HTTP/1.1\r\nHo"):  # nothing, or half a header
        with socket.create_connection(_address(url), timeout=30) as raw:
            raw.sendall(first)
            started = time.monotonic()
            assert raw.recv(65536) == b""  # closed by the server
            assert time.monotonic() - started < 10


def test_a_streamed_reply_nobody_reads_is_given_up_and_its_streams_cancelled(
        server: tuple[str, EngineService]) -> None:
    # the reply waited, whole, in the server's memory for as long as the client kept its socket open
    url, service = server
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 400, "n": 16, "logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.socket() as raw:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        raw.settimeout(30)
        raw.connect(_address(url))
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        cancelled = service.streams_cancelled
        deadline = time.monotonic() + 120
        while service.live_streams or service.streams_cancelled == cancelled:  # not one byte read meanwhile
            assert time.monotonic() < deadline, "the stalled reply was not given up"
            time.sleep(0.1)
        assert service.streams_cancelled - cancelled >= 1
        _, ended = _read_to_the_end(raw)
        assert ended in ("reset", "closed")  # dropped: what the kernel held, then the end
    assert post(f"{url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200


def test_a_whole_reply_nobody_reads_is_given_up(server: tuple[str, EngineService]) -> None:
    # aiohttp wrote a whole reply with no time limit: a client that read none of it held it in memory for good
    url, service = server
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 400, "n": 16, "logprobs": 20,
                       "ignore_eos": True}).encode()
    with socket.socket() as raw:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.settimeout(30)
        raw.connect(_address(url))
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # the 16 x 400 tokens are made (a few seconds; on a loaded CI machine past the 8 s this test slept, and the
        # reply, not given up yet, was read whole), then the write waits 1 s for the client
        deadline = time.monotonic() + 120
        time.sleep(0.5)
        while service.live_streams and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(4)
        got, ended = _read_to_the_end(raw)
    head, _, reply = got.partition(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
    assert ended != "kept open" and len(reply) < length, (ended, len(reply), length)  # what the kernel held, cut


def test_a_whole_reply_whose_parts_each_go_within_the_limit_is_not_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    # the limit was on writing the whole reply: a 9 MB reply read steadily at 32 KB/s was cut at 60 s. Now each part
    # must go within it (the kernel lets a writer on only once half its send buffer is free, so a part's wait is
    # that half's time at the client's rate: 1.4 MB at 32 KB/s, 44 s). Here each part of five takes 0.3 s, against
    # a limit of 0.5 s
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    monkeypatch.setattr(openai_api, "WRITE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(openai_api, "_WRITE_PART_BYTES", 10)
    written: list[bytes] = []

    async def slow_write(self: web.StreamResponse, data: bytes) -> None:
        await asyncio.sleep(0.3)
        written.append(bytes(data))

    async def quick(self: web.StreamResponse, *args: object) -> None:
        return None

    monkeypatch.setattr(web.StreamResponse, "write", slow_write)
    monkeypatch.setattr(web.StreamResponse, "prepare", quick)
    monkeypatch.setattr(web.StreamResponse, "write_eof", quick)
    whole = web.json_response({"text": "x" * 30})
    asyncio.run(openai_api._write_whole(make_mocked_request("POST", "/v1/completions"), whole))
    assert b"".join(written) == whole.body and len(written) == 5


def test_a_wrong_method_names_the_right_one_and_sends_allow(server: tuple[str, EngineService]) -> None:
    url, _ = server
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{url}/v1/completions", timeout=30)
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "POST"
    assert json.loads(refused.value.read())["error"]["message"] == "GET is not allowed on /v1/completions: use POST"


def test_a_body_too_large_is_refused_saying_the_limit(server: tuple[str, EngineService]) -> None:
    url, _ = server
    got, answer = post(f"{url}/v1/completions", "{" + " " * MAX_BODY_BYTES + "}")
    assert got == 413 and answer["error"]["message"] == "the request body is larger than this server takes (4 MiB)"


def test_completion_prompts_are_tokenized_off_the_event_loop_and_not_at_all_when_they_cannot_all_run(
        server: tuple[str, EngineService], monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 prompts of 64,000 characters were tokenized on the event loop (3.3 s of every stream's), then refused
    url, _ = server
    threads: list[str] = []
    prepare = OpenAiApi._prepare_prompts

    def recorded(api: OpenAiApi, parsed: object) -> object:
        threads.append(threading.current_thread().name)
        return prepare(api, parsed)  # type: ignore[arg-type]

    monkeypatch.setattr(OpenAiApi, "_prepare_prompts", recorded)
    got, _ = post(f"{url}/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1})
    assert got == 200 and len(threads) == 1 and "asyncio" in threads[0]  # a worker of asyncio.to_thread
    got, answer = post(f"{url}/v1/completions", {"model": MODEL, "prompt": ["#" * 1000] * 64, "n": 2,
                                                 "max_tokens": 1})
    assert got == 400 and "64 prompts of n=2 choices each are more streams" in answer["error"]["message"]
    assert len(threads) == 1  # refused before any was tokenized
