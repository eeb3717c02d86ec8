from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from deskfleet.common.speculative import (
    AdaptiveK,
    RoundCost,
    SamplingParams,
    Verdict,
    best_k,
    expected_tokens,
    greedy_accept,
    sample,
    sampling_probs,
    speculative_accept,
)

FloatArray = npt.NDArray[np.float64]
Rule = Callable[[npt.NDArray[np.int64], FloatArray, FloatArray, np.random.Generator], Verdict]

# Toy "models": Markov chains over a tiny vocabulary, row = previous token. Q is deliberately unlike P.
P = np.array([[0.50, 0.20, 0.20, 0.10],
              [0.10, 0.60, 0.20, 0.10],
              [0.25, 0.25, 0.25, 0.25],
              [0.05, 0.15, 0.30, 0.50]])
Q = np.array([[0.10, 0.40, 0.30, 0.20],
              [0.40, 0.30, 0.10, 0.20],
              [0.70, 0.10, 0.10, 0.10],
              [0.25, 0.25, 0.25, 0.25]])


# Greedy


@pytest.mark.parametrize(
    ("draft", "target", "verdict"),
    [
        ([5, 6, 7], [5, 6, 7, 8], Verdict(3, 8)),  # all accepted, plus the bonus token
        ([5, 6, 7], [9, 6, 7, 8], Verdict(0, 9)),  # first token wrong: the target's token replaces it
        ([5, 6, 7], [5, 1, 7, 8], Verdict(1, 1)),  # a later match after a mismatch does not count
        ([5, 6, 7], [5, 6, 2, 8], Verdict(2, 2)),
        ([], [4], Verdict(0, 4)),  # K = 0 is plain decoding
    ],
)
def test_greedy_accept(draft: list[int], target: list[int], verdict: Verdict) -> None:
    assert greedy_accept(draft, target) == verdict


def test_greedy_accept_needs_k_plus_one_target_positions() -> None:
    with pytest.raises(ValueError, match="K\\+1"):
        greedy_accept([1, 2], [1, 2])


def test_verdict_tokens() -> None:
    assert Verdict(2, 9).tokens([4, 5, 6]) == (4, 5, 9)
    assert Verdict(0, 9).tokens([4, 5, 6]) == (9,)


def test_greedy_speculative_stream_is_token_identical_to_plain_greedy() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(50, 50))  # next token = argmax(logits[previous])
    plain = [0]
    for _ in range(200):
        plain.append(int(np.argmax(logits[plain[-1]])))
    stream = [0]
    while len(stream) < len(plain):
        k = int(rng.integers(0, 6))
        draft = [int(np.argmax(logits[stream[-1]])) if rng.random() < 0.7 else int(rng.integers(50))]
        draft = draft[:k]
        for _ in range(1, k):
            draft.append(int(np.argmax(logits[draft[-1]])) if rng.random() < 0.7 else int(rng.integers(50)))
        context = [stream[-1], *draft]
        verdict = greedy_accept(draft, [int(np.argmax(logits[t])) for t in context])
        stream.extend(verdict.tokens(draft))
    assert stream[: len(plain)] == plain


def test_rejection_sampling_at_temperature_zero_is_greedy() -> None:
    rng = np.random.default_rng(3)
    greedy = SamplingParams(temperature=0)
    for _ in range(200):
        k = int(rng.integers(0, 5))
        draft_logits, target_logits = rng.normal(size=(k, 6)), rng.normal(size=(k + 1, 6))
        agree = rng.random(k) < 0.6  # make the draft agree with the target often
        draft_logits[agree] = target_logits[:k][agree]
        q = sampling_probs(draft_logits, greedy)
        draft = np.argmax(q, axis=-1)
        verdict = speculative_accept(draft, q, sampling_probs(target_logits, greedy), rng)
        assert verdict == greedy_accept(draft, np.argmax(target_logits, axis=-1))


# Sampling transforms


