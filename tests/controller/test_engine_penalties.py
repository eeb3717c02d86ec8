"""The API's presence_penalty, frequency_penalty and logit_bias, applied by the last stage: greedy tokens equal a
reference loop over transformers' logits that subtracts the penalties of the tokens generated so far and adds the
bias (f32, 1 and 2 stages, beside a stream that asks for none), drafted runs (prompt lookup, a draft model) give the
plain run's tokens, the log-probabilities stay the raw distribution's, and values out of range are refused by name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.stage_executor import adjusted
from deskfleet.common.kv_ledger import AppendSlots
from deskfleet.common.logits_adjust import RowAdjust
from deskfleet.common.speculative import SamplingParams
from deskfleet.common.wire import DraftInfo, LogitsAdjust
from deskfleet.controller.draft import DraftModel
from deskfleet.controller.engine import EngineOptions, StreamRequest
from deskfleet.controller.generation import GenerationError
from deskfleet.controller.prompt_lookup import PromptLookupDraft

from .test_engine import F32, PROMPTS, _chi_square, _critical, _exact_joint, run_streams
from .test_engine_kept_kv import OracleDraft
from .test_engine_logprobs import _reference, _run

PRESENCE, FREQUENCY = 0.7, 1.3


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("engine-target", num_hidden_layers=4)  # the `target` fixture's checkpoint


def _penalized_reference(checkpoint: Path, prompt: list[int], count: int, presence: float, frequency: float,
                         bias: dict[int, float]) -> list[int]:
    """Greedy tokens with the penalties and bias applied to transformers' logits, one token at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(count):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double().numpy()
            for token, times in Counter(tokens).items():
                logits[token] -= frequency * times + presence
            for token, value in bias.items():
                logits[token] += value
            tokens.append(int(np.argmax(logits)))
    return tokens


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_penalties_and_bias_equal_a_reference_over_transformers(stages: int, target: Path,
                                                                       checkpoint: Path) -> None:
    plain = _run(target, [StreamRequest(PROMPTS[0], max_new_tokens=16, ignore_eos=True)])[0].tokens
    favoured, banned = plain[3], plain[0]
    bias = {favoured: 2.5, banned: -100.0}
    request = StreamRequest(PROMPTS[0], max_new_tokens=16, ignore_eos=True, presence_penalty=PRESENCE,
                            frequency_penalty=FREQUENCY, logit_bias=tuple(bias.items()), logprobs=0)
    results = _run(target, [request, StreamRequest(PROMPTS[1], max_new_tokens=16, ignore_eos=True)], stages)
    expected = _penalized_reference(checkpoint, PROMPTS[0], 16, PRESENCE, FREQUENCY, bias)
    assert results[0].tokens == expected
    assert expected != plain and banned not in expected  # the adjustment changed the text
    assert results[1].tokens == _run(target, [StreamRequest(PROMPTS[1], max_new_tokens=16, ignore_eos=True)])[0].tokens
    # the log-probabilities are the model's own, before the penalties
    raw = _reference(checkpoint, PROMPTS[0], results[0].tokens)
    assert results[0].logprobs is not None
    assert [entry.logprob for entry in results[0].logprobs] == pytest.approx(
        [raw[at, token] for at, token in enumerate(results[0].tokens)], abs=1e-4)


@pytest.mark.parametrize("drafting", ["oracle", "lookup", "model"])
def test_drafted_runs_with_penalties_give_the_plain_runs_tokens(drafting: str, target: Path,
                                                               other_draft: Path) -> None:
    """The oracle proposes the plain run's own tokens: every draft is accepted only where each verified position
    counts the draft tokens before it (penalties discourage the repeats prompt lookup proposes: it is mostly
    rejected, as the unrelated draft model is)."""
    request = StreamRequest(PROMPTS[2], max_new_tokens=24, ignore_eos=True, presence_penalty=0.4,
                            frequency_penalty=0.9)
    plain = _run(target, [request])[0].tokens
    drafter = {"oracle": lambda: OracleDraft(PROMPTS[2], plain), "lookup": lambda: PromptLookupDraft(min_ngram=1),
               "model": lambda: DraftModel(other_draft, F32)}[drafting]()
    accepted: list[float] = []
    assert _run(target, [request], 2, drafter, accepted)[0].tokens == plain
    if drafting == "oracle":
        assert accepted[0] > 2  # whole rounds accepted


