"""What one call of a compiled stage costs by width (tokens per row), and what changing the width costs.

A verification call feeds K+1 tokens where a plain decode step feeds one. On the CPU plugin a call's
price depends on more than its width: when the input's T differs from the previous call's, the plugin
re-infers the shapes and re-prepares every node of the graph before it runs (the kernels themselves
come from its runtime cache), about 1.2 ms on the demo target on the 2-core machine, the price of half a
plain step. A speculative run that alternates between verifying (T = K+1) and plain steps (T = 1, when
the drafter proposes nothing) pays it twice per switch; a run that stays at one width does not.

`measure_call_costs` times, on a fresh session of the stage: calls at each width back to back ("steady"),
and the same widths alternating, so every call changes the width ("alternating"). The switch penalty
is the mean difference. Every block starts from a reset state and the same prefill; a steady block then
makes untimed calls of its width until its timed calls sit at the alternating block's mean context: an
alternating block grows the context by all the widths per cycle, a steady one by its own width per call,
and attention's cost grows with the context (timed at their own contexts, the penalty came out 36-56% too
high on the demo target). A longer prefill instead would also do, but made the calls after it ~7% slower
than the same context reached by calls. The stage must be a whole model (first and last stage in one), as
in `bench speculative`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from deskfleet.agent.stage import Stage, StageSession

CALLS = 8  # timed calls per width per block
PREFILL_TOKENS = 32


def measure_call_costs(stage: Stage, widths: Sequence[int], max_context: int, calls: int = CALLS, blocks: int = 6,
                       prefill_tokens: int = PREFILL_TOKENS, token_id: int = 3) -> dict[str, Any]:
    """Median milliseconds per call at each width, steady and alternating, and the switch penalty.

    widths: the T values to time (e.g. 1 and K+1), at least one; alternating needs two or more.
    calls: timed calls per width per block, after one untimed call per width in each block.
    max_context: the model's; a block that would outgrow it is refused before any call (past its RoPE table
    the calls would time positions the model has no rows for).
    """
    if not stage.layers.is_first or not stage.layers.is_last:
        raise ValueError("call costs are measured on a whole-model stage (first and last stage in one)")
    widths = sorted(set(widths))
    if not widths or widths[0] < 1:
        raise ValueError(f"widths must be 1 or more, got {list(widths)}")
    if calls < 1 or blocks < 1 or prefill_tokens < 1:
        raise ValueError("calls, blocks and prefill_tokens must be at least 1")
    needed = context_needed(widths, calls, prefill_tokens)
    if needed > max_context:
        raise ValueError(f"timing widths {widths} takes {needed} slots, more than the model's context {max_context}")
    session = stage.open_session()
    steady: dict[int, list[float]] = {width: [] for width in widths}
    alternating: dict[int, list[float]] = {width: [] for width in widths}
    contexts: dict[str, list[float]] = {"alternating": [], **{str(width): [] for width in widths}}
    for _ in range(blocks):
        for width in widths:
            feeder = _Feeder(session, prefill_tokens, token_id)
            for _ in range(steady_filler_calls(prefill_tokens, widths, width, calls)):
                feeder.call(width)
            contexts[str(width)] += feeder.time([width], calls, steady)
        if len(widths) > 1:
            contexts["alternating"] += _Feeder(session, prefill_tokens, token_id).time(widths, calls, alternating)
    report: dict[str, Any] = {
        "steady_ms": {str(width): _median_ms(steady[width]) for width in widths},
        "prefill_tokens": prefill_tokens,
        "calls_per_width": calls * blocks,
        # the mean number of slots the timed calls attended to, per block kind: steady ones match alternating
        "mean_context_slots": {kind: round(statistics.mean(values), 1) for kind, values in contexts.items() if values},
    }
    if len(widths) > 1:
        report["alternating_ms"] = {str(width): _median_ms(alternating[width]) for width in widths}
        report["switch_penalty_ms"] = round(statistics.mean(
            _median_ms(alternating[width]) - _median_ms(steady[width]) for width in widths), 3)
    return report


class _Feeder:
    """One block: reset the session, prefill, then timed calls; the context grows by each call's width."""

    def __init__(self, session: StageSession, prefill_tokens: int, token_id: int) -> None:
        self.session = session
        self.token_id = token_id
        self.slots = 0
        session.reset()
        self.call(prefill_tokens)

    def time(self, pattern: Sequence[int], calls: int, into: dict[int, list[float]]) -> list[int]:
        """Time `calls` rounds of `pattern`; the context (slots after each timed call) of every call."""
        for width in pattern:  # untimed: every width once, so the block's first timed call is like the rest
            self.call(width)
        contexts = []
        for _ in range(calls):
            for width in pattern:
                started = time.perf_counter()
                self.call(width)
                into[width].append(time.perf_counter() - started)
                contexts.append(self.slots)
        return contexts

    def call(self, width: int) -> None:
        self.slots += width
        self.session.forward(np.full((1, width), self.token_id, dtype=np.int64),
                             np.ones((1, self.slots), dtype=np.int64),
                             np.arange(self.slots - width, self.slots, dtype=np.int64)[None, :],
                             np.zeros(1, dtype=np.int32),
                             logits_positions=np.arange(width, dtype=np.int64)[None, :])


def context_needed(widths: Sequence[int], calls: int = CALLS, prefill_tokens: int = PREFILL_TOKENS) -> int:
    """The most slots a block of measure_call_costs fills: the prefill, one untimed call of every width (a
    steady block: its filler calls and its one untimed call), then the timed calls."""
    widths = sorted(set(widths))
    steady = max(prefill_tokens + width * (steady_filler_calls(prefill_tokens, widths, width, calls) + 1 + calls)
                 for width in widths)
    alternating = prefill_tokens + sum(widths) * (1 + calls) if len(widths) > 1 else 0
    return max(steady, alternating)


def steady_filler_calls(prefill_tokens: int, widths: Sequence[int], width: int, calls: int) -> int:
    """How many untimed calls of `width` put a steady block's timed calls at the alternating block's mean
    context.

    The alternating block (prefill P, one untimed call of every width, then `calls` cycles of `widths` in
    order) times its calls at a mean of P + W + W (calls - 1) / 2 + the mean of the widths' running sums,
    W their sum; a steady block of width w after f filler calls (and its one untimed call) at
    P + w f + w + w (calls + 1) / 2.
    """
    total = sum(widths)
    running = statistics.mean(sum(widths[: index + 1]) for index in range(len(widths)))
    alternating = total + total * (calls - 1) / 2 + running
    return max(0, round((alternating - width - width * (calls + 1) / 2) / width))


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)
