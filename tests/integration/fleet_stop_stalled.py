"""`deskfleet serve --fleet` stopped while a step waits for a stalled PC, for test_fleet.py; run inside the
controller's namespace:

    python -m tests.integration.fleet_stop_stalled CONTROLLER_DATA_DIR MODEL_DIR PROMPT MAX_TOKENS

Streams a greedy completion of MAX_TOKENS tokens of PROMPT (comma-separated token ids) and prints "streaming" once
its first tokens came. Then it reads a line on standard input (the test has stopped a PC of the chain with SIGSTOP
meanwhile), waits STALL_S for the step in flight to wait on that PC, stops the server with SIGTERM, and prints one
JSON object: its exit status, the seconds from the SIGTERM to its exit, how the stream ended ("error": an error
event came, the stream was cut short; "finished": it ran to its end before the stop) and what the server wrote on
stderr.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.request

from tests.integration.fleet_api import served

STALL_S = 1.5


def _stream(port: int, prompt: str, max_tokens: int, first: threading.Event, ended: list[str]) -> None:
    body = {"model": "served", "prompt": [int(token) for token in prompt.split(",")], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    how = "no end"
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    how = "error"
                elif event["choices"][0].get("finish_reason"):
                    how = "finished"
                elif event["choices"][0].get("text"):
                    first.set()
    except OSError as error:
        how = f"no end ({error})"
    ended.append(how)
    first.set()


def main() -> None:
    with served(sys.argv[1], sys.argv[2]) as (server, port):
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(server.stderr or ()), daemon=True)
        reader.start()  # the server's stderr is read all along: a full pipe would stall it
        first, ended = threading.Event(), []
        streaming = threading.Thread(target=_stream, args=(port, sys.argv[3], int(sys.argv[4]), first, ended))
        streaming.start()
        assert first.wait(120)
        print("streaming", flush=True)
        sys.stdin.readline()
        time.sleep(STALL_S)
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        status = server.wait(120)
        seconds = time.monotonic() - started
        streaming.join(30)
    reader.join(10)
    print(json.dumps({"exit": status, "seconds": round(seconds, 2), "stream": ended[0] if ended else "running",
                      "stderr": "".join(said)}), flush=True)


if __name__ == "__main__":
    main()