def test_sampling_probs_transforms() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.allclose(sampling_probs(logits, SamplingParams()), [0.5, 0.3, 0.15, 0.05])
    assert sampling_probs(logits, SamplingParams(temperature=0)).tolist() == [1.0, 0.0, 0.0, 0.0]
    hot = sampling_probs(logits, SamplingParams(temperature=2.0))
    assert np.allclose(hot, np.sqrt([0.5, 0.3, 0.15, 0.05]) / np.sqrt([0.5, 0.3, 0.15, 0.05]).sum())
    assert np.allclose(sampling_probs(logits, SamplingParams(top_k=2)), [0.625, 0.375, 0, 0])
    assert np.allclose(sampling_probs(logits, SamplingParams(top_p=0.75)), [0.625, 0.375, 0, 0])
    top_p = sampling_probs(logits, SamplingParams(top_p=0.85))
    assert np.allclose(top_p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert np.allclose(sampling_probs(logits, SamplingParams(top_p=0.1)), [1, 0, 0, 0])
    batch = sampling_probs(np.stack([logits, logits[::-1]]), SamplingParams(top_k=1))
    assert batch.tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300])
def test_a_temperature_near_zero_samples_the_argmax(temperature: float) -> None:
    # Dividing before taking the maximum out made inf - inf = NaN below ~1e-307: every token sampled was
    # the vocabulary's last. The limit is greedy (ties share the mass).
    logits = np.array([[0.2, 3.0, -1.0, 3.0], [5.0, 1.0, 0.0, -2.0]])
    probs = sampling_probs(logits, SamplingParams(temperature=temperature))
    assert probs.tolist() == [[0, 0.5, 0, 0.5], [1, 0, 0, 0]]


