"""A conversation's turns over the deployed chain, each resuming the KV state the last left, for test_fleet.py; run
as a process inside the controller's namespace:

    python -m tests.integration.fleet_turns CONTROLLER_DATA_DIR MODEL_DIR

Three turns, each prompt repeating the last prompt and reply and adding tokens (the third parts from the kept
tokens inside them), run on the fleet with keep_kv/resume and, for comparison, each whole on a local f32 pipeline.
Prints one JSON object: the fleet's and the local replies, and the tokens each fleet turn's first step fed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward
from deskfleet.controller.engine import Engine, KeptKV, StreamRequest
from deskfleet.controller.fleet_pipeline import FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.pipeline import LocalPipeline


class _Fed:
    """Records the tokens (a row's widest) of every step submitted to a chain."""

    def __init__(self, chain: FleetPipeline) -> None:
        self.chain = chain
        self.widths: list[int] = []

    def submit(self, message: Forward) -> None:
        assert message.input_ids is not None
        self.widths.append(message.input_ids.shape[1])
        self.chain.submit(message)

    def __getattr__(self, name: str) -> object:
        return getattr(self.chain, name)


def main(argv: list[str]) -> int:
    store, model = FleetStore(Path(argv[0])), Path(argv[1])
    spec = load_manifest(model).spec
    prompts = [[1, 17, 42, 99, 5, 7, 3, 250]]
    fleet_replies: list[list[int]] = []
    local_replies: list[list[int]] = []
    fed: list[int] = []
    kept: KeptKV | None = None
    with FleetPipeline.from_store(store, model) as fleet, LocalPipeline(
            model, 1, CompileSettings(precision=Precision.F32)) as local:
        chain = _Fed(fleet)
        for turn in range(3):
            prompt = prompts[-1]
            engine = Engine(chain, spec)  # type: ignore[arg-type]
            engine.add(StreamRequest(prompt, max_new_tokens=10, ignore_eos=True, keep_kv=True, resume=kept))
            steps = len(chain.widths)
            fleet_replies.append(engine.run()[0].tokens)
            fed.append(chain.widths[steps])
            kept = engine.kept_kv(0)
            fresh = Engine(local, spec)
            fresh.add(StreamRequest(prompt, max_new_tokens=10, ignore_eos=True))
            local_replies.append(fresh.run()[0].tokens)
            reply = fleet_replies[-1]
            prompts.append(prompt + reply + [11, 12, 13] if turn == 0 else [*prompt[:6], 200, 201, 202, 203])
        assert kept is not None
        kept.release()
    print(json.dumps({"fleet": fleet_replies, "local": local_replies, "fed": fed,
                      "prompt_lengths": [len(prompt) for prompt in prompts[:3]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
