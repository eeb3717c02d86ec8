"""A fleet run that holds its model's chain open until its standard input closes, for test_fleet.py: a run in flight
that the test controls (a generation on the tiny model ends too soon to be sure of).

    python -m tests.integration.fleet_holder DATA_DIR MODEL_DIR
Prints "open N" (the chain's stages) once the chain is open, then waits.
"""

from __future__ import annotations

import sys
from pathlib import Path

from deskfleet.controller.chat import controller_store, open_fleet_chain


def main(argv: list[str]) -> int:
    data_dir, model = Path(argv[0]), Path(argv[1])
    with open_fleet_chain(controller_store(data_dir), model, max_failovers=0, discover_seconds=0) as (chain, _):
        print(f"open {chain.num_stages}", flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
