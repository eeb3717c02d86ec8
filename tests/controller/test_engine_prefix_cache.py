"""The engine's prefix cache (EngineOptions.prefix_cache_tokens): a prompt prefilled alone and admitted into a running
micro-batch leaves its micro-batch on the stages, and so does a stream that ends as the last row of its micro-batch; a
later stream whose prompt begins with the same tokens starts from that state and is fed only the rest, with the
tokens of a fresh run (f32: greedy, sampled, drafted by prompt lookup and by a draft model, 1 and 2 stages), and is
then admitted into a running micro-batch as any newcomer. Entries past the capacity are released, as is every entry
when the run ends; a stream scoring its prompt feeds it whole."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

import deskfleet.controller.lookup_first as lookup_first
from deskfleet.agent.kv_memory_guard import KvMemoryRefused
from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import SamplingParams
from deskfleet.common.wire import Forward
from deskfleet.controller import engine as engine_module
from deskfleet.controller.draft import Drafter, DraftModel
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest, StreamResult
from deskfleet.controller.engine_service import EngineService, OpenedChain
from deskfleet.controller.lookup_first import LookupFirstDraft
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft
from tests.controller.test_engine_kept_kv import ReleaseRecordingChain
from tests.controller.test_engine_service import Sink

F32 = CompileSettings(precision=Precision.F32)
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
CACHE = 4096


class MessageChain(ReleaseRecordingChain):
    """ReleaseRecordingChain that also keeps every step it was given, and the order of steps and releases."""

    def __init__(self, pipeline: LocalPipeline) -> None:
        super().__init__(pipeline)
        self.messages: list[Forward] = []
        self.events: list[tuple[str, int]] = []  # ("submit" | "release", micro-batch id)

    def submit(self, message: Forward) -> None:
        super().submit(message)
        self.messages.append(message)
        self.events.append(("submit", message.micro_batch_id))

    def release(self, batch_id: int) -> None:
        self.events.append(("release", batch_id))
        super().release(batch_id)


def _tokens(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(1, vocab) for _ in range(5)]  # repeats, so that prompt lookup finds matches
    return [motif[i % 5] if rng.random() < 0.5 else rng.randrange(1, vocab) for i in range(length)]


def _fresh(model: Path, request: StreamRequest, stages: int, drafter: Drafter | None = None) -> list[int]:
    """The stream alone on a new pipeline, its whole prompt fed."""
    with LocalPipeline(model, stages, F32) as pipeline:
        engine = Engine(pipeline, load_manifest(model).spec, drafter, EngineOptions())
        engine.add(request)
        return engine.run()[0].tokens


def _run_cached(pipeline: LocalPipeline, requests: list[StreamRequest] | tuple[StreamRequest, ...],
                drafter: Drafter | None = None) -> tuple[MessageChain, Engine, list[int], dict[int, StreamResult]]:
    """`requests` run on `pipeline` through a MessageChain, one micro-batch, with a prefix cache: the chain, the
    engine, the streams' ids, and their results."""
    chain = MessageChain(pipeline)
    engine = Engine(chain, pipeline.manifest.spec, drafter,
                    EngineOptions(micro_batches=1, prefix_cache_tokens=CACHE))
    ids = [engine.add(request) for request in requests]
    return chain, engine, ids, engine.run()


def _drafter(drafting: str | None, draft_model: Path) -> Drafter | None:
    if drafting == "lookup":
        return PromptLookupDraft(min_ngram=1)
    return DraftModel(draft_model, F32) if drafting == "model" else None


@pytest.mark.parametrize(("stages", "drafting", "sampling"), [
    (1, None, GREEDY), (2, None, GREEDY), (1, None, SAMPLED), (2, "lookup", GREEDY), (1, "model", GREEDY)])
