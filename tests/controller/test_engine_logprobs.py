"""Log-probabilities of generated tokens (StreamRequest.logprobs): the last stage's figures equal transformers' own
log-softmax at every generated position (f32), on 1 and 2 stages, with and without a draft model, greedy and sampled,
and only the streams that ask get them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent import stage_executor
from deskfleet.common.logprobs import TokenLogprob
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import SamplingParams
from deskfleet.controller import engine as engine_module
from deskfleet.controller.draft import DraftModel
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest, StreamResult
from deskfleet.controller.generation import GenerationError
from deskfleet.controller.pipeline import LocalPipeline, PipelineError

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
         accepted: list[float] | None = None, options: EngineOptions | None = None) -> list[StreamResult]:
    """The requests' results; `accepted` gets the run's mean accepted draft tokens a round."""
    manifest = load_manifest(target)
    with LocalPipeline(target, stages, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, drafter, options)  # type: ignore[arg-type]
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


def _prompt_reference(checkpoint: Path, prompt: list[int]) -> np.ndarray:
    """transformers' log-softmax [len(prompt) - 1, V] at each prompt position but the last."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[:-1].numpy()


def _check_prompt(checkpoint: Path, prompt: list[int], result: StreamResult, top: int) -> None:
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt) - 1
    reference = _prompt_reference(checkpoint, prompt)
    for at, entry in enumerate(result.prompt_logprobs):
        assert entry.token == prompt[at + 1]
        assert entry.logprob == pytest.approx(reference[at, prompt[at + 1]], abs=1e-4), f"prompt token {at + 1}"
        expected = np.argsort(-reference[at], kind="stable")[:top]
        assert [alternative for alternative, _ in entry.top] == expected.tolist(), f"prompt token {at + 1}"


@pytest.mark.parametrize("stages", [1, 2])
def test_a_prompts_logprobs_equal_transformers(stages: int, target: Path, checkpoint: Path) -> None:
    """A text scored: each prompt token's log-probability after the first, beside a stream that does not ask, whose
    tokens are unchanged, and the generated tokens' figures as before."""
    results = _run(target, [StreamRequest(PROMPTS[2], max_new_tokens=4, ignore_eos=True, logprobs=2,
                                          prompt_logprobs=True),
                            StreamRequest(PROMPTS[0], max_new_tokens=6, ignore_eos=True)], stages)
    _check_prompt(checkpoint, PROMPTS[2], results[0], 2)
    _check(checkpoint, PROMPTS[2], results[0], 2)
    assert results[1].prompt_logprobs is None and results[1].logprobs is None
    alone = _run(target, [StreamRequest(PROMPTS[2], max_new_tokens=4, ignore_eos=True),
                          StreamRequest(PROMPTS[0], max_new_tokens=6, ignore_eos=True)])
    assert [result.tokens for result in results] == [result.tokens for result in alone]


def test_a_prompt_fed_in_chunks_is_scored_chunk_by_chunk(target: Path, checkpoint: Path) -> None:
    """A prompt that arrives while another stream runs goes in chunks of 3 tokens: each chunk's positions are scored,
    the chunks that return no token included."""
    long_prompt = [1, *range(40, 60)]
    results = _run(target, [StreamRequest(PROMPTS[0], max_new_tokens=30, ignore_eos=True),
                            StreamRequest(long_prompt, max_new_tokens=3, ignore_eos=True, logprobs=1,
                                          prompt_logprobs=True, arrival_step=2)],
                   options=EngineOptions(prefill_chunk=3))
    _check_prompt(checkpoint, long_prompt, results[1], 1)
    _check(checkpoint, long_prompt, results[1], 1)
    alone = _run(target, [StreamRequest(long_prompt, max_new_tokens=3, ignore_eos=True)])[0]
    assert results[1].tokens == alone.tokens


def test_the_prompts_logprobs_need_logprobs_and_the_whole_prompt(target: Path) -> None:
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        with pytest.raises(GenerationError, match="the prompt's log-probabilities need logprobs"):
            engine.add(StreamRequest(PROMPTS[0], prompt_logprobs=True))


def test_a_scored_prompt_goes_in_chunks_whose_logits_fit(target: Path, checkpoint: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring takes every fed position's logits: the driver feeds a scored prompt in chunks whose [rows, T, V] logits
    fit SCORED_LOGITS_BYTES (here 3 tokens' worth), even with nothing else running."""
    manifest = load_manifest(target)
    monkeypatch.setattr(engine_module, "SCORED_LOGITS_BYTES", 4 * manifest.spec.vocab_size * 3)
    widths: list[int] = []
    with LocalPipeline(target, 2, F32, manifest) as pipeline:
        submit = pipeline.submit
        monkeypatch.setattr(pipeline, "submit", lambda message: (
            widths.append(message.scored_ids.shape[1]) if message.scored_ids is not None else None, submit(message)))
        engine = Engine(pipeline, manifest.spec)
        engine.add(StreamRequest(PROMPTS[2], max_new_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=True))
        result = engine.run()[0]
    assert widths and max(widths) <= 3 and len(widths) >= (len(PROMPTS[2]) - 1) // 3
    _check_prompt(checkpoint, PROMPTS[2], result, 1)


def test_a_last_stage_refuses_a_scored_call_whose_logits_would_not_fit(target: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = load_manifest(target)
    monkeypatch.setattr(stage_executor, "SCORED_LOGITS_BYTES", 4 * manifest.spec.vocab_size * 2)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        engine.add(StreamRequest(PROMPTS[2], max_new_tokens=3, logprobs=1, prompt_logprobs=True))
        with pytest.raises(PipelineError, match=r"scores 14 positions of 1 row\(s\) would take 0\.0 MiB of "
                                                r"logits, past the 0\.0 MiB a scored call may take: feed the prompt"):
            engine.run()
