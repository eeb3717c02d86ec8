"""What presence/frequency penalties and a logit bias cost the engine: N greedy streams on one local stage, each run
plain and then with StreamRequest.presence_penalty, frequency_penalty and a logit bias of BIASED tokens (the API's
fields), interleaved rounds; with --lookup, both drafted by prompt lookup (a drafted micro-batch otherwise takes only
the in-graph argmax). Prints JSON.

    .venv/bin/python docs/runs/penalties-cost.py out/demo/target-int4 [--streams 8] [--tokens 64] [--rounds 4]
        [--lookup]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.engine import Engine, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--biased", type=int, default=20, help="tokens in the logit bias")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--lookup", action="store_true", help="draft both by prompt lookup")
    args = parser.parse_args()
    manifest = load_manifest(args.model)
    prompts = [[1, *range(100 + 7 * index, 130 + 7 * index)] for index in range(args.streams)]
    bias = tuple((token, 0.5) for token in range(200, 200 + args.biased))
    variants = {"plain": {}, "penalized": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": bias}}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    with LocalPipeline(args.model, 1, CompileSettings(), manifest) as pipeline:
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name, fields in variants.items():
                engine = Engine(pipeline, manifest.spec, PromptLookupDraft() if args.lookup else None)
                for prompt in prompts:
                    engine.add(StreamRequest(prompt, max_new_tokens=args.tokens, ignore_eos=True,
                                             **fields))  # type: ignore[arg-type]
                started = time.perf_counter()
                results = engine.run()
                seconds = time.perf_counter() - started
                if round_:
                    rates[name].append(sum(len(result.tokens) for result in results.values()) / seconds)
    medians = {name: round(statistics.median(values), 1) for name, values in rates.items()}
    print(json.dumps({"model": str(args.model), "streams": args.streams, "tokens": args.tokens,
                      "biased_tokens": args.biased, "lookup": args.lookup, "rounds": args.rounds,
                      "tok_s": {name: [round(v, 1) for v in values] for name, values in rates.items()},
                      "median_tok_s": medians,
                      "with_vs_without": round(medians["penalized"] / medians["plain"], 3)}))


if __name__ == "__main__":
    main()
