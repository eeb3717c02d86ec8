"""Adaptive K against every fixed K in a simulated chain whose round trip grows with the verified width.

Run S16's companion (docs/benchmark-runs.md): each run drafts until 64 tokens came, one stream; a round of K draft
tokens accepts each with probability `alpha` (stopping at the first rejection), costs K draft steps plus a round trip
of `chain + slope * (K + 1)`, plus `change` when its width differs from the last round's (the CPU plugin's
re-preparation for a new shape), times 1 + `noise` * N(0, 1). Prints, per scenario, adaptive K's mean rate over 60
seeds as a share of the best fixed K's, for this checkout's AdaptiveK and, given a second module, an older one:

    .venv/bin/python docs/runs/s16-simulation.py
    git show 5dbec60:common/speculative.py > /tmp/old_spec.py
    .venv/bin/python docs/runs/s16-simulation.py /tmp/old_spec.py
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from types import ModuleType

import deskfleet.common.speculative as current

# label, alpha, chain s, slope s a position, change s, draft s a token: the code target's costs on 2 PCs (S9-S16) and
# the demo pair's (S15-S16), and two chains where a position costs nothing
SCENARIOS = [("code, alpha 0.55", .55, .016, .0018, .0015, .001), ("code, alpha 0.65", .65, .016, .0018, .0015, .001),
             ("code, alpha 0.75", .75, .016, .0018, .0015, .001), ("code, dearer", .65, .02, .0025, .003, .0012),
             ("demo, alpha 0.4", .4, .0045, .00045, .0012, .0006), ("demo, alpha 0.5", .5, .0045, .00045, .0012, .0006),
             ("demo, alpha 0.6", .6, .0045, .00045, .0012, .0006), ("demo, flat", .5, .0045, .0, .0012, .0006),
             ("100 ms link", .6, .1, .0018, .0015, .001), ("code, flat", .7, .016, 0.0, .0015, .001)]
SEEDS = 60


def tokens_per_second(module: ModuleType, policy: object, scenario: tuple, seed: int, noise: float) -> float:
    """`scenario`'s alpha: the acceptance of every position, or a function of the position (1, 2, ...) giving each
    its own (docs/runs/s39-perposition-simulation.py)."""
    _, alpha, chain, slope, change, draft = scenario
    accepts = alpha if callable(alpha) else (lambda position: alpha)
    rng = random.Random(seed)
    seconds, tokens, last_width = 0.0, 0, 0
    while tokens < 64:
        k = policy.k
        accepted = 0
        while accepted < k and rng.random() < accepts(accepted + 1):
            accepted += 1
        width = k + 1
        round_trip = (chain + slope * width + (change if width != last_width else 0.0)) * (1 + rng.gauss(0, noise))
        last_width = width
        seconds += round_trip + draft * k
        tokens += accepted + 1
        policy.record_round(k, accepted)
        policy.record_cost(module.RoundCost(round_trip, draft), verified=width)
    return tokens / seconds


def share_of_best(module: ModuleType, scenario: tuple, noise: float) -> float:
    def mean_rate(make) -> float:
        return statistics.mean(tokens_per_second(module, make(), scenario, seed, noise) for seed in range(SEEDS))

    best = max(mean_rate(lambda k=k: module.AdaptiveK.fixed(k)) for k in range(1, 9))
    return mean_rate(lambda: module.AdaptiveK(1, 8)) / best


def main() -> None:
    modules = {"this checkout": current}
    if len(sys.argv) > 1:
        spec = importlib.util.spec_from_file_location("older_speculative", sys.argv[1])
        assert spec is not None and spec.loader is not None
        older = sys.modules["older_speculative"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(older)
        modules[sys.argv[1]] = older
    for noise in (0.10, 0.25):
        print(f"noise {noise:.0%}: adaptive K's rate / the best fixed K's")
        shares: dict[str, list[float]] = {name: [] for name in modules}
        for scenario in SCENARIOS:
            row = []
            for name, module in modules.items():
                shares[name].append(share_of_best(module, scenario, noise))
                row.append(f"{shares[name][-1]:.3f}")
            print(f"  {scenario[0]:18s} " + "  ".join(row))
        for name, values in shares.items():
            print(f"  {name}: mean {statistics.mean(values):.3f}, {min(values):.3f}-{max(values):.3f}")


if __name__ == "__main__":
    main()