@pytest.mark.parametrize("params", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_params_are_refused(params: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**params)


def test_speculative_accept_draws_as_many_numbers_whichever_side_of_q_a_p_lies() -> None:
    """p and q of an accepted draft token 1e-9 apart, once above and once below (the rounding a chunked prefill
    moves them by): every seed gives the same verdict, so a seeded stream's later draws do not shift."""
    q = np.array([[0.20, 0.30, 0.50], [0.50, 0.25, 0.25]])
    p_next = np.array([[0.30, 0.30, 0.40], [0.10, 0.30, 0.60], [1 / 3, 1 / 3, 1 / 3]])
    verdicts = {}
    for sign in (1.0, -1.0):
        p = p_next.copy()
        p[0, 2] = q[0, 2] + sign * 1e-9  # the first draft token: accepted either way (p / q = 1 - 2e-9 at least)
        p[0, 0] -= sign * 1e-9
        assert (p[0, 2] >= q[0, 2]) == (sign > 0)
        verdicts[sign] = [speculative_accept(np.array([2, 1]), q, p, np.random.default_rng(seed))
                          for seed in range(64)]
    assert verdicts[1.0] == verdicts[-1.0]
    assert len(set(verdicts[1.0])) > 2  # the second token's draw and the bonus vary with the seed


def test_speculative_accept_checks_its_inputs() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="K\\+1"):
        speculative_accept([1], Q[:1], P[:1], rng)
    q = np.array([[0.0, 1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="draft probability 0"):
        speculative_accept([0], q, P[:2], rng)


# Statistical exactness: the output of speculative sampling is distributed as sampling from p


def exact_rule(draft: npt.NDArray[np.int64], q: FloatArray, p: FloatArray,
               rng: np.random.Generator) -> Verdict:
    return speculative_accept(draft, q, p, rng)


def resample_from_p(draft: npt.NDArray[np.int64], q: FloatArray, p: FloatArray,
                    rng: np.random.Generator) -> Verdict:
    """A classic bug: on rejection, sample from p instead of the residual max(0, p - q)."""
    for i, token in enumerate(draft.tolist()):
        if rng.random() * q[i, token] >= p[i, token]:
            return Verdict(i, sample(p[i], rng))
    return Verdict(len(draft), sample(p[-1], rng))


def accept_always(draft: npt.NDArray[np.int64], q: FloatArray, p: FloatArray,
                  rng: np.random.Generator) -> Verdict:
    """Another bug: trust the draft (its tokens then follow q, not p)."""
    return Verdict(len(draft), sample(p[-1], rng))


def generate(target: FloatArray, draft_model: FloatArray, start: int, count: int, k: int,
             rule: Rule, rng: np.random.Generator) -> list[int]:
    """`count` tokens after `start` by speculative rounds; the models are Markov chains (row = last token)."""
    stream = [start]
    while len(stream) <= count:
        draft: list[int] = []
        for _ in range(k):
            draft.append(sample(draft_model[draft[-1] if draft else stream[-1]], rng))
        tokens = np.array(draft, dtype=np.int64)
        q = draft_model[[stream[-1], *draft[:-1]]] if k else np.zeros((0, target.shape[1]))
        p = target[[stream[-1], *draft]]
        stream.extend(rule(tokens, q, p, rng).tokens(draft))
    return stream[1 : count + 1]


def chi_square(observed: FloatArray, expected_probs: FloatArray) -> tuple[float, float]:
    """Pearson's statistic and its critical value at p = 1e-4 (Wilson-Hilferty), over non-empty cells."""
    assert observed[expected_probs == 0].sum() == 0, "a token the target can never produce was emitted"
    cells = expected_probs > 0
    expected = expected_probs[cells] * observed.sum()
    assert expected.min() >= 5
    statistic = float(((observed[cells] - expected) ** 2 / expected).sum())
    df = int(cells.sum()) - 1
    z = 3.719  # upper 1e-4 normal quantile: a correct rule fails by chance once in 10,000 seeds
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def pair_counts(rule: Rule, k: int, trials: int, seed: int) -> FloatArray:
    rng = np.random.default_rng(seed)
    counts = np.zeros((4, 4))
    for _ in range(trials):
        first, second = generate(P, Q, 2, 2, k, rule, rng)
        counts[first, second] += 1
    return counts


PAIR_EXPECTED = P[2][:, None] * P  # P(first = a, second = b | start 2) = P[2, a] * P[a, b]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_sampling_matches_the_target_distribution(k: int) -> None:
    statistic, critical = chi_square(pair_counts(exact_rule, k, 20_000, seed=11), PAIR_EXPECTED)
    assert statistic < critical


@pytest.mark.parametrize("wrong_rule", [resample_from_p, accept_always])
def test_negative_control_a_wrong_rule_fails_the_same_test(wrong_rule: Rule) -> None:
    statistic, critical = chi_square(pair_counts(wrong_rule, 3, 20_000, seed=11), PAIR_EXPECTED)
    assert statistic > 3 * critical


def test_exactness_holds_with_temperature_top_k_and_top_p() -> None:
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    target = sampling_probs(rng.normal(size=(6, 6)) * 1.5, params)
    draft_model = sampling_probs(rng.normal(size=(6, 6)) * 1.5, params)
    counts = np.zeros(6)
    for _ in range(20_000):
        counts[generate(target, draft_model, 0, 2, 2, exact_rule, rng)[1]] += 1
    marginal = target[0] @ target  # the second token's distribution
    statistic, critical = chi_square(counts, marginal)
    assert statistic < critical


# Adaptive K


def test_expected_tokens() -> None:
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.8, 0) == 1


def test_best_k_grows_with_acceptance_and_with_the_round_trip() -> None:
    cheap = RoundCost(fixed_seconds=0.02, draft_seconds_per_token=0.01)
    dear = RoundCost(fixed_seconds=0.5, draft_seconds_per_token=0.01)
    assert best_k(0.1, cheap, 1, 8) == 1
    assert best_k(0.95, dear, 1, 8) == 8
    assert best_k(0.0, dear, 0, 8) == 0
    for alpha in np.linspace(0.05, 0.95, 10):
        ks = [best_k(alpha, RoundCost(fixed, 0.01), 1, 16) for fixed in (0.01, 0.05, 0.2, 1.0)]
        assert ks == sorted(ks)
    for fixed in (0.01, 0.1, 1.0):
        ks = [best_k(alpha, RoundCost(fixed, 0.01), 1, 16) for alpha in np.linspace(0.05, 0.95, 10)]
        assert ks == sorted(ks)


def test_a_round_costs_the_longer_of_its_latency_and_the_drivers_turn() -> None:
    alone = RoundCost(fixed_seconds=0.004, draft_seconds_per_token=0.001, driver_seconds=0.0005)
    assert alone.seconds(3) == pytest.approx(0.004 + 0.003 + 0.0005)
    shared = RoundCost(fixed_seconds=0.004, draft_seconds_per_token=0.001, drafting_batches=4, driver_seconds=0.0002)
    assert shared.seconds(1) == pytest.approx(0.004 + 0.001 + 0.0002)  # latency: 5.2 ms > 4 * 1.2 ms
    assert shared.seconds(3) == pytest.approx(4 * (0.003 + 0.0002))  # the driver's turn: 12.8 ms > 7.2 ms
    # the driver drafting for four micro-batches makes a long K dear: K falls where one micro-batch keeps it
    assert best_k(0.7, shared, 1, 8) < best_k(0.7, alone, 1, 8)
    slow_chain = RoundCost(fixed_seconds=0.2, draft_seconds_per_token=0.001, drafting_batches=4)
    assert best_k(0.7, slow_chain, 1, 8) == best_k(0.7, RoundCost(0.2, 0.001), 1, 8)  # the latency still rules


def test_adaptive_k_blends_the_drivers_share_too() -> None:
    controller = AdaptiveK(1, 8, initial_cost=RoundCost(0.01, 0.001))
    controller.record_cost(RoundCost(0.01, 0.001, drafting_batches=3.0, driver_seconds=0.002))
    assert controller.cost.drafting_batches == pytest.approx(0.9 * 1.0 + 0.1 * 3.0)
    assert controller.cost.driver_seconds == pytest.approx(0.1 * 0.002)


def test_adaptive_k_follows_measured_acceptance_and_cost() -> None:
    controller = AdaptiveK(2, 10, initial_cost=RoundCost(fixed_seconds=0.2, draft_seconds_per_token=0.01))
    start = controller.k
    for _ in range(30):
        controller.record_round(controller.k, controller.k)  # every draft token accepted
    assert controller.alpha > 0.9 and controller.k == 10 > start
    for _ in range(30):
        controller.record_round(controller.k, 0)  # the draft stopped guessing right
    assert controller.alpha < 0.4 and controller.k <= 3
    assert rate(controller, best_k(controller.alpha, controller.cost, 2, 10)) <= rate(controller, controller.k) * 1.05
    rng = np.random.default_rng(0)
    for _ in range(30):  # each draft token accepted with probability 0.7
        controller.record_round(controller.k, _accepted_of(rng, controller.k, 0.7))
    mid = controller.k
    for _ in range(40):
        controller.record_cost(RoundCost(fixed_seconds=0.01, draft_seconds_per_token=0.01))
    assert controller.k < mid  # a fast network makes short rounds pay


def rate(controller: AdaptiveK, k: int) -> float:
    return expected_tokens(controller.alpha, k) / controller.cost.seconds(k)


def _accepted_of(rng: np.random.Generator, k: int, alpha: float) -> int:
    """Draft tokens a round of k accepts when each is accepted with probability alpha (up to the first rejected)."""
    return int(np.argmin(np.append(rng.random(k) < alpha, False)))


def test_adaptive_k_keeps_its_k_through_small_wobbles() -> None:
    cost = RoundCost(fixed_seconds=0.004, draft_seconds_per_token=0.0005)
    sticky = AdaptiveK(1, 8, initial_cost=cost)
    eager = AdaptiveK(1, 8, initial_cost=cost, switch_margin=0.0)
    changes = {"sticky": 0, "eager": 0}
    rng = np.random.default_rng(0)
    for _ in range(300):  # each draft token accepted with probability 0.7, round after round
        for name, controller in (("sticky", sticky), ("eager", eager)):
            k = controller.k
            controller.record_round(k, _accepted_of(rng, k, 0.7))
            changes[name] += controller.k != k
    assert changes["eager"] > 5 * max(changes["sticky"], 1)  # 95 changes vs 7 with this seed
    # ... and still moves for a real change: the draft stops guessing right
    for _ in range(40):
        sticky.record_round(sticky.k, 0)
    assert sticky.k == 1


def test_adaptive_k_first_cost_measurement_replaces_the_default() -> None:
    controller = AdaptiveK(1, 8)
    controller.record_cost(RoundCost(0.3, 0.02, 0.001))
    assert controller.cost == RoundCost(0.3, 0.02, 0.001)
    controller.record_cost(RoundCost(0.1, 0.02, 0.001))
    assert controller.cost.fixed_seconds == pytest.approx(0.28)


def test_fixed_k_and_metrics() -> None:
    controller = AdaptiveK.fixed(4)
    for accepted in (4, 4, 0, 2):
        controller.record_round(4, accepted)
        assert controller.k == 4
    assert controller.accepted_histogram() == {0: 1, 2: 1, 4: 2}
    assert controller.mean_accepted() == 2.5
    assert controller.mean_proposed() == 4.0
    assert AdaptiveK().mean_accepted() == 0.0 and AdaptiveK().mean_proposed() == 0.0


def test_a_carried_controller_goes_on_from_what_it_learned_with_figures_of_its_own() -> None:
    learned = AdaptiveK(1, 8)
    learned.record_cost(RoundCost(0.03, 0.001))
    for _ in range(12):
        learned.record_round(learned.k, learned.k)  # every draft accepted: the acceptance rises, K climbs
    assert learned.k == 8 and learned.alpha > 0.9
    assert AdaptiveK(1, 8).k < 8  # a fresh one starts from the prior, lower
    carried = learned.carried()
    assert (carried.k, carried.alpha, carried.cost) == (learned.k, learned.alpha, learned.cost)
    assert carried.accepted_histogram() == {} and carried.mean_proposed() == 0.0 and carried.mean_accepted() == 0.0
    carried.record_round(8, 0)
    carried.record_cost(RoundCost(0.5, 0.001))
    assert carried.alpha < learned.alpha and carried.cost != learned.cost  # the two go their own ways
    assert sum(learned.accepted_histogram().values()) == 12 and learned.mean_proposed() > 1.0

def test_the_share_of_rounds_at_a_changed_width_counts_this_run_only() -> None:
    controller = AdaptiveK(1, 8)
    assert controller.changed_width_share() == 0.0
    for width in (4, 4, 5, 5, 5, 3, 4, 4):  # changes: the first round, 4 -> 5, 5 -> 3, 3 -> 4
        controller.record_cost(RoundCost(0.02, 0.001), verified=width)
    assert controller.changed_width_share() == pytest.approx(4 / 8)
    carried = controller.carried()
    assert carried.changed_width_share() == 0.0
    carried.record_cost(RoundCost(0.02, 0.001), verified=4)  # the next run's first round prepares its shape again
    carried.record_cost(RoundCost(0.02, 0.001), verified=4)
    assert carried.changed_width_share() == pytest.approx(1 / 2)
    controller.record_cost(RoundCost(0.02, 0.001))  # no width told: not counted
    assert controller.changed_width_share() == pytest.approx(4 / 8)


def test_mean_proposed_is_the_k_the_rounds_ran_at_not_the_last_one() -> None:
    # a stateless drafter may propose fewer than K: the engine records what was proposed
    controller = AdaptiveK(1, 8)
    for proposed, accepted in ((2, 1), (6, 6), (1, 0), (7, 3)):
        controller.record_round(proposed, accepted)
    assert controller.mean_proposed() == pytest.approx(16 / 4)
    assert controller.mean_accepted() == pytest.approx(10 / 4)


def test_adaptive_k_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="k_min"):
        AdaptiveK(5, 2)
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        AdaptiveK().record_round(2, 3)
    with pytest.raises(ValueError, match="switch_margin"):
        AdaptiveK(switch_margin=-0.1)


