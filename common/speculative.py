"""Speculative decoding rules: what the last stage accepts, and how many tokens the draft should propose.

Each round the draft proposes K tokens; the target scores K+1 positions in one pass (the last accepted
token and the K drafts); the last stage keeps the longest acceptable prefix and adds one token of its own,
so a round always yields between 1 and K+1 tokens.
- Greedy: accept while the draft token equals the target argmax: output identical to plain greedy.
- Sampling: exact speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft
  token x with probability min(1, p(x)/q(x)); at the first rejection sample from norm(max(0, p - q));
  when all K are accepted sample a bonus token from p's last row. The output is distributed exactly as
  sampling from p, provided the draft sampled its tokens from q, with the SAME temperature / top-k /
  top-p transform (`sampling_probs`) applied to both models' logits.
- `AdaptiveK` picks K from the measured acceptance and the measured cost of a round.

Pure code: numpy only; randomness only from the numpy Generator the caller passes (seeded per request).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Verdict:
    """A verified round: the first `accepted` draft tokens stand, then `next_token` follows them."""

    accepted: int
    next_token: int

    def tokens(self, draft_tokens: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The tokens this round adds to the stream (1 to K+1 of them)."""
        return (*(int(t) for t in draft_tokens[: self.accepted]), self.next_token)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean off. Applied in that order."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Public functions


def greedy_accept(draft_tokens: npt.ArrayLike, target_argmax: npt.ArrayLike) -> Verdict:
    """Longest prefix of draft_tokens: [K] equal to target_argmax: [K+1], then the target's token."""
    draft = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    target = np.asarray(target_argmax, dtype=np.int64).reshape(-1)
    if target.size != draft.size + 1:
        raise ValueError(f"target argmax has {target.size} positions for {draft.size} draft tokens; "
                         "it must score the last accepted token and every draft token (K+1)")
    mismatch = np.flatnonzero(draft != target[:-1])
    accepted = int(mismatch[0]) if mismatch.size else int(draft.size)
    return Verdict(accepted=accepted, next_token=int(target[accepted]))


def sampling_probs(logits: npt.ArrayLike, params: SamplingParams) -> FloatArray:
    """probs: [..., V] float64 from logits: [..., V] after temperature, top-k and top-p.

    Greedy (temperature 0) gives a one-hot row at the argmax. Top-k keeps ties with the k-th value.
    """
    x = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        return _one_hot_argmax(x)
    with np.errstate(over="ignore"):  # max first: a temperature near 0 sends the others to -inf, not inf - inf
        x = (x - x.max(axis=-1, keepdims=True)) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[..., -params.top_k, None]
        x = np.where(x >= kth, x, -np.inf)
    probs = np.exp(x - x.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(ranked, axis=-1) - ranked  # mass strictly ahead of each token
        keep_ranked = before < params.top_p  # the smallest prefix reaching top_p (never empty)
        keep = np.zeros_like(keep_ranked)
        np.put_along_axis(keep, order, keep_ranked, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: FloatArray, rng: np.random.Generator) -> int:
    """One token from probs: [V] (need not be normalised; ValueError when it holds no finite, positive mass)."""
    cumulative = np.cumsum(probs)
    total = float(cumulative[-1]) if cumulative.size else 0.0
    if not 0.0 < total < math.inf:  # all zeros, a NaN or an inf: there is no distribution to draw from
        raise ValueError(f"cannot sample from probabilities of total {total} over {probs.size} tokens")
    return min(int(np.searchsorted(cumulative, rng.random() * total, side="right")), probs.size - 1)


def speculative_accept(draft_tokens: npt.ArrayLike, draft_probs: FloatArray, target_probs: FloatArray,
                       rng: np.random.Generator) -> Verdict:
    """Exact rejection sampling over draft_tokens: [K], draft_probs q: [K, V], target_probs p: [K+1, V].

    The caller must have sampled draft token i from q[i] and transformed both models' logits with the same
    SamplingParams. Only q[i, x_i] is read for accepted tokens; the full q row only at the rejection.
    """
    draft = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)
    k = draft.size
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} draft tokens need draft probs [K, V] and target probs [K+1, V], got "
                         f"{draft_probs.shape} and {target_probs.shape}")
    for i, token in enumerate(draft.tolist()):
        q_x, p_x = float(draft_probs[i, token]), float(target_probs[i, token])
        if q_x <= 0.0:
            raise ValueError(f"draft token {token} at position {i} has draft probability 0: "
                             "draft tokens must be sampled from the draft probs given")
        # One draw per examined token, also where p >= q accepts it anyway: what the generator yields next
        # must not hang on which side of q_x a p_x lies, or a rounding-level change of p or q (a prompt
        # prefilled in chunks, a verification call instead of one-token calls: ~1e-6 relative in f32) shifts
        # every later draw of the stream, and a seeded stream's text with it.
        if rng.random() * q_x < p_x:
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        if residual.sum() <= 0.0:  # only by rounding: p == q almost everywhere
            residual = target_probs[i]
        return Verdict(accepted=i, next_token=sample(residual, rng))
    return Verdict(accepted=k, next_token=sample(target_probs[k], rng))


