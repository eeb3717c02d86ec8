"""While streams run, a prompt is fed in chunks of `prefill_chunk` tokens, one call each, between their steps:
tokens equal a run that feeds every prompt whole (f32: greedy, sampled, drafted by lookup and by a draft model,
arrivals mid-run, 1 and 2 stages, a failover mid-prompt); no call, the target's or the draft model's, carries
more than a chunk of a prompt that arrived while streams ran; a stream that runs gets its tokens while a long
prompt is still being fed; newcomers that arrive together take turns; adaptive K learns no cost from a step
that waited beside a chunk; with nothing running (the start of a run, a lone prompt) a prompt goes whole, as
chunks would only make it dearer."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import RoundCost, SamplingParams
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.draft import Drafter, DraftModel
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft
from tests.controller.test_engine_failover import BreakingChain

F32 = CompileSettings(precision=Precision.F32)


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    """A prompt with repeats in it, so that prompt lookup finds matches."""
    rng = random.Random(seed)
    motif = [rng.randrange(1, vocab) for _ in range(6)]
    return [motif[i % 6] if rng.random() < 0.5 else rng.randrange(1, vocab) for i in range(length)]


class RecordingChain(BreakingChain):
    """A pipeline that breaks at its `break_at`-th collect and records every step: (micro-batch, tokens a row at
    most, stream ids)."""

    def __init__(self, pipeline: LocalPipeline, break_at: int | None = None) -> None:
        super().__init__(pipeline, break_at)
        self.steps: list[tuple[int, int, tuple[int, ...]]] = []

    def submit(self, message: Forward) -> None:
        super().submit(message)
        assert message.input_ids is not None
        self.steps.append((message.micro_batch_id, message.input_ids.shape[1], message.stream_ids))


def _run(model: Path, requests: list[StreamRequest], options: EngineOptions, stages: int = 1,
         speculative: bool = False, break_at: list[int | None] | None = None, drafter: Drafter | None = None
         ) -> tuple[list[list[int]], list[RecordingChain], Engine]:
    manifest = load_manifest(model)
    breaks: Iterator[int | None] = iter(break_at or [None])
    chains: list[RecordingChain] = []
    with ExitStack() as pipelines:
        def chain() -> RecordingChain:
            pipeline = pipelines.enter_context(LocalPipeline(model, stages, F32, manifest))
            chains.append(RecordingChain(pipeline, next(breaks, None)))
            return chains[-1]

        if speculative and drafter is None:
            drafter = PromptLookupDraft(min_ngram=1)
        engine = Engine(chain(), manifest.spec, drafter, options)
        for request in requests:
            engine.add(request)
        results = engine.run(recover=lambda error: chain())
    return [results[index].tokens for index in range(len(requests))], chains, engine


def _requests(vocab: int, lengths: list[int], arrivals: list[int], new_tokens: list[int],
              sampling: SamplingParams | None = None, speculative: bool = True) -> list[StreamRequest]:
    return [StreamRequest(_prompt(index, length, vocab), max_new_tokens=new, ignore_eos=True, arrival_step=arrival,
                          sampling=sampling or SamplingParams(temperature=0.0), seed=7 + index,
                          speculative=speculative)
            for index, (length, arrival, new) in enumerate(zip(lengths, arrivals, new_tokens, strict=True))]


# Two arrive together while nothing runs (fed whole), one of them with a single new token;
# the others arrive while streams run (chunked).
LENGTHS = [45, 70, 90, 5, 33]
ARRIVALS = [0, 0, 3, 6, 8]
NEW_TOKENS = [12, 1, 10, 9, 6]


@pytest.mark.parametrize("stages", [1, 2])
def test_chunked_prompts_give_the_tokens_of_whole_ones(target: Path, stages: int) -> None:
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, LENGTHS, ARRIVALS, NEW_TOKENS)
    whole, whole_chains, _ = _run(target, requests, EngineOptions(max_rows=3, micro_batches=2, prefill_chunk=0),
                                  stages)
    chunked, chunked_chains, _ = _run(target, requests, EngineOptions(max_rows=3, micro_batches=2, prefill_chunk=16),
                                      stages)
    assert chunked == whole
    assert [len(tokens) for tokens in chunked] == NEW_TOKENS

    def widths(chain: RecordingChain, stream: int) -> list[int]:
        return [width for _, width, streams in chain.steps if streams == (stream,)]

    assert max(widths(whole_chains[0], 2)) == 90  # the prompt that arrived while streams ran: one call
    assert max(widths(chunked_chains[0], 2)) == 16
    assert widths(chunked_chains[0], 2)[:6] == [16] * 5 + [10]  # 90 = 5 x 16 + 10
    # nothing ran yet: the first two prompts whole, each a micro-batch of its own (micro_batches=2)
    assert chunked_chains[0].steps[:2] == whole_chains[0].steps[:2] == [(1, 45, (0,)), (2, 70, (1,))]


def test_sampled_and_drafted_streams_draw_as_with_whole_prompts(target: Path) -> None:
    vocab = load_manifest(target).spec.vocab_size
    sampled = _requests(vocab, LENGTHS, ARRIVALS, NEW_TOKENS, SamplingParams(temperature=0.9, top_k=40, top_p=0.95))
    options = {chunk: EngineOptions(max_rows=3, micro_batches=2, prefill_chunk=chunk) for chunk in (0, 13)}
    assert _run(target, sampled, options[13])[0] == _run(target, sampled, options[0])[0]
    drafted = _requests(vocab, LENGTHS, ARRIVALS, [20, 1, 20, 20, 20])
    chunked, _, engine = _run(target, drafted, options[13], speculative=True)
    assert engine.accepted_histogram()  # some rounds verified drafts
    assert chunked == _run(target, drafted, options[0], speculative=True)[0]


def record_draft_widths(draft: DraftModel) -> list[int]:
    """The tokens (a row's widest) of every call the draft model makes from now on, as a list that grows."""
    widths: list[int] = []
    run = draft._executor.run

    def recording(message: Forward, return_logits: bool = False) -> object:
        assert message.input_ids is not None
        widths.append(message.input_ids.shape[1])
        return run(message, return_logits)

    draft._executor.run = recording  # type: ignore[method-assign,assignment]
    return widths


def test_a_draft_model_prefills_chunk_for_chunk(target: Path, other_draft: Path) -> None:
    """The draft model runs in the driver's thread: its prefill of a newcomer goes in the same chunks."""
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, [6, 90], [0, 3], [30, 12])
    draft = DraftModel(other_draft, F32)
    widths = record_draft_widths(draft)
    chunked, _, engine = _run(target, requests, EngineOptions(max_rows=3, prefill_chunk=16), drafter=draft)
    assert engine.accepted_histogram()
    assert max(widths) == 16 and widths.count(16) >= 5  # 90 = 5 x 16 + 10; the first prompt (6) went whole
    widths.clear()
    assert chunked == _run(target, requests, EngineOptions(max_rows=3, prefill_chunk=0), drafter=draft)[0]
    assert max(widths) == 90
    with pytest.raises(ValueError, match="not the one-row prefill of stream 5"):
        draft.extend(1, 5, [1, 2])


