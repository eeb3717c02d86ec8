"""Adaptive K priced with an acceptance per draft position against the shipped one-probability AdaptiveK, in a
simulated chain whose acceptance falls with the position (stop 39; docs/benchmark-runs.md, after run S19).

The chain is docs/runs/s16-simulation.py's (one stream drafts until 64 tokens came; a round trip of chain + slope x
width, + change where the width changed, times 1 + noise x N(0, 1), plus the draft's steps), with the acceptance of
position d its own: a0 - step x (d - 1). PerPosition keeps, per position, the decayed count of rounds that reached it
and of those that accepted it, and prices K by the product of those rates (the pooled estimate as their prior).
Prints each scenario's mean rate over SEEDS seeds as a share of the best fixed K's, for both:

    .venv/bin/python docs/runs/s39-perposition-simulation.py [SEEDS]
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

import deskfleet.common.speculative as sp

_spec = importlib.util.spec_from_file_location("s16_simulation", Path(__file__).with_name("s16-simulation.py"))
assert _spec is not None and _spec.loader is not None
s16 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s16)


class PerPosition(sp.AdaptiveK):
    """AdaptiveK whose expected tokens for K multiply an acceptance per position, each drawn to the pooled one."""

    def __init__(self, *args: int) -> None:
        self._reached = np.zeros(sp.MAX_K + 1)
        self._passed = np.zeros(sp.MAX_K + 1)
        super().__init__(*args)

    def record_round(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self._reached *= self._decay
            self._passed *= self._decay
            self._reached[1:min(accepted + 1, proposed) + 1] += 1
            self._passed[1:accepted + 1] += 1
        super().record_round(proposed, accepted)

    def _choose_k(self) -> None:
        alpha, cost, weight = self.alpha, self.cost, self._prior_weight

        def rate(k: int) -> float:
            accepts = (self._passed[1:k + 1] + alpha * weight) / (self._reached[1:k + 1] + weight)
            return (1.0 + float(np.cumprod(accepts).sum())) / cost.seconds(k)

        best = max(range(self.k_min, self.k_max + 1), key=lambda k: (rate(k), -k))
        if best != self._k and rate(best) > rate(self._k) * (1.0 + self._switch_margin):
            self._k = best


def falling(first: float, step: float) -> Callable[[int], float]:
    return lambda position: max(first - step * (position - 1), 0.05)


# label, acceptance by position, chain s, slope s a position, change s, draft s a token (s16-simulation's costs);
# "S18" falls as the acceptance each fixed K implied in S18 did (0.854 / 0.834 / 0.827 at K 3 / 5 / 8)
SCENARIOS = [("code, 0.85 flat", falling(.85, 0), .016, .0018, .0015, .001),
             ("code, S18", falling(.90, .012), .016, .0018, .0015, .001),
             ("code, steeper", falling(.92, .025), .016, .0018, .0015, .001),
             ("code, 0.65 flat", falling(.65, 0), .016, .0018, .0015, .001),
             ("code, 0.75 falling", falling(.75, .02), .016, .0018, .0015, .001),
             ("demo, 0.5 flat", falling(.5, 0), .0045, .00045, .0012, .0006),
             ("demo, falling", falling(.6, .03), .0045, .00045, .0012, .0006),
             ("100 ms, falling", falling(.85, .015), .1, .0018, .0015, .001)]


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    for noise in (0.10, 0.25):
        print(f"noise {noise:.0%}: adaptive K's rate / the best fixed K's (one acceptance, per position)")
        for scenario in SCENARIOS:
            def mean_rate(make: Callable[[], sp.AdaptiveK], scenario: tuple = scenario, noise: float = noise) -> float:
                runs = (s16.tokens_per_second(sp, make(), scenario, seed, noise) for seed in range(seeds))
                return statistics.mean(runs)

            best = max(mean_rate(lambda k=k: sp.AdaptiveK.fixed(k)) for k in range(1, 9))
            shares = [mean_rate(make) / best for make in (lambda: sp.AdaptiveK(1, 8), lambda: PerPosition(1, 8))]
            print(f"  {scenario[0]:20s} " + "  ".join(f"{share:.3f}" for share in shares), flush=True)


if __name__ == "__main__":
    main()