def _one_hot_argmax(x: FloatArray) -> FloatArray:
    """[..., V]: 1 at each row's first maximum (an identity matrix indexed by the argmax took V x V floats:
    8 GB for a 32k vocabulary)."""
    one_hot = np.zeros(x.shape, dtype=np.float64)
    np.put_along_axis(one_hot, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
    return one_hot


# Adaptive K


@dataclass(frozen=True)
class RoundCost:
    """Seconds one micro-batch's round costs, the longer of two bounds:

    - its own latency: fixed + K * draft_per_token + (K+1) * verify_per_token + driver_seconds;
    - the driver's turn: one driver thread serves every drafting micro-batch a round, so a round comes
      around no sooner than `drafting_batches * (K * draft_per_token + driver_seconds)`.

    With one micro-batch the first bound holds. With N in flight over a ring of PCs the driver's drafting
    is N times a round's (measured, lent 16-core Xeon, demo pair: the controller drafted 61-71% of the wall
    on 3-4 PCs): a K chosen by the latency alone grew to 7-8 there, each unit of it costing N draft steps
    of everyone's round. `fixed_seconds` is the chain's part only (sent to the result's arrival), so the
    time a result waits for the busy driver does not read as a slower chain (which would argue for a
    larger K and feed itself)."""

    fixed_seconds: float  # the chain's round trip + one target pass, whatever K is
    draft_seconds_per_token: float  # one draft model step
    verify_seconds_per_token: float = 0.0  # what each extra verified position adds to the target pass
    drafting_batches: float = 1.0  # micro-batches the driver drafts for, each round
    driver_seconds: float = 0.0  # the driver's own time a round besides drafting (results, masks, sending)

    def seconds(self, k: int) -> float:
        drafting = k * self.draft_seconds_per_token
        latency = self.fixed_seconds + drafting + (k + 1) * self.verify_seconds_per_token + self.driver_seconds
        return max(latency, self.drafting_batches * (drafting + self.driver_seconds))


# The most draft tokens a round may propose. A verification of K+1 positions is one call, and AdaptiveK weighs every
# K up to its bound every round: an unbounded --k-max (1e9) hung the run while that list filled the memory. Past a
# few dozen, a round's expected tokens stop growing (0.9 acceptance: 9.99 at K=64, 10 at any K).
MAX_K = 64
# What AdaptiveK takes a draft token's chance of acceptance to be before any round has measured it, worth
# `prior_weight` rounds' rejections: a draft model's (the demo pair's accepts 0.74 at K=4, a weaker pairing less).
# Drafters that know better say so (Drafter.prior_acceptance: prompt lookup's proposals are accepted far more).
DEFAULT_PRIOR_ACCEPTANCE = 0.6
SWITCH_MARGIN = 0.05  # AdaptiveK moves K only for more than this gain in expected tokens per second


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round yields on average when each draft token is accepted with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, cost: RoundCost, k_min: int, k_max: int) -> int:
    """The K in [k_min, k_max] with the most expected tokens per second (the smaller K on a tie)."""
    rates = [expected_tokens(alpha, k) / cost.seconds(k) for k in range(k_min, k_max + 1)]
    return k_min + int(np.argmax(rates))