def test_a_drafted_rows_positions_count_the_draft_tokens_before_them() -> None:
    vocab = 6
    logits = np.zeros((2, 3, vocab), dtype=np.float32)
    logits[:, :, 2] = 1.0
    argmax = logits.argmax(axis=-1)
    draft = DraftInfo((2, 0), np.array([[2, 2], [0, 0]], dtype=np.int64))
    adjust = LogitsAdjust.of([RowAdjust(0.5, 1.0, np.array([4]), np.array([2]), np.array([5]),
                                        np.array([0.25], dtype=np.float32)), None])
    assert adjust is not None
    out, picked = adjusted(AppendSlots(3, (3, 1), (7, 9)), logits, argmax, draft, adjust)
    # row 0: token 4 generated twice (-2.5), token 2 counted once at column 1 and twice at column 2, +0.25 for 5
    np.testing.assert_allclose(out[0, :, 4], [-2.5, -2.5, -2.5])
    np.testing.assert_allclose(out[0, :, 2], [1.0, -0.5, -1.5])
    np.testing.assert_allclose(out[0, :, 5], [0.25, 0.25, 0.25])
    assert picked[0].tolist() == [2, 5, 5]
    np.testing.assert_array_equal(out[1], logits[1])  # the row without an adjustment, and the raw logits, untouched
    assert logits[0, 0, 4] == 0.0 and picked[1].tolist() == argmax[1].tolist()


@pytest.mark.parametrize(("changes", "message"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be from -2.0 to 2.0"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be from"),
    ({"logit_bias": ((10**6, 1.0),)}, "logit_bias token 1000000 is outside the vocabulary"),
    ({"logit_bias": ((3, 101.0),)}, "logit_bias of token 3 must be from -100.0 to 100.0"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias names a token twice")])
def test_penalties_and_biases_out_of_range_are_refused_by_name(changes: dict[str, object], message: str,
                                                              target: Path) -> None:
    with pytest.raises(GenerationError, match=message):
        _run(target, [StreamRequest(PROMPTS[0], max_new_tokens=2, **changes)])  # type: ignore[arg-type]


def _adjusted(bias: dict[int, float]) -> Callable[[tuple[int, ...], np.ndarray], np.ndarray]:
    """The penalties of the tokens sampled so far and the bias, on float32 logits (summed in float64)."""
    def adjust(prefix: tuple[int, ...], logits: np.ndarray) -> np.ndarray:
        out = logits.astype(np.float64)
        for token, times in Counter(prefix).items():
            out[token] -= FREQUENCY * times + PRESENCE
        for token, value in bias.items():
            out[token] += value
        return out.astype(np.float32)

    return adjust


@pytest.mark.slow
def test_sampling_with_penalties_draws_from_the_adjusted_distribution_drafted_or_not(
        target: Path, near_draft: Path, checkpoint: Path) -> None:
    """Top-3 at temperature 3 over 3 tokens, penalties that make a repeat unlikely and a bias: the plain sampler and
    speculative sampling (a draft near the target, whose q knows nothing of the penalties: the rejection rule's
    target is the adjusted distribution) must both match the exact distribution."""
    params = SamplingParams(temperature=3.0, top_k=3)
    prompt = PROMPTS[1]
    plain = _run(target, [StreamRequest(prompt, max_new_tokens=1, ignore_eos=True)])[0].tokens
    bias = {plain[0] + 1: 1.5}
    joint = _exact_joint(checkpoint, prompt, params, 3, _adjusted(bias))
    total = 600
    requests = [StreamRequest(prompt, max_new_tokens=3, ignore_eos=True, sampling=params, seed=seed,
                              presence_penalty=PRESENCE, frequency_penalty=FREQUENCY, logit_bias=tuple(bias.items()))
                for seed in range(total)]
    for draft in (None, near_draft):
        tokens = run_streams(target, requests, 1, draft, EngineOptions(max_rows=16, fixed_k=2))
        statistic, degrees = _chi_square(Counter(tuple(row) for row in tokens), joint, total)
        assert statistic < _critical(degrees), f"draft={draft}: chi-square {statistic:.1f} with {degrees} dof"