def test_a_running_stream_gets_tokens_while_a_long_prompt_is_fed(target: Path) -> None:
    """A newcomer of 96 tokens in chunks of 8: 12 calls, with steps of the running stream between them (fed
    whole, its one call is all the running stream waits for)."""
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, [6, 96], [0, 4], [40, 3], speculative=False)
    options = EngineOptions(max_rows=4, micro_batches=2, prefill_chunk=8)
    _, (chain,), _ = _run(target, requests, options)
    newcomer_steps = [index for index, (_, _, streams) in enumerate(chain.steps) if streams == (1,)]
    chunks = [index for index in newcomer_steps if chain.steps[index][1] == 8]
    assert len(chunks) == 96 // 8
    between = [sum(1 for _, width, streams in chain.steps[first + 1:second] if streams == (0,) and width == 1)
               for first, second in itertools.pairwise(chunks)]
    assert all(count >= 1 for count in between), between


def test_newcomers_that_arrive_together_take_turns_between_the_running_steps(target: Path) -> None:
    """Three prompts arrive at once while a stream runs: one prefill call between two of its steps, not three;
    the first to arrive is fed first, and the tokens are those of whole prompts."""
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, [6, 40, 40, 40], [0, 3, 3, 3], [60, 2, 2, 2], speculative=False)
    options = EngineOptions(max_rows=4, micro_batches=1, prefill_chunk=8)
    tokens, (chain,), _ = _run(target, requests, options)
    assert tokens == _run(target, requests, EngineOptions(max_rows=4, micro_batches=1, prefill_chunk=0))[0]
    running = [index for index, (_, width, streams) in enumerate(chain.steps) if 0 in streams and width == 1]
    prefill_calls = [[streams for _, width, streams in chain.steps[first + 1:second] if width > 1]
                     for first, second in itertools.pairwise(running)]
    assert max(len(calls) for calls in prefill_calls) == 1, prefill_calls
    order = [calls[0][0] for calls in prefill_calls if calls]
    assert order == [1] * 5 + [2] * 5 + [3] * 5  # 40 = 5 x 8, one newcomer after the other