# What a verified position costs is fitted as round trip = chain + slope * width + penalty * (width changed), over
# each recent (width, changed) pair's mean round trip. A round at another width than the drafted round recorded
# before it pays the CPU plugin's re-preparation for its shape (1-5 ms on the demo target, more than the 9-token
# call's extra cost): fitted apart, so every round counts. Left out instead, a run whose K climbed a step a round and
# then held measured one width only and never fitted (run S16: no fit on 2 PCs in any round, K 5.7 on average where
# K fixed at 3 made 1.22x its tokens per second); taken as a plain round, one such round made the line 4x too steep
# and K fall to 1 (bench speculative). Only drafted rounds are seen here: a plain step, a prefill or another
# micro-batch's round between two of the same width can change the shape unseen, a noise the fit has to absorb.
# The line is fitted once two widths have this many (decayed) rounds each: one round in the last six or so.
MIN_WIDTH_ROUNDS = 0.5
# The fitted slope is drawn towards 0 as by this many rounds two positions apart (a ridge on the slope in the fit's
# normal equations: with every round of one kind, changed or not, the weighted spread of the widths, sum of
# weight * (width - mean width)^2, plus this, divides the covariance): a line through
# neighbouring widths is mostly the round trips' noise (run S15, the demo pair's draft model at K 1-2 on 2 / 3 PCs:
# 0.97 / 0.75 ms a position fitted through neighbouring widths where the fixed K's round trips grew 0.50 / 0.37 ms),
# one through widths several apart is mostly the slope. At 6 it held the code target's slope near 0 where K's
# widths were close (S16: 0-0.2 ms fitted where the fixed K's round trips grew 1.8-2.5 ms a position). In a simulated
# chain (docs/runs/s16-simulation.py: 64-token runs, round trips of 16 ms + 1.8 ms a position and 1.5 ms a change of
# width as on the code target, or 4.5 + 0.45 and 1.2 ms as on the demo pair, acceptance 0.4-0.75, 60 seeds) this fit
# with 2 made 0.94-0.98x of the best fixed K's rate (mean 0.96) where the version with 6 and the changed rounds left
# out made 0.91-0.98x (mean 0.94), at 10% noise; 0.93-0.97x (0.95) against 0.91-0.98x (0.94) at 25%.
SLOPE_PRIOR = 2.0
# The penalty for a changed width is drawn towards 0 as by half a round: it keeps the fit solvable when every
# round measured at some width changed it.
PENALTY_PRIOR = 0.5
# With no line fitted yet, a K held for this many drafted rounds is tried once at another width (half of it, or two
# more where it is small): one round there is enough for a line, and a K that climbed while every position looked
# free, then held, is otherwise never questioned (run S16). In the simulated chain it moved the worst case (the demo
# pair at acceptance 0.4) from 0.93 / 0.92x of the best K's rate to 0.94 / 0.93x (10% / 25% noise), and cost
# 0.006-0.009x where a position costs nothing.
PROBE_AFTER_ROUNDS = 8


