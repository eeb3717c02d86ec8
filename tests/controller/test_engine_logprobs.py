"""Log-probabilities of generated tokens (StreamRequest.logprobs): the last stage's figures equal transformers' own
log-softmax at every generated position (f32), on 1 and 2 stages, with and without a draft model, greedy and sampled,
and only the streams that ask get them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from deskfleet.common.logprobs import TokenLogprob
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import SamplingParams
from deskfleet.controller.draft import DraftModel
from deskfleet.controller.engine import Engine, StreamRequest, StreamResult
from deskfleet.controller.generation import GenerationError
from deskfleet.controller.pipeline import LocalPipeline

from .test_engine import F32, PROMPTS


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("engine-target", num_hidden_layers=4)  # the `target` fixture's checkpoint


def _reference(checkpoint: Path, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """transformers' log-softmax [len(tokens), V] at the positions that chose each token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1: len(prompt) - 1 + len(tokens)].numpy()


def _run(target: Path, requests: list[StreamRequest], stages: int = 1, drafter: object = None,
         accepted: list[float] | None = None) -> list[StreamResult]:
    """The requests' results; `accepted` gets the run's mean accepted draft tokens a round."""
    manifest = load_manifest(target)
    with LocalPipeline(target, stages, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, drafter)  # type: ignore[arg-type]
        for request in requests:
            engine.add(request)
        results = engine.run()
    if accepted is not None:
        accepted.append(engine.mean_accepted())
    return [results[index] for index in range(len(requests))]


def _check(checkpoint: Path, prompt: list[int], result: StreamResult, top: int) -> None:
    assert result.logprobs is not None and len(result.logprobs) == len(result.tokens)
    reference = _reference(checkpoint, prompt, result.tokens)
    for at, (token, entry) in enumerate(zip(result.tokens, result.logprobs, strict=True)):
        assert entry.token == token
        assert entry.logprob == pytest.approx(reference[at, token], abs=1e-4), f"token {at}"
        expected = np.argsort(-reference[at], kind="stable")[:top]
        assert [alternative for alternative, _ in entry.top] == expected.tolist(), f"token {at}"
        assert [value for _, value in entry.top] == pytest.approx(reference[at, expected].tolist(), abs=1e-4)


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_logprobs_equal_transformers(stages: int, target: Path, checkpoint: Path) -> None:
    results = _run(target, [StreamRequest(PROMPTS[0], max_new_tokens=12, ignore_eos=True, logprobs=5),
                            StreamRequest(PROMPTS[2], max_new_tokens=9, ignore_eos=True),
                            StreamRequest(PROMPTS[4], max_new_tokens=7, ignore_eos=True, logprobs=0)], stages)
    _check(checkpoint, PROMPTS[0], results[0], 5)
    assert results[1].logprobs is None  # it did not ask
    _check(checkpoint, PROMPTS[4], results[2], 0)
    assert all(entry.top == () for entry in results[2].logprobs or ())
    # greedy: each token is its position's most likely one
    assert all(entry.logprob == entry.top[0][1] for entry in results[0].logprobs or ())


@pytest.mark.parametrize("drafter", ["self", "other"])
def test_drafted_tokens_carry_the_targets_logprobs(drafter: str, target: Path, other_draft: Path,
                                                   checkpoint: Path) -> None:
    """Accepted draft tokens get the log-probabilities of the target's verification, each at the position it was
    verified at: the target drafting for itself has every draft token accepted, an unrelated draft few."""
    chosen = DraftModel(target if drafter == "self" else other_draft, F32)
    requests = [StreamRequest(PROMPTS[3], max_new_tokens=16, ignore_eos=True, logprobs=3),
                StreamRequest(PROMPTS[0], max_new_tokens=16, ignore_eos=True, logprobs=3)]
    accepted: list[float] = []
    drafted = _run(target, requests, 2, chosen, accepted)
    if drafter == "self":
        assert accepted[0] > 1, "the target drafting for itself had its drafts rejected"
    plain = _run(target, requests, 1)
    for prompt, result, alone in zip((PROMPTS[3], PROMPTS[0]), drafted, plain, strict=True):
        assert result.tokens == alone.tokens
        _check(checkpoint, prompt, result, 3)


def test_sampled_tokens_carry_the_models_own_logprobs(target: Path, checkpoint: Path) -> None:
    """A sampled token's log-probability is the model's (the raw logits'), not the tempered distribution's."""
    request = StreamRequest(PROMPTS[1], max_new_tokens=10, ignore_eos=True, logprobs=2,
                            sampling=SamplingParams(temperature=1.5, top_k=20), seed=7)
    result = _run(target, [request])[0]
    _check(checkpoint, PROMPTS[1], result, 2)
    assert any(entry.logprob < entry.top[0][1] for entry in result.logprobs or ()), \
        "10 tokens sampled at temperature 1.5 all were the most likely ones: the test proves nothing"


def test_latest_logprob_follows_the_tokens(target: Path) -> None:
    manifest = load_manifest(target)
    seen: list[tuple[int, TokenLogprob | None]] = []
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        asked = engine.add(StreamRequest(PROMPTS[0], max_new_tokens=5, ignore_eos=True, logprobs=1))
        other = engine.add(StreamRequest(PROMPTS[1], max_new_tokens=5, ignore_eos=True))
        engine.run(on_token=lambda stream, token: seen.append((token, engine.latest_logprob(stream))))
        results = engine.results()
    assert [entry for token, entry in seen if entry is not None] == list(results[asked].logprobs or ())
    assert sum(entry is None for _, entry in seen) == len(results[other].tokens)


@pytest.mark.parametrize("top", [-1, 21])
def test_logprobs_out_of_range_are_refused(top: int, target: Path) -> None:
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        with pytest.raises(GenerationError, match="logprobs must be 0-20"):
            engine.add(StreamRequest(PROMPTS[0], logprobs=top))