def test_adaptive_k_bounds_k_max() -> None:
    from deskfleet.common.speculative import MAX_K

    assert AdaptiveK(1, MAX_K).k_max == MAX_K
    with pytest.raises(ValueError, match=f"k_max <= {MAX_K}"):
        AdaptiveK(1, MAX_K + 1)  # it weighs every K up to k_max each round: 1e9 hung the run, filling the memory


def _round_trip(verified: int) -> float:
    """A chain whose round trip is 20 ms plus 4 ms a verified position."""
    return 0.02 + 0.004 * verified


def test_adaptive_k_learns_what_a_verified_position_costs_from_two_widths() -> None:
    controller = AdaptiveK(1, 8, initial_cost=RoundCost(0.02, 0.001))
    for _ in range(5):  # one width only: nothing to fit, the round trip is taken as fixed
        controller.record_cost(RoundCost(_round_trip(4), 0.001), verified=4)
    assert controller.cost.verify_seconds_per_token == 0.0
    for _ in range(5):
        controller.record_cost(RoundCost(_round_trip(9), 0.001), verified=9)
    slope = controller.cost.verify_seconds_per_token
    assert 0.8 * 0.004 < slope < 0.004  # drawn towards 0, as a few rounds' line is, never past the data
    # back to width 4, still in the fit: the first round there pays the plugin's re-preparation for the shape, which
    # is fitted apart (a twin given the same round without the penalty fits nearly the same line); taken as a plain
    # round of width 4 it would flatten the line
    twin = copy.deepcopy(controller)
    controller.record_cost(RoundCost(_round_trip(4) + 0.005, 0.001), verified=4)
    twin.record_cost(RoundCost(_round_trip(4), 0.001), verified=4)
    assert controller.cost.verify_seconds_per_token == pytest.approx(twin.cost.verify_seconds_per_token, rel=0.1)
    for _ in range(40):  # K steady for long: the other width's rounds fade, the slope stays what it last was
        controller.record_cost(RoundCost(_round_trip(9), 0.001), verified=9)
    assert controller.cost.verify_seconds_per_token > 0.5 * 0.004
    # never negative, never steeper than leaves the chain's part at 0
    falling = AdaptiveK(1, 8, initial_cost=RoundCost(0.02, 0.001))
    for verified, seconds in ((2, 0.05),) * 4 + ((6, 0.03),) * 4:
        falling.record_cost(RoundCost(seconds, 0.001), verified=verified)
    assert falling.cost.verify_seconds_per_token == 0.0
    steep = AdaptiveK(1, 8, initial_cost=RoundCost(0.02, 0.001))
    for verified, seconds in ((2, 0.002),) * 4 + ((6, 0.05),) * 4:
        steep.record_cost(RoundCost(seconds, 0.001), verified=verified)
    assert steep.cost.verify_seconds_per_token == pytest.approx(0.001)
    with pytest.raises(ValueError, match="verifies 1 to 65 positions, got 0"):
        controller.record_cost(RoundCost(0.02, 0.001), verified=0)