class AdaptiveK:
    """Chooses K from what rounds measured. Pure: the caller measures time and reports it.

    The caller must, each round: propose `k` tokens, then `record_round(proposed, accepted)` and, when it
    measured one, `record_cost(RoundCost(...), verified=...)`. Acceptance and costs are exponentially weighted
    (`decay` per round) so K follows a change of prompt or network. k_min == k_max fixes K (`--k K`).

    What a verified position costs is learned too, when `record_cost` is told the round's width: a line through
    the mean round trip of each width measured recently, a changed width's re-preparation fitted apart (0 until two
    widths were: a K held that long is tried once at another width, PROBE_AFTER_ROUNDS; drawn towards 0 where the
    widths are close, SLOPE_PRIOR), so a longer round costs the verification it adds as well as its drafting. Taken
    as fixed, the round trip measured at a long K made every shorter K look as dear, and at a short K every longer
    one cheaper than it is: on the 279M code target the round trip grew 1.8-2.1 ms a verified token (S9: 24.9 /
    28.2 / 34.0 ms at K 3 / 5 / 8 on 2 PCs), and adaptive K settled at 7-8 where K fixed at 3 or 5 made 1.06-1.22x
    its tokens per second (S13).

    K only moves when the best K's expected tokens per second beat the current K's by more than
    `switch_margin`: a verification call of a new width costs extra on the CPU plugin (it re-prepares
    every node for the new input shape: 1.2-1.6 ms on the demo target, a third of a round; see
    controller/bench/call_costs.py), so following every wobble of the acceptance estimate between two
    near-equal K values cost more than it gained (`bench speculative`, draft model, adaptive: 272 width
    changes in 853 rounds, 12% of the target's time).
    """

    def __init__(self, k_min: int = 1, k_max: int = 8, *, initial_cost: RoundCost | None = None,
                 decay: float = 0.9, prior_alpha: float = DEFAULT_PRIOR_ACCEPTANCE, prior_weight: float = 2.0,
                 switch_margin: float = SWITCH_MARGIN) -> None:
        if not 0 <= k_min <= k_max <= MAX_K:
            raise ValueError(f"K bounds must satisfy 0 <= k_min <= k_max <= {MAX_K}, got [{k_min}, {k_max}]")
        if not 0.0 < decay <= 1.0 or not 0.0 <= prior_alpha <= 1.0 or prior_weight <= 0:
            raise ValueError("decay must be in (0, 1], prior_alpha in [0, 1], prior_weight > 0")
        if switch_margin < 0:
            raise ValueError(f"switch_margin must be 0 or more, got {switch_margin}")
        self.k_min, self.k_max = k_min, k_max
        self._decay = decay
        self._prior_alpha, self._prior_weight = prior_alpha, prior_weight
        self._accepted = 0.0  # decayed count of accepted draft tokens
        self._rejected = 0.0  # decayed count of rejections (at most one per round)
        self._cost = initial_cost or RoundCost(fixed_seconds=1.0, draft_seconds_per_token=0.1)
        self._cost_known = initial_cost is not None  # the first measurement replaces a guessed default
        # [w, changed]: decayed drafted rounds that verified w positions, after a round of the same width (0) or
        # another (1), and the sum of their round trips
        self._width_rounds = np.zeros((MAX_K + 2, 2))
        self._width_seconds = np.zeros((MAX_K + 2, 2))
        self._verified = 0.0  # decayed mean of the verified widths behind the cost's round trip
        self._verify_slope: float | None = None  # seconds a verified position adds, once two widths were measured
        self._last_width = 0  # the width of the last drafted round recorded
        self._blind_rounds = 0  # drafted rounds at this K with widths told and no line fitted (PROBE_AFTER_ROUNDS)
        self._width_told = 0  # drafted rounds of this run whose width was told, and those at another width than the
        self._width_changed = 0  # round before them (each re-prepared its shape at every stage): changed_width_share
        self._histogram: Counter[int] = Counter()
        self._proposed = 0  # draft tokens proposed over the rounds of the histogram
        self._switch_margin = switch_margin
        self._k = best_k(self.alpha, self.cost, k_min, k_max)

    # Public methods

    @classmethod
    def fixed(cls, k: int) -> AdaptiveK:
        return cls(k, k)

    def carried(self) -> AdaptiveK:
        """A controller for the next run of the same draft and chain (a chat's next turn): what this one learned
        (acceptance, costs, K) goes on, its per-run figures (histogram, mean proposed) start empty. A run's first
        rounds otherwise go to learning the acceptance from the prior again: over 64-token streams of the 279M
        code target (run S11) adaptive K accepted 2.4-2.9 tokens a round, K fixed at the K it ended at 3.8."""
        successor = copy.deepcopy(self)
        successor._histogram = Counter()
        successor._proposed = 0
        successor._last_width = 0  # the next run's first round prepares its shape again
        successor._blind_rounds = 0
        successor._width_told = successor._width_changed = 0
        return successor

    @property
    def alpha(self) -> float:
        """The estimated probability that a draft token is accepted."""
        weight = self._prior_weight
        return (self._accepted + self._prior_alpha * weight) / (self._accepted + self._rejected + weight)

    @property
    def cost(self) -> RoundCost:
        if self._verify_slope is None:
            return self._cost
        # The blended round trip less what its verified positions cost: the chain's part that K does not change
        fixed = max(self._cost.fixed_seconds - self._verify_slope * self._verified, 0.0)
        return replace(self._cost, fixed_seconds=fixed, verify_seconds_per_token=self._verify_slope)

    @property
    def k(self) -> int:
        """The K to propose next round."""
        return self._k

    def record_round(self, proposed: int, accepted: int) -> None:
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} proposed draft tokens")
        self._histogram[accepted] += 1
        self._proposed += proposed
        if proposed == 0:
            return
        self._accepted = self._accepted * self._decay + accepted
        self._rejected = self._rejected * self._decay + (1 if accepted < proposed else 0)
        self._choose_k()

    def record_cost(self, measured: RoundCost, verified: int | None = None) -> None:
        """Blend in one drafted round's cost; `verified`: the positions its verification scored (its longest
        proposal plus one), from which what a verified position costs is learned. A caller that never gives it
        keeps the round trip whole as the fixed part and the `verify_seconds_per_token` its measurements carry (0
        from the engine): give it always or never."""
        if verified is not None:
            if not 1 <= verified < len(self._width_rounds):
                raise ValueError(f"a round verifies 1 to {len(self._width_rounds) - 1} positions, got {verified}")
            self._learn_verify_slope(measured.fixed_seconds, verified)
        if not self._cost_known:
            self._cost, self._cost_known = measured, True
            self._verified = float(verified or 0)
            self._choose_k()
            self._probe_if_blind(verified)
            return

        def blend(old: float, new: float) -> float:
            return old * self._decay + new * (1.0 - self._decay)

        if verified is not None:
            self._verified = blend(self._verified, float(verified))
        self._cost = RoundCost(
            blend(self._cost.fixed_seconds, measured.fixed_seconds),
            blend(self._cost.draft_seconds_per_token, measured.draft_seconds_per_token),
            blend(self._cost.verify_seconds_per_token, measured.verify_seconds_per_token),
            blend(self._cost.drafting_batches, measured.drafting_batches),
            blend(self._cost.driver_seconds, measured.driver_seconds))
        self._choose_k()
        self._probe_if_blind(verified)

    def _learn_verify_slope(self, round_trip: float, verified: int) -> None:
        """Weighted least squares, round trip = chain + slope * width + penalty * changed, through each recently
        measured (width, changed) pair's mean round trip, the slope drawn towards 0 by SLOPE_PRIOR and the penalty by
        PENALTY_PRIOR; kept as it was while fewer than two widths have MIN_WIDTH_ROUNDS of rounds (K steady), never
        below 0, and never so steep that the chain's own part (the line at width 0) would be negative."""
        self._width_rounds *= self._decay  # on every round's clock, as the other estimates
        self._width_seconds *= self._decay
        changed, self._last_width = int(verified != self._last_width), verified
        self._width_told += 1
        self._width_changed += changed
        self._width_rounds[verified, changed] += 1.0
        self._width_seconds[verified, changed] += round_trip
        if np.count_nonzero(self._width_rounds.sum(axis=1) >= MIN_WIDTH_ROUNDS) < 2:
            return
        widths, changes = np.nonzero(self._width_rounds)
        weights = self._width_rounds[widths, changes]
        means = self._width_seconds[widths, changes] / weights
        design = np.stack([np.ones(len(widths)), widths, changes], axis=1)
        normal = design.T @ (design * weights[:, None]) + np.diag([0.0, SLOPE_PRIOR, PENALTY_PRIOR])
        slope = float(np.linalg.solve(normal, design.T @ (weights * means))[1])
        self._verify_slope = min(max(slope, 0.0), float(np.min(means / widths)))

    def _probe_if_blind(self, verified: int | None) -> None:
        """With widths told and no line fitted yet, try a K held for PROBE_AFTER_ROUNDS rounds once at another
        width: half of it, or two more where it is small. Last in a round, so that the next proposal runs it."""
        if verified is None or self._verify_slope is not None or self.k_min == self.k_max:
            return
        self._blind_rounds = self._blind_rounds + 1 if verified == self._k + 1 else 0
        if self._blind_rounds < PROBE_AFTER_ROUNDS:
            return
        self._blind_rounds = 0
        probe = (self._k + 1) // 2 if self._k > self.k_min + 1 else self._k + 2
        self._k = min(max(probe, self.k_min), self.k_max)

    def _choose_k(self) -> None:
        alpha, cost = self.alpha, self.cost  # each a computation: once a round, not once a K weighed

        def rate(k: int) -> float:
            return expected_tokens(alpha, k) / cost.seconds(k)

        best = best_k(alpha, cost, self.k_min, self.k_max)
        if best != self._k and rate(best) > rate(self._k) * (1.0 + self._switch_margin):
            self._k = best

    def changed_width_share(self) -> float:
        """The share of this run's drafted rounds (widths told) that verified another width than the round before
        them, the first one included: what the re-preparations of K's changes, and of rows proposing fewer, cost
        is in these rounds. 0.0 before any."""
        return self._width_changed / self._width_told if self._width_told else 0.0

    def accepted_histogram(self) -> dict[int, int]:
        """Rounds by number of accepted draft tokens, for the run's metrics."""
        return dict(sorted(self._histogram.items()))

    def mean_accepted(self) -> float:
        rounds = sum(self._histogram.values())
        return sum(a * n for a, n in self._histogram.items()) / rounds if rounds else 0.0

    def mean_proposed(self) -> float:
        """Draft tokens a row's round proposed on average: at most the K the rounds ran at (a stream's last rounds
        and prompt lookup propose fewer). Beside adaptive K's final K, which says only where it ended: a run's
        first rounds go to learning the acceptance, at a K of their own."""
        rounds = sum(self._histogram.values())
        return self._proposed / rounds if rounds else 0.0
