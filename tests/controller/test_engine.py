"""The engine: every stream's greedy tokens equal its solo run, however streams are batched, admitted,
drafted, rolled back and compacted (f32)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.kv_ledger import CompactionMode, CompactionPolicy
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import SamplingParams, sampling_probs
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.draft import Drafter, DraftModel
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.generation import GenerationError
from deskfleet.controller.lookup_first import LookupFirstDraft
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft

F32 = CompileSettings(precision=Precision.F32)
PROMPTS = [
    [1, 17, 99, 230, 5, 42, 7, 300, 11],
    [1, 8, 8, 3],
    [1, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89],
    [1, 2],
    [1, 300, 301, 302, 400, 401],
    [1, 450, 12],
    [1, 60, 61, 62, 63, 64, 65, 66],
    [1, 123],
]


class RecordingChain:
    """A LocalPipeline that counts the kinds of slot deltas the engine sent."""

    def __init__(self, pipeline: LocalPipeline) -> None:
        self.pipeline = pipeline
        self.deltas: Counter[str] = Counter()

    def submit(self, message: Forward) -> None:
        self.deltas.update(type(delta).__name__ for delta in message.slot_deltas)
        self.pipeline.submit(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        return self.pipeline.collect(timeout)

    def release(self, batch_id: int) -> None:
        self.pipeline.release(batch_id)

    def renumber(self) -> None:
        self.pipeline.renumber()


def run_streams(model: Path, requests: list[StreamRequest], stages: int = 1, draft: Path | Drafter | None = None,
                options: EngineOptions | None = None, sent: Counter[str] | None = None,
                histogram: Counter[int] | None = None) -> list[list[int]]:
    manifest = load_manifest(model)
    with LocalPipeline(model, stages, F32, manifest) as pipeline:
        chain = RecordingChain(pipeline)
        drafter = DraftModel(draft, F32) if isinstance(draft, Path) else draft
        engine = Engine(chain, manifest.spec, drafter, options)
        for request in requests:
            engine.add(request)
        results = engine.run()
    if sent is not None:
        sent.update(chain.deltas)
    if histogram is not None:
        histogram.update(engine.accepted_histogram())
    return [results[index].tokens for index in range(len(requests))]


@pytest.fixture(scope="module")
def solo(target: Path) -> dict[int, list[int]]:
    """Each prompt alone, one stage, no draft: the reference."""
    return {index: run_streams(target, [StreamRequest(prompt, max_new_tokens=40, ignore_eos=True)])[0]
            for index, prompt in enumerate(PROMPTS)}


def test_one_stream_matches_solo_across_stage_counts(target: Path, solo: dict[int, list[int]]) -> None:
    for stages in (2, 3, 4):
        tokens = run_streams(target, [StreamRequest(PROMPTS[0], max_new_tokens=40, ignore_eos=True)], stages)
        assert tokens[0] == solo[0], f"{stages} stages"


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_concurrent_streams_equal_their_solo_runs(stages: int, target: Path, other_draft: Path,
                                                  solo: dict[int, list[int]]) -> None:
    # 8 streams of different lengths arriving at different times, some drafted by an unrelated model
    # (heavy rollback), some not, some leaving early; micro-batches of 3 rows force admissions into
    # running batches, and an eager compaction policy forces compaction of dead slots.
    lengths = [40, 12, 40, 5, 30, 40, 1, 25]
    requests = [StreamRequest(prompt, max_new_tokens=lengths[index], ignore_eos=True,
                              speculative=index % 2 == 0, arrival_step=3 * index)
                for index, prompt in enumerate(PROMPTS)]
    options = EngineOptions(max_rows=3, micro_batches=2, fixed_k=3,
                            compaction=CompactionPolicy(min_dead_slots=2, min_dead_fraction=0.0,
                                                        mode=CompactionMode.PACK_ROWS))
    sent: Counter[str] = Counter()
    tokens = run_streams(target, requests, stages, other_draft, options, sent)
    for index, generated in enumerate(tokens):
        assert generated == solo[index][: lengths[index]], f"stream {index} diverged with {stages} stages"
    # The run really exercised admission, rollback, row drops and compaction.
    for kind in ("AdmitRow", "InvalidateSlots", "ReorderRows", "Compact"):
        assert sent[kind] > 0, f"no {kind} delta was sent"


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_self_draft_accepts_everything_and_changes_nothing(stages: int, target: Path,
                                                           solo: dict[int, list[int]]) -> None:
    manifest = load_manifest(target)
    with LocalPipeline(target, stages, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, DraftModel(target, F32), EngineOptions(fixed_k=4))
        engine.add(StreamRequest(PROMPTS[2], max_new_tokens=40, ignore_eos=True))
        tokens = engine.run()[0].tokens
    assert tokens == solo[2]
    histogram = engine.accepted_histogram()
    assert sum(count for accepted, count in histogram.items() if accepted < 4) <= 1  # only the final round
    assert engine.mean_accepted() > 3.5


@pytest.mark.parametrize("stages", [1, 2])
def test_prompt_lookup_streams_equal_their_solo_runs(stages: int, target: Path, solo: dict[int, list[int]]) -> None:
    # Drafts copied from each stream's own context: rows propose different numbers of tokens (or none),
    # some accepted, some rejected; every stream must still equal its solo run.
    lengths = [40, 12, 40, 5, 30, 40, 1, 25]
    requests = [StreamRequest(prompt, max_new_tokens=lengths[index], ignore_eos=True,
                              speculative=index != 1, arrival_step=2 * index)
                for index, prompt in enumerate(PROMPTS)]
    histogram: Counter[int] = Counter()
    tokens = run_streams(target, requests, stages, PromptLookupDraft(), EngineOptions(max_rows=3, micro_batches=2,
                                                                                      k_max=6), histogram=histogram)
    for index, generated in enumerate(tokens):
        assert generated == solo[index][: lengths[index]], f"stream {index} diverged with {stages} stages"
    assert histogram[0] > 0 and sum(count for accepted, count in histogram.items() if accepted > 0) > 0


@pytest.mark.parametrize("stages", [1, 2])
def test_lookup_first_streams_equal_their_solo_runs(stages: int, target: Path, other_draft: Path,
                                                     solo: dict[int, list[int]]) -> None:
    # Copied proposals where a stream repeats itself, an unrelated draft model's elsewhere, in the same
    # micro-batches: rows switch between the two from round to round.
    lengths = [40, 12, 40, 5, 30, 40, 1, 25]
    requests = [StreamRequest(prompt, max_new_tokens=lengths[index], ignore_eos=True,
                              speculative=index != 1, arrival_step=2 * index)
                for index, prompt in enumerate(PROMPTS)]
    drafter = LookupFirstDraft(DraftModel(other_draft, F32))
    tokens = run_streams(target, requests, stages, drafter, EngineOptions(max_rows=3, micro_batches=2, k_max=6))
    for index, generated in enumerate(tokens):
        assert generated == solo[index][: lengths[index]], f"stream {index} diverged with {stages} stages"
    assert drafter.copied_rounds > 0 and drafter.drafted_rounds > 0


def test_adaptive_k_keeps_greedy_output(target: Path, other_draft: Path, solo: dict[int, list[int]]) -> None:
    tokens = run_streams(target, [StreamRequest(PROMPTS[4], max_new_tokens=40, ignore_eos=True)], 2, other_draft,
                         EngineOptions(k_min=1, k_max=6))
    assert tokens[0] == solo[4]


def test_eos_ends_a_stream_and_others_continue(target: Path, solo: dict[int, list[int]]) -> None:
    import dataclasses

    manifest = load_manifest(target)
    eos = solo[1][5]  # the 6th token of stream 1 becomes end-of-sequence
    spec = dataclasses.replace(manifest.spec, eos_token_ids=(eos,))
    with LocalPipeline(target, 2, F32, manifest) as pipeline:
        engine = Engine(pipeline, spec)
        engine.add(StreamRequest(PROMPTS[1], max_new_tokens=40))
        engine.add(StreamRequest(PROMPTS[0], max_new_tokens=40, ignore_eos=True))
        results = engine.run()
    assert results[0].stopped_by_eos and results[0].tokens == solo[1][: solo[1].index(eos) + 1]
    assert results[1].tokens == solo[0]


def test_bad_requests_get_clear_errors(target: Path) -> None:
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        with pytest.raises(GenerationError, match="outside the vocabulary"):
            engine.add(StreamRequest([1, manifest.spec.vocab_size]))
        with pytest.raises(GenerationError, match="exceed the model's context"):
            engine.add(StreamRequest([1, 2, 3], max_new_tokens=manifest.spec.max_context))
        with pytest.raises(GenerationError, match="empty"):
            engine.add(StreamRequest([]))


def test_draft_with_another_vocabulary_is_refused(target: Path, checkpoint_factory: Callable[..., Path],
                                                  export_factory: Callable[[Path, str], Path]) -> None:
    small = export_factory(checkpoint_factory("engine-draft-vocab", num_hidden_layers=1, vocab_size=300), "f32")
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline, pytest.raises(ValueError, match="share a tokenizer"):
        Engine(pipeline, manifest.spec, DraftModel(small, F32))


def _exact_joint(checkpoint: Path, prompt: list[int], params: SamplingParams, depth: int,
                 adjust: Callable[[tuple[int, ...], np.ndarray], np.ndarray] | None = None
                 ) -> dict[tuple[int, ...], float]:
    """P(t1..t_depth) of sampling with `params`, from transformers' own logits (first passed through
    `adjust(prefix, logits)` where given: the tokens sampled so far, the float32 logits of the next)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    joint: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], probability: float) -> None:
        if len(prefix) == depth:
            joint[prefix] = probability
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].numpy()
        if adjust is not None:
            logits = adjust(prefix, logits)
        probs = sampling_probs(logits[None, :], params)[0]
        for token in np.flatnonzero(probs > 0):
            expand((*prefix, int(token)), probability * float(probs[token]))

    expand((), 1.0)
    return joint