def test_a_line_through_neighbouring_widths_is_drawn_towards_zero_one_through_distant_widths_is_not() -> None:
    # the same chain measured at widths 4 / 5 and at widths 2 / 9, many rounds each
    near, far = AdaptiveK(1, 8), AdaptiveK(1, 8)
    for controller, widths in ((near, (4, 5)), (far, (2, 9))):
        for verified in widths:
            for _ in range(8):
                controller.record_cost(RoundCost(_round_trip(verified), 0.001), verified=verified)
    assert near.cost.verify_seconds_per_token < 0.5 * 0.004  # a width apart, the line is mostly the noise's
    assert far.cost.verify_seconds_per_token > 0.85 * 0.004


def test_adaptive_k_told_the_widths_stops_where_longer_verification_stops_paying() -> None:
    # A chain whose round trip grows 4 ms a verified position (a large target on every stage), measured with 10%
    # noise; the draft accepted 40% of the time, then 80%. Taken as fixed, the round trip of a long round makes
    # short ones look as dear, and K climbs past the best.
    def round_trip(k: int) -> float:
        return 0.01 + 0.004 * (k + 1)

    def true_rate(k: int) -> float:
        return expected_tokens(0.8, k) / (round_trip(k) + 0.0005 * k)

    best = max(true_rate(k) for k in range(1, 9))
    rates: dict[bool, list[float]] = {True: [], False: []}
    for seed in range(6):
        told, untold = AdaptiveK(1, 8), AdaptiveK(1, 8)
        rng = np.random.default_rng(seed)
        for index in range(240):
            alpha = 0.4 if index < 40 else 0.8
            for controller, verified in ((told, True), (untold, False)):
                k = controller.k
                controller.record_round(k, _accepted_of(rng, k, alpha))
                measured = round_trip(k) * (1.0 + 0.1 * rng.standard_normal())
                controller.record_cost(RoundCost(measured, 0.0005), verified=k + 1 if verified else None)
                if index >= 80:
                    rates[verified].append(true_rate(controller.k) / best)
    assert np.mean(rates[True]) > 0.93  # 0.85-1.00 by seed
    assert np.mean(rates[True]) > 1.1 * np.mean(rates[False])  # K 8 makes 0.81 of the best


