"""The HTTP clients of `deskfleet bench serve`, in a process of their own: in the server's process their threads
took the interpreter's lock from the server's event loop and the engine, and the API measured their cost as its own.

Standard library only. JSON lines on stdin/stdout, as the other runners (runner_process.py):

    -> {"port": PORT, "model": NAME}
    <- {"ready": true}
    -> {"run": [[ids of user 0], [ids of user 1], ...], "new_tokens": N}
    <- {"users": [{"sent": s, "first": s, "ended": s, "made": n, "text": "..."}, ...]}
    -> "quit"

Each user is a thread with its own HTTP connection sending one streamed completion (`ignore_eos`, greedy); they
start together. Times are this process's perf_counter seconds.
"""

import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _user(port: int, model: str, prompt: list, new_tokens: int, start: threading.Barrier) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    start.wait()
    timed: dict = {"sent": time.perf_counter(), "first": 0.0, "made": 0}
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the API answered {response.status}: {response.read()[:300]!r}")
    pieces: list = []
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"the API's stream failed: {event['error']['message']}")
        if event.get("usage"):
            timed["made"] = event["usage"]["completion_tokens"]
        elif event["choices"][0]["text"]:
            if not pieces:
                timed["first"] = time.perf_counter()
            pieces.append(event["choices"][0]["text"])
    timed["ended"] = time.perf_counter()
    connection.close()
    timed["text"] = "".join(pieces)
    return timed


def _run(port: int, model: str, prompts: list, new_tokens: int) -> list:
    start = threading.Barrier(len(prompts))
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: _user(port, model, prompt, new_tokens, start), prompts))


def main() -> None:
    config = json.loads(sys.stdin.readline())
    port, model = config["port"], config["model"]
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request == "quit":
            return
        try:
            _reply({"users": _run(port, model, request["run"], request["new_tokens"])})
        except Exception as error:  # said to the bench, which stops with it
            _reply({"error": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":
    main()
