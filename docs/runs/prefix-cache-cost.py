"""What the prefix cache (`serve --prefix-cache-tokens`) saves a chat: USERS chats at once on one engine (one local
stage), each of TURNS turns whose prompt repeats the conversation so far (a shared system prompt, then each earlier
user message and reply) plus a new user message, as an OpenAI client sends it; each user's next turn comes when its
last reply ends. Run with the cache off and on, in interleaved rounds; prints JSON: the median time to a turn's first
token, the run's wall time and tok/s, the prompt tokens fed and taken from the cache, and whether every reply was the
same both ways (greedy; with `--precision f32`: under `fast` the CPU plugin quantizes a call's activations
dynamically, so a prompt fed in other pieces may part from the whole prompt's tokens, as it does with chunked prefill).

    .venv/bin/python docs/runs/prefix-cache-cost.py out/demo/target-int4 [--users 1] [--turns 8] [--rounds 3]
        [--precision f32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline


def _words(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(count)]


def run(pipeline: LocalPipeline, vocab: int, args: argparse.Namespace, cache_tokens: int) -> dict[str, object]:
    engine = Engine(pipeline, pipeline.manifest.spec, None, EngineOptions(prefix_cache_tokens=cache_tokens))
    rng = random.Random(0)
    system = _words(rng, args.system, vocab)
    messages = [[_words(rng, args.message, vocab) for _ in range(args.turns)] for _ in range(args.users)]
    history = [list(system) for _ in range(args.users)]
    turn = [0] * args.users
    current: dict[int, tuple[int, float, list[int]]] = {}  # user -> (stream id, added at, prompt)
    waits: list[float] = []
    replies: dict[str, list[int]] = {}  # by "user/turn": users end their turns in another order from run to run
    fed = [0, 0]  # prompt tokens, of them from the cache

    def feed(idle: bool) -> bool:
        for user in range(args.users):
            if user in current:
                stream_id, added_at, prompt = current[user]
                if not engine.is_done(stream_id):
                    continue
                result = engine.forget(stream_id)
                waits.append(engine_start + result.first_token_s - added_at)
                replies[f"{user}/{turn[user]}"] = result.tokens
                fed[0] += len(prompt)
                fed[1] += result.reused_tokens
                history[user] = prompt + result.tokens
                del current[user]
            if turn[user] < args.turns:
                prompt = history[user] + messages[user][turn[user]]
                turn[user] += 1
                stream_id = engine.add(StreamRequest(prompt, max_new_tokens=args.reply, ignore_eos=True))
                current[user] = (stream_id, time.perf_counter(), prompt)
        return bool(current)

    engine_start = time.perf_counter()  # run() starts its clock (first_token_s) as it is called, below
    started = engine_start
    engine.run(feed=feed)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tok_s": sum(len(reply) for reply in replies.values()) / seconds,
            "median_first_token_ms": 1000 * statistics.median(waits), "prompt_tokens": fed[0],
            "cached_tokens": fed[1], "replies": replies}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--users", type=int, default=1)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=200, help="system prompt tokens")
    parser.add_argument("--message", type=int, default=40, help="tokens of each user message")
    parser.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    parser.add_argument("--cache-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", choices=[p.value for p in Precision], default=Precision.FAST.value)
    args = parser.parse_args()
    manifest = load_manifest(args.model)
    variants = {"off": 0, "on": args.cache_tokens}
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
    settings = CompileSettings(precision=Precision(args.precision))
    with LocalPipeline(args.model, 1, settings, manifest) as pipeline:
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name, tokens in variants.items():
                result = run(pipeline, manifest.spec.vocab_size, args, tokens)
                if round_:
                    runs[name].append(result)
    identical = all(on["replies"] == off["replies"] for on, off in zip(runs["on"], runs["off"], strict=True))

    def median(name: str, key: str) -> float:
        return round(statistics.median(float(str(run[key])) for run in runs[name]), 2)

    report = {"model": str(args.model), "precision": args.precision, "users": args.users, "turns": args.turns,
              "system_tokens": args.system,
              "message_tokens": args.message, "reply_tokens": args.reply, "rounds": args.rounds,
              "median_first_token_ms": {name: median(name, "median_first_token_ms") for name in variants},
              "seconds": {name: median(name, "seconds") for name in variants},
              "tok_s": {name: median(name, "tok_s") for name in variants},
              "prompt_tokens": runs["on"][0]["prompt_tokens"],
              "cached_tokens": {name: runs[name][0]["cached_tokens"] for name in variants},
              "replies_identical": identical}
    report["first_token_speedup"] = round(report["median_first_token_ms"]["off"]  # type: ignore[index]
                                          / report["median_first_token_ms"]["on"], 2)  # type: ignore[index]
    report["tok_s_ratio"] = round(report["tok_s"]["on"] / report["tok_s"]["off"], 2)  # type: ignore[index]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