def test_a_prompt_admitted_into_a_running_batch_serves_a_later_prompt_that_begins_with_it(
        target: Path, other_draft: Path, stages: int, drafting: str | None, sampling: SamplingParams) -> None:
    vocab = load_manifest(target).spec.vocab_size
    long_runner = StreamRequest(_tokens(1, 12, vocab), max_new_tokens=40, ignore_eos=True)
    shared = _tokens(2, 30, vocab)
    first = StreamRequest(shared, max_new_tokens=6, ignore_eos=True, sampling=sampling, seed=5, arrival_step=2)
    later = StreamRequest(shared + _tokens(3, 9, vocab), max_new_tokens=8, ignore_eos=True, sampling=sampling,
                          seed=7, arrival_step=16)
    with ExitStack() as stack:
        pipeline = stack.enter_context(LocalPipeline(target, stages, F32))
        chain, engine, ids, results = _run_cached(pipeline, (long_runner, first, later),
                                                  _drafter(drafting, other_draft))
    assert pipeline.micro_batches == (0,) * stages  # the run released what its cache kept (read once closed)
    # the first prompt was admitted into the running micro-batch and kept; the later one started from it, fed only
    # what follows, and was admitted in turn
    assert results[ids[1]].reused_tokens == 0
    assert results[ids[2]].reused_tokens == len(shared)
    assert engine.prefix_cache.hits == 1
    admitted = [message for message in chain.messages if message.admit_from]
    assert [message.keep_sources for message in admitted] == [(True,), (True,)]
    assert all(message.stream_ids == (ids[0], ids[1]) for message in admitted[:1])
    resumed_prefill = [message for message in chain.messages if message.stream_ids == (ids[2],)]
    assert resumed_prefill and resumed_prefill[0].input_ids is not None
    assert resumed_prefill[0].input_ids.shape[1] == len(later.prompt_ids) - len(shared)
    # the first prompt's micro-batch, kept at its admission, gave way to the copy of the first stream's row when that
    # stream ended (its prompt and reply, which begin with the prompt): the later stream starts from the copy
    copied = [message.copy_into[0] for message in chain.messages if message.copy_into]
    assert resumed_prefill[0].micro_batch_id == copied[0] != admitted[0].admit_from[0]
    for stream_id, request in zip(ids, (long_runner, first, later), strict=True):
        assert results[stream_id].tokens == _fresh(target, request, stages, _drafter(drafting, other_draft))


@pytest.mark.parametrize("stages", [1, 2])
def test_a_prompt_that_parts_from_an_entry_inside_it_is_rolled_back_compacted_and_admitted(
        target: Path, stages: int) -> None:
    """The entry's tokens past the shared prefix die by mask, and the state is compacted to its live slots before
    the rest of the prompt is fed: only a row that holds exactly its first slots can be copied into a batch."""
    vocab = load_manifest(target).spec.vocab_size
    long_runner = StreamRequest(_tokens(1, 12, vocab), max_new_tokens=40, ignore_eos=True)
    shared = _tokens(2, 30, vocab)
    first = StreamRequest(shared, max_new_tokens=6, ignore_eos=True, arrival_step=2)
    later = StreamRequest(shared[:24] + _tokens(3, 12, vocab), max_new_tokens=8, ignore_eos=True, arrival_step=16)
    with LocalPipeline(target, stages, F32) as pipeline:
        chain, _, ids, results = _run_cached(pipeline, (long_runner, first, later))
    assert results[ids[2]].reused_tokens == 24
    resumed = [message for message in chain.messages if message.stream_ids == (ids[2],)]
    assert [type(delta).__name__ for delta in resumed[0].slot_deltas] == ["InvalidateSlots", "Compact", "AppendSlots"]
    assert [message.keep_sources for message in chain.messages if message.admit_from] == [(True,), (True,)]
    for stream_id, request in zip(ids, (long_runner, first, later), strict=True):
        assert results[stream_id].tokens == _fresh(target, request, stages)