def _chi_square(counts: Counter[tuple[int, ...]], joint: dict[tuple[int, ...], float], total: int) -> tuple[float, int]:
    assert set(counts) <= set(joint), "a sequence outside the support of the sampling distribution"
    statistic = sum((counts.get(key, 0) - total * p) ** 2 / (total * p) for key, p in joint.items())
    return statistic, len(joint) - 1


def _critical(degrees: int, z: float = 3.719) -> float:
    """chi-square quantile at p = 1e-4 (Wilson-Hilferty)."""
    return degrees * (1 - 2 / (9 * degrees) + z * (2 / (9 * degrees)) ** 0.5) ** 3


@pytest.mark.slow
def test_speculative_sampling_draws_from_the_target_distribution(
        target: Path, near_draft: Path, checkpoint_factory: Callable[..., Path]) -> None:
    # Top-3 at temperature 3 leaves 27 possible 3-token continuations with sizeable probabilities. Both
    # the plain sampler and speculative sampling (a draft whose distributions overlap the target's but
    # differ: accepted and rejected tokens alike, so the residual distribution matters) must match the
    # exact distribution computed with transformers.
    params = SamplingParams(temperature=3.0, top_k=3)
    prompt = PROMPTS[1]
    joint = _exact_joint(checkpoint_factory("engine-target", num_hidden_layers=4), prompt, params, 3)
    total = 600
    requests = [StreamRequest(prompt, max_new_tokens=3, ignore_eos=True, sampling=params, seed=seed)
                for seed in range(total)]
    options = EngineOptions(max_rows=16, fixed_k=2)
    for draft in (None, near_draft):
        tokens = run_streams(target, requests, 1, draft, options)
        counts = Counter(tuple(row) for row in tokens)
        statistic, degrees = _chi_square(counts, joint, total)
        assert statistic < _critical(degrees), f"draft={draft}: chi-square {statistic:.1f} with {degrees} dof"


