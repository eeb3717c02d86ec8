"""`deskfleet serve --fleet` that the test drives line by line, for test_fleet.py; run inside the controller's
namespace:

    python -m tests.integration.fleet_api_session CONTROLLER_DATA_DIR MODEL_DIR

Prints "serving" once the server serves. Then each line read on standard input is a prompt (comma-separated token
ids), sent as a greedy completion of 12 tokens; its text is printed as a JSON string on a line of its own. At the
end of standard input the server is stopped with SIGTERM, and one JSON object is printed: its exit status and what
it wrote on stderr.
"""

from __future__ import annotations

import json
import sys
import threading

from tests.integration.fleet_api import complete, served, stop


def main() -> None:
    with served(sys.argv[1], sys.argv[2]) as (server, port):
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(server.stderr or ()), daemon=True)
        reader.start()  # the server's stderr is read all along: a full pipe would stall it
        print("serving", flush=True)
        for line in sys.stdin:
            print(json.dumps(complete(port, line.strip())), flush=True)
        status = stop(server)
    reader.join(10)
    print(json.dumps({"exit": status, "stderr": "".join(said)}), flush=True)


if __name__ == "__main__":
    main()
