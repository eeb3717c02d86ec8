"""`deskfleet serve --fleet` for test_fleet.py; run as a process inside the controller's namespace:

    python -m tests.integration.fleet_api CONTROLLER_DATA_DIR MODEL_DIR PROMPT_IDS...

Starts the server on the deployed chain (loopback, a free port), sends every prompt (comma-separated token ids)
at once as a greedy completion of 12 tokens, then the first again asking for log-probabilities, and for its
prompt's scores (an echo of max_tokens 0), then stops the server with SIGTERM; then asks a local f32 server (one
stage) the same. Prints one JSON object: each completion's text, the server's exit status, and both servers'
`logprobs` of the first prompt and of its echo.
"""

from __future__ import annotations

import ctypes
import json
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
PR_SET_PDEATHSIG = 1  # prctl(2)


def complete(port: int, prompt: str) -> str:
    return str(_completion(port, prompt)["text"])


def logprobs(port: int, prompt: str) -> object:
    """A greedy completion's `logprobs` with the 3 most likely tokens at each position."""
    return _completion(port, prompt, logprobs=3)["logprobs"]


def scores(port: int, prompt: str) -> object:
    """The prompt's own `logprobs` (an echo of max_tokens 0, as evaluation harnesses score a text)."""
    return _completion(port, prompt, logprobs=1, echo=True, max_tokens=0)["logprobs"]


def cached(port: int, prompt: str) -> tuple[str, int]:
    """A greedy completion's text, and how many of its prompt tokens came from the server's prefix cache."""
    body = _request(port, prompt)
    return str(body["choices"][0]["text"]), int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def penalties(port: int, prompt: str) -> str:
    """A greedy completion's text with presence and frequency penalties and a logit bias, applied on the last stage."""
    return str(_completion(port, prompt, presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"7": 2.0})["text"])


def health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
        return dict(json.loads(response.read()))


def completion_text(port: int, prompt: str, **fields: object) -> str:
    """A greedy completion's text, with the request's `fields` (max_tokens, ignore_eos, ...)."""
    return str(_completion(port, prompt, **fields)["text"])


def _completion(port: int, prompt: str, **fields: object) -> dict[str, object]:
    return dict(_request(port, prompt, **fields)["choices"][0])


def _request(port: int, prompt: str, **fields: object) -> dict[str, Any]:
    body = {"model": "served", "prompt": [int(token) for token in prompt.split(",")], "max_tokens": 12,
            "temperature": 0, **fields}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def _ends_with_parent() -> None:
    """In the server's child process: SIGTERM it when this helper dies, however (a test that failed kills the
    helper, whose own cleanup then never runs: its server lived on, idle, after the test run)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(data_dir: str, model: str, fleet: bool = True,
                 options: Sequence[str] = ()) -> tuple[subprocess.Popen[str], int]:
    """`deskfleet serve --fleet` (or, not `fleet`, on one local stage in f32) on a free loopback port with `options`,
    once it serves; its port. SystemExit where it did not start, saying what it said."""
    where = ["--fleet", "--data-dir", data_dir, "--discover-seconds", "0"] if fleet else ["--precision", "f32"]
    server = subprocess.Popen([str(BIN / "deskfleet"), "serve", "--model", model, *where, "--listen", "127.0.0.1:0",
                               "--model-name", "served", *options],
                              stderr=subprocess.PIPE, text=True, preexec_fn=_ends_with_parent)
    assert server.stderr is not None
    said = ""
    for line in server.stderr:
        said += line
        if "serving" in line:
            break
    found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", said)
    if found is None:
        server.kill()
        server.wait()
        raise SystemExit(f"the server did not start: {said}")
    return server, int(found[1])


@contextmanager
def served(data_dir: str, model: str, fleet: bool = True,
           options: Sequence[str] = ()) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """start_server's server and port; killed on the way out where it still runs."""
    server, port = start_server(data_dir, model, fleet, options)
    try:
        yield server, port
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def stop(server: subprocess.Popen[str]) -> int:
    """Stop the server as a service manager does (SIGTERM); its exit status."""
    server.send_signal(signal.SIGTERM)
    return server.wait(60)


def main() -> None:
    data_dir, model, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
    with served(data_dir, model) as (server, port):
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda prompt: complete(port, prompt), prompts))
        on_fleet = logprobs(port, prompts[0]), scores(port, prompts[0])
        # the same prompt twice in turn: the second starts from the state the first left on the PCs
        repeated = [cached(port, prompts[1]) for _ in range(2)]
        penalized = penalties(port, prompts[2])
        status = stop(server)
    with served(data_dir, model, fleet=False) as (server, port):
        local = logprobs(port, prompts[0]), scores(port, prompts[0])
        local_penalized = penalties(port, prompts[2])
        stop(server)
    print(json.dumps({"texts": texts, "exit": status, "logprobs": {"fleet": on_fleet[0], "local": local[0]},
                      "scores": {"fleet": on_fleet[1], "local": local[1]}, "repeated": repeated,
                      "penalized": {"fleet": penalized, "local": local_penalized}}))


if __name__ == "__main__":
    main()
