"""`deskfleet bench admission`: what a long prompt arriving mid-run costs the streams already running.

A stage runs one call at a time, so a newcomer's prompt fed in one call stalls every running stream for the
whole prompt's prefill; fed in chunks (EngineOptions.prefill_chunk), the running streams take a step between
every two chunks. One stage, `running` streams decoding (short prompts), and one newcomer of `prompt_tokens`
tokens admitted once they have taken `arrival_step` steps. For each chunk size (0: the whole prompt in one
call), interleaved round by round:

    running_longest_gap_ms   the longest wait between two tokens of a running stream (its prefill aside)
    newcomer_first_token_ms  from the newcomer's first call to its first token
    running_decode_tok_s     the running streams' tokens a second, over the whole run
    wall_s                   the whole run

Medians over rounds, with the spread. Greedy: in f32 every chunk size gives the same tokens (the report names
any stream whose tokens differ).
"""

from __future__ import annotations

import itertools
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult

from ..engine import Engine, EngineOptions, StreamRequest
from ..pipeline import LocalPipeline
from .host import host_report
from .parity import summarize
from .rounds import round_order

DEFAULT_CHUNKS = (0, 64, 256)  # prefill chunk sizes compared (0: the whole prompt in one call)


@dataclass
class _Timeline:
    """When each stream's tokens came, and when the newcomer's first call went out."""

    newcomer: int
    token_times: dict[int, list[float]] = field(default_factory=dict)
    newcomer_sent: float | None = None

    def on_token(self, stream_id: int, token: int) -> None:
        self.token_times.setdefault(stream_id, []).append(time.perf_counter())


