"""What asking for log-probabilities costs the engine (stop 50): N greedy streams on one local stage, each run with
StreamRequest.logprobs None and then TOP (the API's `logprobs` / `top_logprobs`), interleaved rounds; prints JSON.
With --score P: instead, N prompts of P tokens each prefilled (one token generated) with and without scoring every
prompt token (an echo's prompt_logprobs), prompt tokens a second.

    .venv/bin/python docs/runs/logprobs-cost.py out/demo/target-int4 [--streams 8] [--tokens 64] [--top 5] [--rounds 4]
    .venv/bin/python docs/runs/logprobs-cost.py out/demo/target-int4 --score 512 --streams 1 --top 1
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--score", type=int, default=0, help="prompt tokens to score (0: time generation instead)")
    args = parser.parse_args()
    manifest = load_manifest(args.model)
    if args.score:
        prompts = [[1, *((7 * index + 13 * at) % 8000 + 3 for at in range(args.score - 1))]
                   for index in range(args.streams)]
        args.tokens = 1
    else:
        prompts = [[1, *range(100 + 7 * index, 130 + 7 * index)] for index in range(args.streams)]
    rates: dict[str, list[float]] = {"none": [], f"top_{args.top}": []}
    with LocalPipeline(args.model, 1, CompileSettings(), manifest) as pipeline:
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name, top in (("none", None), (f"top_{args.top}", args.top)):
                engine = Engine(pipeline, manifest.spec)
                for prompt in prompts:
                    engine.add(StreamRequest(prompt, max_new_tokens=args.tokens, ignore_eos=True, logprobs=top,
                                             prompt_logprobs=bool(args.score) and top is not None))
                started = time.perf_counter()
                results = engine.run()
                seconds = time.perf_counter() - started
                made = sum(len(prompt) for prompt in prompts) if args.score else \
                    sum(len(result.tokens) for result in results.values())
                if round_:
                    rates[name].append(made / seconds)
    medians = {name: round(statistics.median(values), 1) for name, values in rates.items()}
    print(json.dumps({"model": str(args.model), "streams": args.streams, "tokens": args.tokens,
                      "scored_prompt_tokens": args.score, "rate": "prompt tokens a second" if args.score else "tok/s",
                      "rounds": args.rounds, "tok_s": {name: [round(v, 1) for v in values]
                                                       for name, values in rates.items()},
                      "median_tok_s": medians,
                      "with_vs_without": round(medians[f"top_{args.top}"] / medians["none"], 3)}))


if __name__ == "__main__":
    main()