def test_a_stream_that_ends_its_micro_batch_serves_the_next_turn_with_its_reply(target: Path) -> None:
    """A chat's next turn repeats the conversation: the state the last reply left holds its prompt and reply."""
    vocab = load_manifest(target).spec.vocab_size
    turn = StreamRequest(_tokens(4, 40, vocab), max_new_tokens=10, ignore_eos=True)
    with LocalPipeline(target, 2, F32) as pipeline:
        engine = Engine(pipeline, load_manifest(target).spec, None, EngineOptions(prefix_cache_tokens=CACHE))
        first_id = engine.add(turn)
        reply = _fresh(target, turn, 1)
        next_turn = StreamRequest(turn.prompt_ids + reply + _tokens(5, 6, vocab), max_new_tokens=10,
                                  ignore_eos=True, arrival_step=30)
        next_id = engine.add(next_turn)
        results = engine.run()
    assert pipeline.micro_batches == (0, 0)
    assert results[first_id].tokens == reply
    # the kept state holds the prompt and the reply but its last token, which was never fed
    assert results[next_id].reused_tokens == len(turn.prompt_ids) + len(reply) - 1
    assert results[next_id].tokens == _fresh(target, next_turn, 1)


def test_entries_past_the_capacity_are_released_least_recently_kept_first(target: Path) -> None:
    vocab = load_manifest(target).spec.vocab_size
    prompts = [_tokens(10 + index, 30, vocab) for index in range(3)]
    requests = [StreamRequest(prompt, max_new_tokens=4, ignore_eos=True, arrival_step=12 * index)
                for index, prompt in enumerate(prompts)]
    with LocalPipeline(target, 1, F32) as pipeline:
        chain = ReleaseRecordingChain(pipeline)
        engine = Engine(chain, load_manifest(target).spec, None, EngineOptions(prefix_cache_tokens=70))
        kept_sizes: list[tuple[int, int]] = []

        def watch(stream_id: int, token: int) -> None:
            kept_sizes.append((len(engine.prefix_cache), engine.prefix_cache.tokens))

        for request in requests:
            engine.add(request)
        later = engine.add(StreamRequest(prompts[0] + [1, 2], max_new_tokens=2, ignore_eos=True, arrival_step=40))
        results = engine.run(on_token=watch)
    # each stream ended its micro-batch (33 tokens kept): the third pushed the first out
    assert max(tokens for _, tokens in kept_sizes) <= 70
    assert max(entries for entries, _ in kept_sizes) == 2
    assert results[later].reused_tokens == 0  # the first prompt's state was given up
    assert len(chain.released) >= 4  # the first one evicted, then the rest at the run's end


def test_a_stream_that_scores_its_prompt_feeds_it_whole(target: Path) -> None:
    vocab = load_manifest(target).spec.vocab_size
    prompt = _tokens(20, 30, vocab)
    with LocalPipeline(target, 1, F32) as pipeline:
        engine = Engine(pipeline, load_manifest(target).spec, None, EngineOptions(prefix_cache_tokens=CACHE))
        engine.add(StreamRequest(prompt, max_new_tokens=4, ignore_eos=True))
        scored = engine.add(StreamRequest([*prompt, 3, 4], max_new_tokens=2, ignore_eos=True, logprobs=0,
                                          prompt_logprobs=True, arrival_step=10))
        results = engine.run()
    assert results[scored].reused_tokens == 0
    assert results[scored].prompt_logprobs is not None and len(results[scored].prompt_logprobs) == len(prompt) + 1
    assert engine.prefix_cache.hits == 0