@pytest.mark.slow
def test_prompt_lookup_sampling_draws_from_the_target_distribution(
        target: Path, near_draft: Path, checkpoint_factory: Callable[..., Path]) -> None:
    # The prompt holds likely tokens of this model (found by trial: 279 and 342 are likely first tokens and
    # occur in it), so prompt lookup proposes one-hot drafts in many rounds: accepted with probability p(x),
    # else the residual is sampled. The result must be the target's own sampling distribution.
    params = SamplingParams(temperature=3.0, top_k=3)
    prompt = [1, 8, 8, 3, 211, 342, 77, 3]
    joint = _exact_joint(checkpoint_factory("engine-target", num_hidden_layers=4), prompt, params, 3)
    total = 600
    requests = [StreamRequest(prompt, max_new_tokens=3, ignore_eos=True, sampling=params, seed=seed)
                for seed in range(total)]
    # Lookup first with a draft model beside it: copied rows carry a one-hot q, drafted rows the model's.
    # One-token matches (not the default) so that most rounds propose
    for drafter in (PromptLookupDraft(min_ngram=1), LookupFirstDraft(DraftModel(near_draft, F32), min_ngram=1)):
        histogram: Counter[int] = Counter()
        tokens = run_streams(target, requests, 1, drafter, EngineOptions(max_rows=16, fixed_k=2), histogram=histogram)
        statistic, degrees = _chi_square(Counter(tuple(row) for row in tokens), joint, total)
        assert statistic < _critical(degrees), f"{drafter}: chi-square {statistic:.1f} with {degrees} dof"
        assert histogram[0] > 0 and histogram[1] + histogram[2] > 0, histogram  # rejections and acceptances
        if isinstance(drafter, LookupFirstDraft):
            assert drafter.copied_rounds > 0 and drafter.drafted_rounds > 0


