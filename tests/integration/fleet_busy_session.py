"""`deskfleet serve --fleet --take-back-wait 0` kept busy, for test_fleet.py; run inside the controller's namespace:

    python -m tests.integration.fleet_busy_session CONTROLLER_DATA_DIR MODEL_DIR PROMPT LENGTH...

Prints "serving" once the server serves, then keeps it busy: one client thread per LENGTH sends PROMPT
(comma-separated token ids) as a greedy completion of LENGTH tokens (ignore_eos), again and again, so that streams
run all along (lengths that differ keep the clients' requests from ending together). At the end of standard input
the clients stop, the server's /health is read and the server is stopped with SIGTERM; one JSON object is printed:
the distinct texts each length gave, the requests made, /health, the exit status and what the server wrote on
stderr.
"""

from __future__ import annotations

import json
import sys
import threading

from tests.integration.fleet_api import completion_text, health, served, stop


def main() -> None:
    data_dir, model, prompt, lengths = sys.argv[1], sys.argv[2], sys.argv[3], [int(n) for n in sys.argv[4:]]
    with served(data_dir, model, options=["--take-back-wait", "0"]) as (server, port):
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(server.stderr or ()), daemon=True)
        reader.start()  # the server's stderr is read all along: a full pipe would stall it
        stopping = threading.Event()
        texts: dict[int, set[str]] = {length: set() for length in lengths}
        requests = [0]
        failures: list[str] = []

        def client(length: int) -> None:
            while not stopping.is_set():
                try:
                    texts[length].add(completion_text(port, prompt, max_tokens=length, ignore_eos=True))
                    requests[0] += 1
                except Exception as error:  # said in the report: the test fails on it
                    failures.append(f"{length}: {error!r}")
                    return

        clients = [threading.Thread(target=client, args=(length,), daemon=True) for length in lengths]
        for thread in clients:
            thread.start()
        print("serving", flush=True)
        sys.stdin.read()
        stopping.set()
        for thread in clients:
            thread.join(120)
        state = health(port)
        status = stop(server)
    reader.join(10)
    print(json.dumps({"texts": {str(length): sorted(found) for length, found in texts.items()},
                      "requests": requests[0], "failures": failures, "health": state, "exit": status,
                      "stderr": "".join(said)}), flush=True)


if __name__ == "__main__":
    main()