def test_a_carried_controller_learns_apart_from_the_one_it_came_from() -> None:
    learned = AdaptiveK(1, 8)
    for _ in range(10):
        learned.record_round(4, 2)
        learned.record_cost(RoundCost(0.025, 0.001), verified=5)
    for _ in range(3):
        learned.record_cost(RoundCost(0.028, 0.001), verified=8)
    cost = learned.cost
    assert cost.verify_seconds_per_token > 0
    untouched = copy.deepcopy(learned)
    carried = learned.carried()
    assert carried.cost == cost
    for _ in range(10):
        carried.record_cost(RoundCost(0.09, 0.001), verified=3)
    assert learned.cost == cost and carried.cost != cost
    for controller in (learned, untouched):  # the widths' round trips were copied, not shared: the next fit agrees
        controller.record_cost(RoundCost(0.028, 0.001), verified=8)
    assert learned.cost == untouched.cost
    # a next run's first round prepares its shape again, whatever the width the last run ended at: a changed width's
    # round in the fit, whose extra cost goes to the penalty, where as a plain round it would steepen the line
    slope = learned.cost.verify_seconds_per_token
    next_run, not_reset = learned.carried(), copy.deepcopy(learned)
    for controller in (next_run, not_reset):
        controller.record_cost(RoundCost(0.028 + 0.004, 0.001), verified=8)
    assert slope > 0
    assert abs(next_run.cost.verify_seconds_per_token - slope) < abs(not_reset.cost.verify_seconds_per_token - slope)