class _SubmitClock:
    """A chain that notes when the newcomer's first call is submitted."""

    def __init__(self, chain: LocalPipeline, timeline: _Timeline) -> None:
        self.chain = chain
        self.timeline = timeline

    def submit(self, message: Forward) -> None:
        if self.timeline.newcomer_sent is None and self.timeline.newcomer in message.stream_ids:
            self.timeline.newcomer_sent = time.perf_counter()
        self.chain.submit(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        return self.chain.collect(timeout)

    def release(self, batch_id: int) -> None:
        self.chain.release(batch_id)

    def renumber(self) -> None:
        self.chain.renumber()


def run_admission_bench(model: Path, prompt_tokens: int = 1024, chunks: list[int] | None = None, running: int = 2,
                        running_prompt_tokens: int = 32, new_tokens: int = 96, arrival_step: int = 8,
                        rounds: int = 3, settings: CompileSettings | None = None,
                        progress: bool = True) -> dict[str, Any]:
    # the default sizes that chunk the prompt at all (a size of the prompt or more feeds it whole, as 0 does)
    chunks = list(dict.fromkeys(chunks if chunks is not None
                                else [chunk for chunk in DEFAULT_CHUNKS if chunk < prompt_tokens]))
    if any(chunk < 0 for chunk in chunks):
        raise ValueError(f"chunk sizes must be 0 (the whole prompt) or more, got {chunks}")
    if min(prompt_tokens, running, running_prompt_tokens, new_tokens, arrival_step, rounds) < 1:
        raise ValueError("prompt_tokens, running, running_prompt_tokens, new_tokens, arrival_step and rounds must be "
                         "at least 1")
    unchunked = [chunk for chunk in chunks if chunk >= prompt_tokens]
    if unchunked:
        raise ValueError(f"--chunks {' '.join(map(str, unchunked))} would feed the newcomer's prompt of "
                         f"{prompt_tokens} tokens in one call, as chunk size 0 measures: give --chunks under "
                         "--prompt-tokens")
    model = Path(model)
    manifest = load_manifest(model)
    spec = manifest.spec
    if prompt_tokens + 1 > spec.max_context:
        raise ValueError(f"the newcomer's prompt of {prompt_tokens} tokens and its one new token do not fit the "
                         f"model's context of {spec.max_context}: give --prompt-tokens {spec.max_context - 1} or "
                         "fewer")
    if running_prompt_tokens + new_tokens > spec.max_context:
        raise ValueError(f"the running streams' {running_prompt_tokens} prompt tokens and {new_tokens} new ones do "
                         f"not fit the model's context of {spec.max_context}: give fewer --new-tokens")
    # Each of the newcomer's calls goes out between two steps of the running streams, from their arrival_step-th
    # token on (at 0 it would arrive with them, while nothing runs, and be prefilled whole with them): they must
    # still decode when its last call runs, and take a step after it. Done sooner, the rest of its prompt goes
    # whole (nothing runs) under a chunk size's name; done before it arrives, nothing was measured at all (one
    # new token: no gap, and the report failed after the whole bench had run).
    smallest = min((chunk for chunk in chunks if chunk), default=0)
    calls = -(-prompt_tokens // smallest) if smallest else 1
    if new_tokens < arrival_step + calls:
        raise ValueError(f"--new-tokens {new_tokens} ends the running streams before the newcomer's prompt is fed (it "
                         f"arrives after {arrival_step} of their steps and takes {calls} calls in chunks of "
                         f"{smallest or prompt_tokens}): give at least {arrival_step + calls}")
    rng = random.Random(11)
    prompts = [[rng.randrange(1, spec.vocab_size) for _ in range(running_prompt_tokens)] for _ in range(running)]
    long_prompt = [rng.randrange(1, spec.vocab_size) for _ in range(prompt_tokens)]
    requests = [StreamRequest(prompt, max_new_tokens=new_tokens, ignore_eos=True) for prompt in prompts]
    requests.append(StreamRequest(long_prompt, max_new_tokens=1, ignore_eos=True, arrival_step=arrival_step))
    newcomer = len(requests) - 1
    samples: dict[int, dict[str, list[float]]] = {chunk: {} for chunk in chunks}
    tokens: dict[int, list[list[int]]] = {}
    started = time.perf_counter()
    with LocalPipeline(model, 1, settings or CompileSettings(), manifest) as pipeline:
        for index in range(rounds + 1):  # round 0 warms up, untimed
            for chunk in round_order(chunks, index):
                timeline = _Timeline(newcomer)
                engine = Engine(_SubmitClock(pipeline, timeline), spec, None,
                                EngineOptions(max_rows=running + 1, micro_batches=1, prefill_chunk=chunk))
                for request in requests:
                    engine.add(request)
                began = time.perf_counter()
                results = engine.run(on_token=timeline.on_token)
                wall = time.perf_counter() - began
                tokens.setdefault(chunk, [results[stream].tokens for stream in sorted(results)])
                if index == 0:
                    continue
                for name, value in _measures(timeline, running, wall).items():
                    samples[chunk].setdefault(name, []).append(value)
            if index and progress:
                print(f"round {index}/{rounds}: longest gap of a running stream "
                      + ", ".join(f"chunk {chunk}: {samples[chunk]['running_longest_gap_ms'][-1]:.1f} ms"
                                  for chunk in chunks), file=sys.stderr, flush=True)
    reference = tokens[chunks[0]]
    report: dict[str, Any] = {
        "model": str(model), "layers": spec.num_layers, "hidden": spec.hidden_size,
        "host": host_report(), "rounds": rounds, "running_streams": running,
        "running_prompt_tokens": running_prompt_tokens, "new_tokens": new_tokens,
        "newcomer_prompt_tokens": prompt_tokens, "arrival_step": arrival_step,
        # by chunk size: the streams whose tokens differ from the first size's (in fast precision a chunk's
        # attention rounds differently from the whole prompt's; in f32 none may)
        "streams_differing": {str(chunk): [stream for stream, ids in enumerate(tokens[chunk])
                                           if ids != reference[stream]] for chunk in chunks[1:]},
        "chunks": {str(chunk): {name: summarize(values) for name, values in measures.items()}
                   for chunk, measures in samples.items()},
        "bench_s": round(time.perf_counter() - started, 1),
    }
    if 0 in chunks:
        whole = statistics.median(samples[0]["running_longest_gap_ms"])
        report["longest_gap_vs_whole_prompt"] = {
            str(chunk): round(statistics.median(samples[chunk]["running_longest_gap_ms"]) / whole, 3)
            for chunk in chunks if chunk}
    return report


def _measures(timeline: _Timeline, running: int, wall: float) -> dict[str, float]:
    gaps = [later - earlier for stream in range(running)
            for earlier, later in itertools.pairwise(timeline.token_times[stream])]
    first = timeline.token_times[timeline.newcomer][0]
    assert timeline.newcomer_sent is not None
    decoded = sum(len(timeline.token_times[stream]) - 1 for stream in range(running))
    span = max(timeline.token_times[stream][-1] for stream in range(running)) - \
        min(timeline.token_times[stream][0] for stream in range(running))
    return {"running_longest_gap_ms": max(gaps) * 1e3,
            "newcomer_first_token_ms": (first - timeline.newcomer_sent) * 1e3,
            "running_decode_tok_s": decoded / span if span > 0 else 0.0,
            "wall_s": wall}