def test_a_draft_with_a_shorter_context_is_refused(target: Path, checkpoint_factory: Callable[..., Path],
                                                   export_factory: Callable[[Path, str], Path]) -> None:
    manifest = load_manifest(target)
    short = export_factory(checkpoint_factory("engine-draft-short", num_hidden_layers=1,
                                              max_position_embeddings=manifest.spec.max_context // 2), "f32")
    with LocalPipeline(target, 1, F32, manifest) as pipeline, \
            pytest.raises(ValueError, match=f"--max-context {manifest.spec.max_context}"):
        Engine(pipeline, manifest.spec, DraftModel(short, F32))


def test_the_draft_model_holds_no_state_after_a_run(target: Path, other_draft: Path,
                                                    solo: dict[int, list[int]]) -> None:
    """Streams merged into a draft micro-batch that never drafted (K=0 here; in practice every round
    copied by prompt lookup) still free the prefills they were merged from."""
    drafter = DraftModel(other_draft, F32)
    requests = [StreamRequest(PROMPTS[index], max_new_tokens=40, ignore_eos=True) for index in range(3)]
    outputs = run_streams(target, requests, draft=drafter, options=EngineOptions(fixed_k=0, max_rows=4))
    assert outputs == [solo[index] for index in range(3)]
    assert drafter._executor.micro_batches == 0 and not drafter._tracks


@pytest.mark.parametrize("options", [dict(max_rows=0), dict(micro_batches=0), dict(k_min=0), dict(k_min=5, k_max=4),
                                     dict(fixed_k=-1)])
def test_engine_options_out_of_range_are_refused(options: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        EngineOptions(**options)  # type: ignore[arg-type]


class InterruptingChain(RecordingChain):
    """A local pipeline whose collect() raises KeyboardInterrupt (Ctrl-C) once, at its `stop_at`-th call."""

    def __init__(self, pipeline: LocalPipeline, stop_at: int) -> None:
        super().__init__(pipeline)
        self.stop_at = stop_at
        self.calls = 0

    def collect(self, timeout: float | None = None) -> ForwardResult:
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return super().collect(timeout)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_run_stopped_early_frees_its_micro_batches_and_the_chain_serves_the_next_run(
        stages: int, target: Path, other_draft: Path, solo: dict[int, list[int]]) -> None:
    # Ctrl-C in the middle of a run with steps in flight, streams still arriving and drafted rows (what a
    # chat's interrupted reply does): the stages and the drafter hold nothing of it afterwards, and a new
    # engine on the same pipeline (ids from 1 again) gives every stream its solo tokens.
    manifest = load_manifest(target)
    requests = [StreamRequest(PROMPTS[index], max_new_tokens=40, ignore_eos=True, arrival_step=3 * index)
                for index in range(4)]
    with LocalPipeline(target, stages, F32, manifest) as pipeline:
        drafter = DraftModel(other_draft, F32)
        stopped = Engine(InterruptingChain(pipeline, stop_at=9), manifest.spec, drafter,
                         EngineOptions(micro_batches=stages, max_rows=2))
        for request in requests:
            stopped.add(request)
        with pytest.raises(KeyboardInterrupt):
            stopped.run()
        partial = stopped.results()
        assert 0 < sum(len(result.tokens) for result in partial.values()) < 4 * 40
        assert all(result.tokens == solo[index][: len(result.tokens)] for index, result in partial.items())
        assert drafter._executor.micro_batches == 0 and not drafter._tracks
        engine = Engine(pipeline, manifest.spec, drafter, EngineOptions(micro_batches=stages, max_rows=2))
        for request in requests:
            engine.add(request)
        results = engine.run()
    assert [results[index].tokens for index in range(4)] == [solo[index] for index in range(4)]
    assert pipeline.micro_batches == (0,) * stages


@pytest.mark.parametrize("stages", [1, 2])
def test_the_run_after_one_stopped_with_its_prefill_in_flight_gets_its_own_tokens(
        stages: int, target: Path, solo: dict[int, list[int]]) -> None:
    # Ctrl-C at the very first collect: the stopped run's prefill of micro-batch 1 is still in flight when
    # the next engine starts its own micro-batch 1 step 0 with another prompt. The chain is renumbered, so
    # the stale result can never be taken for the new one.
    manifest = load_manifest(target)
    with LocalPipeline(target, stages, F32, manifest) as pipeline:
        stopped = Engine(InterruptingChain(pipeline, stop_at=1), manifest.spec)
        stopped.add(StreamRequest(PROMPTS[0], max_new_tokens=40, ignore_eos=True))
        with pytest.raises(KeyboardInterrupt):
            stopped.run()
        engine = Engine(RecordingChain(pipeline), manifest.spec)
        engine.add(StreamRequest(PROMPTS[1], max_new_tokens=40, ignore_eos=True))
        assert engine.run()[0].tokens == solo[1]
    assert pipeline.micro_batches == (0,) * stages


def test_a_draft_model_that_gives_nan_logits_to_a_sampled_row_is_named(
        target: Path, near_draft: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A draft in a precision that overflows on its device gives NaN logits; sampling from them used to pick
    # the vocabulary's last token silently, and now fails in common/speculative.py: the run must say which
    # model and what to do, not "cannot sample from probabilities of total nan".
    from deskfleet.controller import draft as draft_module

    monkeypatch.setattr(draft_module, "sampling_probs",
                        lambda logits, params: np.full(np.shape(logits), np.nan, dtype=np.float32))
    request = StreamRequest(PROMPTS[1], max_new_tokens=4, ignore_eos=True,
                            sampling=SamplingParams(temperature=1.0), seed=3)
    with pytest.raises(ValueError, match=r"the draft model gave stream 0 no distribution .*NaN or inf.*"
                                         r"--precision f32"):
        run_streams(target, [request], 1, near_draft, EngineOptions(fixed_k=2))


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_rows": 0}, "max_rows and micro_batches must be at least 1"),
    ({"k_min": 2, "k_max": 1}, "need 1 <= k_min <= k_max <= 64"),
    ({"k_max": 65}, "need 1 <= k_min <= k_max <= 64, got 1 and 65"),
    ({"fixed_k": 65}, "fixed_k must be from 0 to 64, got 65"),
    ({"fixed_k": -1}, "fixed_k must be from 0 to 64"),
    ({"prefill_chunk": -1}, "prefill_chunk must be 0"),
])
def test_engine_options_refuse_bounds_a_run_cannot_keep(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineOptions(**fields)  # type: ignore[arg-type]