def test_a_k_that_climbed_a_step_a_round_then_held_still_gets_its_line() -> None:
    # run S16: K rose a width a round, each round paying the plugin's re-preparation, then held at one width; with
    # the changed rounds left out no width but the last was measured, and the slope stayed unknown (0)
    controller = AdaptiveK(1, 8, initial_cost=RoundCost(0.02, 0.001))
    for verified in (4, 5, 6, 7, 8, 9):
        controller.record_cost(RoundCost(_round_trip(verified) + 0.003, 0.001), verified=verified)
    for _ in range(6):
        controller.record_cost(RoundCost(_round_trip(9), 0.001), verified=9)
    assert controller.cost.verify_seconds_per_token == pytest.approx(0.004, rel=0.25)


def test_a_k_held_with_no_line_fitted_is_tried_once_at_another_width() -> None:
    from deskfleet.common.speculative import PROBE_AFTER_ROUNDS

    def held(controller: AdaptiveK, rounds: int, told: bool = True) -> list[int]:
        ks = []
        for _ in range(rounds):
            k = controller.k
            ks.append(k)
            controller.record_round(k, k)  # every draft accepted: K climbs to k_max and stays
            controller.record_cost(RoundCost(_round_trip(k + 1), 0.0005), verified=k + 1 if told else None)
        return ks

    def at_k_max() -> AdaptiveK:  # a slow chain and a cheap draft: K 8 from the start, one width only
        return AdaptiveK(1, 8, initial_cost=RoundCost(0.05, 0.0001))

    steady = at_k_max()
    probed = held(steady, PROBE_AFTER_ROUNDS + 1)
    assert probed[:-1] == [8] * PROBE_AFTER_ROUNDS and probed[-1] == 4  # half of it, for one round
    assert steady.cost.verify_seconds_per_token > 0  # that round gave the line its second width
    # a K that moved has measured two widths already: nothing to try
    climbing = AdaptiveK(1, 8)
    ks = held(climbing, 4 + 3 * PROBE_AFTER_ROUNDS)
    assert ks[0] < 8 and ks[-1] == 8 and set(ks[ks.index(8):]) == {8}
    # no probe where nothing can be fitted (widths never told) or nothing chosen (K fixed)
    assert set(held(at_k_max(), 3 * PROBE_AFTER_ROUNDS, told=False)) == {8}
    assert set(held(AdaptiveK.fixed(8), 3 * PROBE_AFTER_ROUNDS)) == {8}
    # a small K is tried two higher
    low = AdaptiveK(1, 2)
    assert held(low, PROBE_AFTER_ROUNDS + 3)[-2:] == [2, 2]  # k_max bounds the probe: no move at all
    small = AdaptiveK(1, 8, initial_cost=RoundCost(0.001, 0.01))  # drafting dear: K stays at 1 ...
    ks = []
    for _ in range(PROBE_AFTER_ROUNDS + 1):
        ks.append(small.k)
        small.record_round(small.k, 0)
        small.record_cost(RoundCost(0.001, 0.01), verified=small.k + 1)
    assert ks == [1] * PROBE_AFTER_ROUNDS + [3]  # ... then tries 3