class EventChain(RecordingChain):
    """Also logs submits and collects in order: ("submit", batch, step, kind) and ("collect", batch, step), kind
    "prefill" (no draft, several tokens), "verify" (drafts) or "plain"."""

    def __init__(self, pipeline: LocalPipeline, break_at: int | None = None) -> None:
        super().__init__(pipeline, break_at)
        self.events: list[tuple[object, ...]] = []

    def submit(self, message: Forward) -> None:
        super().submit(message)
        assert message.input_ids is not None
        kind = "verify" if message.draft is not None else "prefill" if message.input_ids.shape[1] > 1 else "plain"
        self.events.append(("submit", message.micro_batch_id, message.step_id, kind))

    def collect(self, timeout: float | None = None) -> ForwardResult:
        result = super().collect(timeout)
        self.events.append(("collect", result.micro_batch_id, result.step_id))
        return result


def test_adaptive_k_learns_no_round_cost_from_steps_that_waited_for_a_prefill(target: Path, other_draft: Path) -> None:
    """A step on the chain beside a prefill call waited for it too: its round trip would teach adaptive K that
    rounds cost a chunk more than they do."""
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, [20, 98], [0, 6], [60, 2])  # 98 = 12 x 8 + 2: each call of it several tokens
    requests[1] = replace(requests[1], speculative=False)
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        chain = EventChain(pipeline)
        engine = Engine(chain, manifest.spec, DraftModel(other_draft, F32),
                        EngineOptions(max_rows=2, micro_batches=1, prefill_chunk=8))
        recorded: list[RoundCost] = []
        record_cost = engine.k_policy.record_cost

        def recording(cost: RoundCost, verified: int | None = None) -> None:
            recorded.append(cost)
            record_cost(cost, verified)

        engine.k_policy.record_cost = recording  # type: ignore[method-assign]
        for request in requests:
            engine.add(request)
        engine.run()
    outstanding: dict[tuple[object, object], str] = {}
    beside: set[tuple[object, object]] = set()
    verifies = []
    for event in chain.events:
        key = (event[1], event[2])
        if event[0] == "submit":
            if event[3] == "prefill":
                beside.update(outstanding)  # everything on the chain now waits for it
            elif any(kind == "prefill" for kind in outstanding.values()):
                beside.add(key)
            outstanding[key] = str(event[3])
            if event[3] == "verify":
                verifies.append(key)
        else:
            outstanding.pop(key)
    clean = [key for key in verifies if key not in beside]
    assert len(clean) < len(verifies) - 10  # the newcomer's 13 calls ran beside verifications
    assert len(recorded) == len(clean) > 10


def test_a_failover_mid_prompt_starts_its_prefill_again(target: Path) -> None:
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, LENGTHS, ARRIVALS, NEW_TOKENS, speculative=False)
    options = EngineOptions(max_rows=3, micro_batches=2, prefill_chunk=16)
    expected, _, _ = _run(target, requests, options)
    for break_at in ([4], [9], [13, 3]):  # with 2 / 4 / 5 of the 90-token prompt's 6 chunks sent; twice
        tokens, chains, engine = _run(target, requests, options, stages=2, break_at=break_at)
        assert tokens == expected, break_at
        assert len(engine.failovers) == len(break_at)
        chunks_sent = sum(1 for _, width, streams in chains[0].steps if streams == (2,) and width == 16)
        assert 0 < chunks_sent < 6, (break_at, chunks_sent)  # the chain broke mid-prompt


def test_a_prompt_that_starts_as_a_waiting_stream_begins_to_run_is_chunked(target: Path) -> None:
    """One row at a time: the third prompt starts at the step where the second stream's prefill becomes a running
    micro-batch (the first has ended), so the third is chunked, not fed whole as if nothing ran."""
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, [5, 3, 60], [0, 0, 0], [12, 12, 12], speculative=False)
    tokens, (chain,), _ = _run(target, requests, EngineOptions(max_rows=1, micro_batches=1, prefill_chunk=8))
    assert [width for _, width, streams in chain.steps if streams == (2,)][:8] == [8] * 7 + [4]
    assert tokens == _run(target, requests, EngineOptions(max_rows=1, micro_batches=1, prefill_chunk=0))[0]


def test_a_lone_prompt_goes_whole(target: Path) -> None:
    vocab = load_manifest(target).spec.vocab_size
    requests = _requests(vocab, [90], [0], [4], speculative=False)
    tokens, (chain,), _ = _run(target, requests, EngineOptions(prefill_chunk=8))
    assert [width for _, width, _ in chain.steps] == [90, 1, 1, 1]
    assert tokens == _run(target, requests, EngineOptions(prefill_chunk=0))[0]


def test_a_negative_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_chunk must be 0"):
        EngineOptions(prefill_chunk=-1)
