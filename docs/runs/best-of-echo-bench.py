"""A whole completion of `best_of` candidates with `echo` and `logprobs` (stop 54): this checkout's server against one
run from an earlier checkout (where every candidate scored the prompt), side by side on loopback, the requests
alternating between them; prints JSON (seconds a reply, their medians, the ratio, whether the replies' tokens and
prompt figures are the same).

    git worktree add /tmp/before b33c28a
    .venv/bin/python docs/runs/best-of-echo-bench.py out/demo/target-int4 /tmp/before [--best-of 4] [-- --precision f32]

The earlier code is imported from a folder of links to the worktree's packages put first on PYTHONPATH (this
checkout's editable install comes after it). Both servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "common", "controller")


def start(model: Path, port: int, pythonpath: str | None, extra: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else dict(os.environ)
    return subprocess.Popen([str(ROOT / ".venv/bin/deskfleet"), "serve", "--model", str(model), "--listen",
                             f"127.0.0.1:{port}", "--no-api-key", "--threads", "1", *extra],
                            env=env, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL, stderr=log.open("w"))


def post(port: int, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.load(response)
    return time.perf_counter() - began, reply


def wait_ready(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    for _ in range(240):
        if process.poll() is not None:
            raise SystemExit(f"the server on port {port} exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server on port {port} did not answer in 2 minutes")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("before", type=Path, help="a checkout of the earlier code")
    parser.add_argument("--best-of", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ports", type=int, nargs=2, default=(18101, 18102))
    parser.add_argument("serve_options", nargs="*", help="after --: more `deskfleet serve` options for both")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="best-of-echo-"))
    links = work / "before" / "deskfleet"
    links.mkdir(parents=True)
    for package in PACKAGES:
        (links / package).symlink_to(args.before.resolve() / package)
    logs = {"before": work / "before.log", "after": work / "after.log"}
    args.model = args.model.resolve()  # the servers run in the temporary folder
    servers = {"before": (args.ports[0], start(args.model, args.ports[0], str(links.parent), args.serve_options,
                                               logs["before"])),
               "after": (args.ports[1], start(args.model, args.ports[1], None, args.serve_options, logs["after"]))}
    try:
        for name, (port, process) in servers.items():
            wait_ready(port, process, logs[name])
        with urllib.request.urlopen(f"http://127.0.0.1:{args.ports[1]}/v1/models") as response:
            model = json.load(response)["data"][0]["id"]
        prompt = (ROOT / "controller" / "openai_api.py").read_text()[:1500]  # code, a few hundred tokens
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 1.0, "seed": 1,
                "logprobs": 1, "echo": True, "best_of": args.best_of}
        times: dict[str, list[float]] = {name: [] for name in servers}
        replies: dict[str, dict[str, Any]] = {}
        for round_ in range(args.rounds + 1):  # round 0 warms both up
            order = list(servers.items()) if round_ % 2 == 0 else list(reversed(servers.items()))
            for name, (port, _) in order:
                seconds, replies[name] = post(port, body)
                if round_:
                    times[name].append(seconds)
        before, after = (replies[name]["choices"][0] for name in ("before", "after"))
        prompt_tokens = replies["after"]["usage"]["prompt_tokens"]
        head = slice(0, prompt_tokens)
        figures = [abs(a - b) for a, b in zip(before["logprobs"]["token_logprobs"][1:],
                                              after["logprobs"]["token_logprobs"][1:], strict=True)]
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(json.dumps({
            "best_of": args.best_of, "prompt_tokens": prompt_tokens, "max_tokens": args.max_tokens,
            "serve_options": args.serve_options,
            "seconds": {name: [round(value, 3) for value in values] for name, values in times.items()},
            "median_s": {name: round(value, 3) for name, value in medians.items()},
            "speedup": round(medians["before"] / medians["after"], 2),
            "same_text": before["text"] == after["text"],
            "same_prompt_figures": (before["logprobs"]["token_logprobs"][head]
                                    == after["logprobs"]["token_logprobs"][head]),
            "largest_figure_difference": max(figures, default=0.0)}))
    finally:
        for _, process in servers.values():
            process.terminate()
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