def test_an_entry_the_draft_model_still_holds_is_not_taken_by_a_drafted_stream(
        target: Path, other_draft: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model frees a merged prefill only at its next step on the micro-batch it joined, which lookup first
    skips when prompt lookup proposes for every row: a drafted newcomer must not prefill the draft model under the
    entry's id meanwhile (it raised "micro-batch 2 step 0 came after step 0" and failed every stream)."""
    monkeypatch.setattr(lookup_first, "lookup_continuation", lambda context, k, *args: [int(context[-1])] * k)
    vocab = load_manifest(target).spec.vocab_size
    shared = _tokens(2, 30, vocab)
    requests = [StreamRequest(_tokens(1, 12, vocab), max_new_tokens=40, ignore_eos=True),
                StreamRequest(shared, max_new_tokens=6, ignore_eos=True, arrival_step=2),
                StreamRequest(shared + _tokens(3, 9, vocab), max_new_tokens=8, ignore_eos=True, arrival_step=16)]
    with LocalPipeline(target, 1, F32) as pipeline:
        engine = Engine(pipeline, load_manifest(target).spec, LookupFirstDraft(DraftModel(other_draft, F32)),
                        EngineOptions(micro_batches=1, prefix_cache_tokens=CACHE))
        ids = [engine.add(request) for request in requests]
        results = engine.run()
    for stream_id, request in zip(ids, requests, strict=True):
        assert results[stream_id].tokens == _fresh(target, request, 1)


@pytest.mark.parametrize(("stages", "short_stage"), [(1, None), (2, None), (1, 0), (2, 0), (2, 1)])
def test_rows_that_end_together_are_copied_out_by_one_more_step_and_serve_the_next_turns_at_once(
        target: Path, monkeypatch: pytest.MonkeyPatch, stages: int, short_stage: int | None) -> None:
    """Every row of a micro-batch ends at once: one more step (one row fed its last token, its result dropped)
    copies each row out (a state of them all would hold every row), then the micro-batch goes. The next turns, sent
    the moment the replies end, wait that step for the copies rather than feed their prompts whole. A stage short of
    memory for the copies (`short_stage`) runs the flush without them: they are freed, and the next turns fed whole."""
    monkeypatch.setattr(engine_module, "COPY_BACKOFF_S", 0.0)  # the next turns' rows are copied out again
    vocab = load_manifest(target).spec.vocab_size
    prompts = [_tokens(40 + index, 30, vocab) for index in range(3)]
    first = [StreamRequest(prompt, max_new_tokens=6, ignore_eos=True) for prompt in prompts]
    replies = [_fresh(target, request, 1) for request in first]
    later = [StreamRequest(prompt + reply + [5, 6], max_new_tokens=4, ignore_eos=True, arrival_step=6)
             for prompt, reply in zip(prompts, replies, strict=True)]
    guard = CopyRefusingGuard()
    with LocalPipeline(target, stages, F32) as pipeline:
        if short_stage is not None:
            executor = pipeline._executors[short_stage]
            executor.memory_guard, executor.kv_bytes_per_slot = guard, 1  # type: ignore[assignment]
        chain, _, ids, results = _run_cached(pipeline, first + later)
    assert pipeline.micro_batches == (0,) * stages
    flush = [message for message in chain.messages if len(message.copy_into) == 3]
    # the next turns, fed whole where the copies were dropped, end together in turn and are flushed likewise
    assert len(flush) == (1 if short_stage is None else 2)
    assert len(guard.refused) == (0 if short_stage is None else 2)  # each flush's copies: none made everywhere
    assert len(flush[0].stream_ids) == 1 and flush[0].position_ids.shape == (1, 1)
    assert flush[0].micro_batch_id in chain.released
    if short_stage is not None:
        # freed as the flush's result came, before the next turns' first steps (not at the run's end)
        released_by = chain.events.index(("release", flush[0].copy_into[-1]))
        assert released_by < next(at for at, (kind, batch) in enumerate(chain.events)
                                  if kind == "submit" and batch not in (flush[0].micro_batch_id,)
                                  and at > chain.events.index(("submit", flush[0].micro_batch_id)))
    for stream_id, prompt, reply in zip(ids[3:], prompts, replies, strict=True):
        reused = len(prompt) + len(reply) - 1 if short_stage is None else 0
        assert results[stream_id].reused_tokens == reused
    for stream_id, request in zip(ids, first + later, strict=True):
        assert results[stream_id].tokens == _fresh(target, request, stages)


def test_an_idle_server_frees_its_entries_as_they_pass_their_age(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries are given up when a request looks, and an idle server's engine, waiting for one, gives them up on
    time: their KV state does not stay on the stages for as long as nobody asks."""
    monkeypatch.setattr(engine_module, "PREFIX_CACHE_MAX_AGE_S", 2.0)  # long enough to see it held first
    vocab = load_manifest(target).spec.vocab_size
    opened: list[LocalPipeline] = []

    @contextmanager
    def open_chain() -> Iterator[OpenedChain]:
        with LocalPipeline(target, 1, F32) as pipeline:
            opened.append(pipeline)
            yield OpenedChain(pipeline)

    service = EngineService(open_chain, load_manifest(target).spec, None,
                            lambda chain: EngineOptions(prefix_cache_tokens=CACHE))
    with service:
        sink = Sink()
        service.submit(StreamRequest(_tokens(30, 20, vocab), max_new_tokens=4, ignore_eos=True), sink)
        assert sink.ended.wait(60)
        held = opened[0].micro_batches  # the stream ended its micro-batch: kept (one stage, run inline)
        deadline = time.monotonic() + 30
        while opened[0].micro_batches != (0,) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held == (1,) and opened[0].micro_batches == (0,)


def _turn_beside_a_long_runner(target: Path) -> tuple[StreamRequest, StreamRequest, list[int], StreamRequest]:
    """A long stream, a turn that arrives while it runs and ends beside it, the turn's reply, and its next turn (the
    prompt, the reply and more), arriving once the turn ended."""
    vocab = load_manifest(target).spec.vocab_size
    long_runner = StreamRequest(_tokens(1, 12, vocab), max_new_tokens=50, ignore_eos=True)
    turn = StreamRequest(_tokens(2, 30, vocab), max_new_tokens=8, ignore_eos=True, arrival_step=2)
    reply = _fresh(target, turn, 1)
    follow_up = StreamRequest(turn.prompt_ids + reply + _tokens(3, 6, vocab), max_new_tokens=8, ignore_eos=True,
                              arrival_step=24)
    return long_runner, turn, reply, follow_up


@pytest.mark.parametrize("stages", [1, 2])
def test_a_stream_that_ends_beside_others_leaves_its_prompt_and_reply_for_the_next_turn(
        target: Path, stages: int) -> None:
    """Its row is copied out of the running micro-batch (CopyRow) by that micro-batch's next step: the next turn,
    which repeats the prompt and the reply, is fed only what follows them, and is admitted into the batch in turn."""
    long_runner, turn, reply, follow_up = _turn_beside_a_long_runner(target)
    with LocalPipeline(target, stages, F32) as pipeline:
        chain, _, ids, results = _run_cached(pipeline, (long_runner, turn, follow_up))
    assert pipeline.micro_batches == (0,) * stages
    copies = [message for message in chain.messages if message.copy_into]
    assert len(copies) == 2  # the turn's row, then the follow-up's, each copied out as it ended beside the other
    assert copies[0].stream_ids == (ids[0],)  # the step after the turn ended: its row copied, then dropped
    kinds = [type(delta).__name__ for delta in copies[0].slot_deltas]
    assert kinds.index("CopyRow") < kinds.index("ReorderRows") and kinds[-1] == "AppendSlots"
    assert results[ids[2]].reused_tokens == len(turn.prompt_ids) + len(reply) - 1
    resumed = [message for message in chain.messages if message.stream_ids == (ids[2],)]
    assert resumed[0].micro_batch_id == copies[0].copy_into[0]
    assert results[ids[1]].tokens == reply
    for stream_id, request in zip(ids, (long_runner, turn, follow_up), strict=True):
        assert results[stream_id].tokens == _fresh(target, request, stages)


class CopyRefusingGuard:
    """A KV memory guard with room for every step but not for its row copies."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def admit(self, growth_bytes: int, what: Callable[[], str]) -> None:
        if "copied" in what():
            self.refused.append(what())
            raise KvMemoryRefused(f"{what()} would grow this PC's KV cache past its floor")


@pytest.mark.parametrize(("short_stage", "backoff_s"), [(0, 0.0), (1, 0.0), (1, 600.0)])
def test_a_stage_short_of_memory_for_a_rows_copy_runs_the_step_without_it_and_the_next_turn_feeds_its_prompt(
        target: Path, monkeypatch: pytest.MonkeyPatch, short_stage: int, backoff_s: float) -> None:
    """The copy is the prefix cache's option: the stage refused the whole step (OUT_OF_MEMORY: the PC left out of the
    chain by a re-plan). Now the step runs without it on that stage and the ones after it; the stages before it,
    which made it, free it; the next turn is fed what no entry holds, with the tokens of a fresh run. For
    COPY_BACKOFF_S after, no row is copied out (the stages before would copy for nothing)."""
    monkeypatch.setattr(engine_module, "COPY_BACKOFF_S", backoff_s)
    long_runner, turn, _, follow_up = _turn_beside_a_long_runner(target)
    guard = CopyRefusingGuard()
    with LocalPipeline(target, 2, F32) as pipeline:
        executor = pipeline._executors[short_stage]
        executor.memory_guard, executor.kv_bytes_per_slot = guard, 1  # type: ignore[assignment]
        chain, engine, ids, results = _run_cached(pipeline, (long_runner, turn, follow_up))
        copied = [message.copy_into[0] for message in chain.messages if message.copy_into]
    # the turn's row, then (once the backoff passed) the follow-up's: neither made everywhere
    assert len(guard.refused) == len(copied) == (2 if backoff_s == 0 else 1)
    assert all(copy in chain.released for copy in copied)  # freed where they were made
    assert pipeline.micro_batches == (0, 0) and engine.failovers == []
    # the turn's prompt, kept as it was admitted (no copy), not its reply: the follow-up feeds the rest
    assert results[ids[2]].reused_tokens == len(turn.prompt_ids)
    for stream_id, request in zip(ids, (long_runner, turn, follow_up), strict=True):
        assert results[stream_id].tokens == _fresh(target, request, 2)


def test_a_cancel_that_empties_a_micro_batch_before_its_copy_stepped_drops_the_copy_and_the_next_turn_runs(
        target: Path) -> None:
    """A ends beside B, so A's row waits for the micro-batch's next step to be copied out; B's client goes away before
    that step: the micro-batch goes (not kept whole with a copy no step will make), and A's next turn, which would
    have waited for that copy, runs, its prompt fed whole."""
    vocab = load_manifest(target).spec.vocab_size
    first = StreamRequest(_tokens(50, 20, vocab), max_new_tokens=4, ignore_eos=True)
    reply = _fresh(target, first, 1)
    follow_up = StreamRequest(first.prompt_ids + reply + [5, 6], max_new_tokens=3, ignore_eos=True)
    with LocalPipeline(target, 1, F32) as pipeline:
        engine = Engine(pipeline, load_manifest(target).spec, None,
                        EngineOptions(micro_batches=1, prefix_cache_tokens=CACHE))
        a = engine.add(first)
        b = engine.add(StreamRequest(_tokens(51, 20, vocab), max_new_tokens=40, ignore_eos=True))
        later: list[int] = []

        def feed(idle: bool) -> bool:
            if not later and engine.is_done(a):
                assert engine._cache_pending  # A's copy waits for the micro-batch's next step
                engine.cancel(b)
                later.append(engine.add(follow_up))
            return not (idle and later and engine.is_done(later[0]))

        results = engine.run(feed=feed)
    assert pipeline.micro_batches == (0,)
    assert results[later[0]].reused_tokens == 0 and results[later[0]].tokens == _fresh(target, follow_up, 1)
