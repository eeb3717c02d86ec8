"""Two drivers on one deployment at once, for test_fleet.py; run as a process inside the controller's namespace:

    python -m tests.integration.fleet_two_drivers CONTROLLER_DATA_DIR MODEL_DIR

Opens two chains on the deployed stages, the second after the first (so the second says ResultsHere last), then
runs a generation on each in turn, the first again after the second, each with a 20 s step timeout. One results
link per agent sent every result to the chain that opened last: the first chain's run then timed out. Prints one
JSON object: each run's tokens, and a local f32 run's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.engine import Engine, StreamRequest
from deskfleet.controller.fleet_pipeline import FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.pipeline import LocalPipeline

PROMPT = [1, 17, 42, 99, 5]


def generate(chain: object, model: Path) -> list[int]:
    engine = Engine(chain, load_manifest(model).spec)  # type: ignore[arg-type]
    engine.add(StreamRequest(PROMPT, max_new_tokens=10, ignore_eos=True))
    return engine.run()[0].tokens


def main(argv: list[str]) -> int:
    store, model = FleetStore(Path(argv[0])), Path(argv[1])
    with FleetPipeline.from_store(store, model, step_timeout_s=20) as first, \
            FleetPipeline.from_store(store, model, step_timeout_s=20) as second:
        runs = [generate(first, model), generate(second, model)]
        first.renumber()
        runs.append(generate(first, model))
    with LocalPipeline(model, 1, CompileSettings(precision=Precision.F32)) as local:
        expected = generate(local, model)
    print(json.dumps({"runs": runs, "local": expected}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
