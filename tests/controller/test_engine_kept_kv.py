"""A stream that keeps its KV state (`keep_kv`) leaves its micro-batch on the chain when it ends, and a later request
that resumes it is fed only what follows the prefix the two share: tokens equal a fresh run of the whole prompt (f32:
greedy, sampled, drafted by prompt lookup and by a draft model, 1 and 2 stages, a prompt that parts from the kept
tokens inside them, drafts accepted past a stream's end); a kept stream runs in a micro-batch of its own; a run stopped
early releases the kept state, a failover resumes from the whole prompt; a kept state serves one request, on its own
chain."""

from __future__ import annotations

import random
from contextlib import ExitStack
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import SamplingParams
from deskfleet.common.wire import Forward
from deskfleet.controller.draft import Drafter, DraftModel, DraftRow, Proposal
from deskfleet.controller.engine import RESUME_MIN_SHARED, Engine, EngineOptions, KeptKV, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft
from tests.controller.test_engine_chunked_prefill import RecordingChain

F32 = CompileSettings(precision=Precision.F32)
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)


class ReleaseRecordingChain(RecordingChain):
    """RecordingChain that also records the micro-batches released and each step's delta types."""

    def __init__(self, pipeline: LocalPipeline, break_at: int | None = None) -> None:
        super().__init__(pipeline, break_at)
        self.released: list[int] = []
        self.deltas: list[list[str]] = []

    def submit(self, message: Forward) -> None:
        super().submit(message)
        self.deltas.append([type(delta).__name__ for delta in message.slot_deltas])

    def release(self, batch_id: int) -> None:
        self.released.append(batch_id)
        super().release(batch_id)


class OracleDraft(PromptLookupDraft):
    """Proposes the tokens a plain run gave (`expected`, after the prompt of the same length): every draft is
    accepted, so a round can run past a stream's stop token."""

    def __init__(self, prompt: list[int], expected: list[int]) -> None:
        super().__init__(min_ngram=1)
        self.prompt_len, self.expected = len(prompt), expected

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        tokens = {}
        for row in rows:
            done = len(row.confirmed) - self.prompt_len
            tokens[row.stream_id] = self.expected[done:done + row.k]
        return Proposal(tokens=tokens, probs={}, one_hot=True, seconds=0.0)


def _tokens(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    motif = [rng.randrange(1, vocab) for _ in range(5)]  # repeats, so that prompt lookup finds matches
    return [motif[i % 5] if rng.random() < 0.5 else rng.randrange(1, vocab) for i in range(length)]


def _fresh(model: Path, request: StreamRequest, stages: int, drafter: Drafter | None = None) -> list[int]:
    return _fresh_run(model, request, stages, drafter)[0]


def _fresh_run(model: Path, request: StreamRequest, stages: int, drafter: Drafter | None = None
               ) -> tuple[list[int], dict[int, int]]:
    """A run of the whole prompt on a new pipeline: its tokens and accepted-draft histogram."""
    manifest = load_manifest(model)
    with LocalPipeline(model, stages, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, drafter, EngineOptions())
        engine.add(request)
        return engine.run()[0].tokens, engine.accepted_histogram()


def _turn(chain: RecordingChain, model: Path, request: StreamRequest, drafter: Drafter | None = None
          ) -> tuple[list[int], KeptKV | None, Engine]:
    engine = Engine(chain, load_manifest(model).spec, drafter, EngineOptions())
    engine.add(request)
    tokens = engine.run()[0].tokens
    return tokens, engine.kept_kv(0), engine


def _fed(chain: RecordingChain, since: int) -> int:
    """Tokens (a row's widest) the first step after the chain's `since`-th carried: a resumed turn's prefill."""
    return chain.steps[since][1]


@pytest.mark.parametrize(("stages", "drafting", "sampling"), [
    (1, None, GREEDY), (2, None, GREEDY), (1, None, SAMPLED), (2, "lookup", GREEDY), (1, "model", GREEDY),
    (1, "model", SAMPLED)])
def test_a_resumed_turn_is_fed_only_its_new_tokens_and_gives_a_fresh_runs_tokens(
        target: Path, other_draft: Path, stages: int, drafting: str | None, sampling: SamplingParams) -> None:
    spec = load_manifest(target).spec
    vocab = spec.vocab_size

    def drafter() -> Drafter | None:
        if drafting == "lookup":
            return PromptLookupDraft(min_ngram=1)
        return DraftModel(other_draft, F32) if drafting == "model" else None

    first = _tokens(1, 40, vocab)
    with ExitStack() as stack:
        chain = ReleaseRecordingChain(stack.enter_context(LocalPipeline(target, stages, F32)))
        draft = drafter()
        request = StreamRequest(first, max_new_tokens=10, ignore_eos=True, keep_kv=True, sampling=sampling, seed=3)
        reply, kept, _ = _turn(chain, target, request, draft)
        assert kept is not None and kept.tokens == tuple(first + reply[:-1])
        assert chain.released == []  # the kept micro-batch stays on the stages
        if isinstance(draft, DraftModel):  # the drafter's state is not kept: it is prefilled again on resume
            assert not draft._tracks and not draft._seen and draft._executor.micro_batches == 0
        kept_id = kept.micro_batch_id

        # the next turn repeats the conversation and adds a message: fed its last reply token and the message only
        second = first + reply + _tokens(2, 7, vocab)
        steps = len(chain.steps)
        request = StreamRequest(second, max_new_tokens=12, ignore_eos=True, keep_kv=True, resume=kept,
                                sampling=sampling, seed=4)
        reply2, kept2, engine = _turn(chain, target, request, draft)
        assert _fed(chain, steps) == 1 + 7
        assert {batch for batch, _, _ in chain.steps[steps:]} == {kept_id}  # the kept micro-batch, resumed
        # the same tokens, and the same drafts accepted: the drafter saw the whole prompt as in a fresh run
        assert (reply2, engine.accepted_histogram()) == _fresh_run(
            target, StreamRequest(second, max_new_tokens=12, ignore_eos=True, sampling=sampling, seed=4), stages,
            drafter())

        # a prompt that parts from the kept tokens inside them: rolled back by mask to the shared prefix
        assert kept2 is not None
        third = second[:25] + _tokens(3, 9, vocab)
        steps = len(chain.steps)
        request = StreamRequest(third, max_new_tokens=12, ignore_eos=True, keep_kv=True, resume=kept2,
                                sampling=sampling, seed=5)
        reply3, kept3, _ = _turn(chain, target, request, draft)
        assert _fed(chain, steps) == len(third) - 25
        assert reply3 == _fresh(target, StreamRequest(third, max_new_tokens=12, ignore_eos=True, sampling=sampling,
                                                      seed=5), stages, drafter())
        assert kept3 is not None
        kept3.release()
        assert chain.released == [kept_id]  # every turn on the one micro-batch, released once at the end


def test_drafts_accepted_past_a_streams_end_are_not_kept(target: Path) -> None:
    spec = load_manifest(target).spec
    vocab = spec.vocab_size
    for seed in range(4, 40):  # a prompt whose first 9 tokens hold no EOS, and a 4th token seen not before it
        prompt = _tokens(seed, 30, vocab)
        expected = _fresh(target, StreamRequest(prompt, max_new_tokens=9, ignore_eos=True), 1)
        if not set(expected) & set(spec.eos_token_ids) and expected[3] not in expected[:3]:
            break
    stop = expected[3]  # ends the stream as EOS would, inside the first round's accepted drafts
    with LocalPipeline(target, 1, F32) as pipeline:
        chain = RecordingChain(pipeline)
        engine = Engine(chain, load_manifest(target).spec, OracleDraft(prompt, expected), EngineOptions(fixed_k=8))
        engine.add(StreamRequest(prompt, max_new_tokens=30, stop_token_ids=frozenset({stop}), keep_kv=True))
        reply = engine.run()[0].tokens
        # the round after the first token fed 9 and had all 8 drafts accepted; the stream took 3 of them
        assert reply == expected[:4] and engine.accepted_histogram() == {8: 1}
        kept = engine.kept_kv(0)
        assert kept is not None and kept.tokens == tuple(prompt + reply[:-1])
        # resumed with a prompt that continues differently from what the dropped drafts said
        follow = prompt + reply + _tokens(5, 4, vocab)
        resumed, _, _ = _turn(chain, target, StreamRequest(follow, max_new_tokens=8, ignore_eos=True, resume=kept))
    assert resumed == _fresh(target, StreamRequest(follow, max_new_tokens=8, ignore_eos=True), 1)


def test_a_kept_stream_runs_alone_and_the_others_batch(target: Path) -> None:
    vocab = load_manifest(target).spec.vocab_size
    requests = [StreamRequest(_tokens(10 + index, 12, vocab), max_new_tokens=6, ignore_eos=True,
                              keep_kv=index == 1, arrival_step=0 if index < 3 else 2) for index in range(5)]
    with LocalPipeline(target, 1, F32) as pipeline:
        chain = RecordingChain(pipeline)
        engine = Engine(chain, load_manifest(target).spec, None, EngineOptions(max_rows=4, micro_batches=1))
        for request in requests:
            engine.add(request)
        results = engine.run()
        kept = engine.kept_kv(1)
        assert kept is not None and engine.kept_kv(0) is None  # only the stream that asked keeps its state
    assert all(streams == (1,) for _, _, streams in chain.steps if 1 in streams)
    assert any(len(streams) > 1 for _, _, streams in chain.steps)  # the others still batch
    for index, request in enumerate(requests):
        assert results[index].tokens == _fresh(target, StreamRequest(request.prompt_ids, 6, ignore_eos=True), 1)


def test_a_stopped_run_releases_kept_states_and_the_next_turn_starts_fresh(target: Path) -> None:
    spec = load_manifest(target).spec
    prompt = _tokens(6, 20, spec.vocab_size)
    with LocalPipeline(target, 1, F32) as pipeline:
        chain = ReleaseRecordingChain(pipeline)
        _, kept, _ = _turn(chain, target, StreamRequest(prompt, max_new_tokens=4, ignore_eos=True, keep_kv=True))
        assert kept is not None
        kept_id = kept.micro_batch_id
        engine = Engine(chain, spec, None, EngineOptions())
        follow = [*kept.tokens, 9, 10, 11]
        # stream 0 resumes the kept state and is stopped mid-reply; stream 1 ends, keeping its own, before the stop
        engine.add(StreamRequest(follow, max_new_tokens=20, ignore_eos=True, keep_kv=True, resume=kept))
        engine.add(StreamRequest(prompt, max_new_tokens=1, ignore_eos=True, keep_kv=True))

        def stop(stream_id: int, token: int) -> None:
            if stream_id == 0 and len(engine.results()[0].tokens) == 3:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            engine.run(on_token=stop)
        assert engine.kept_kv(0) is None and engine.kept_kv(1) is None
        assert kept_id in chain.released and len(set(chain.released)) == 2
        with pytest.raises(ValueError, match="resumed or released already"):
            kept.take()
        chain.renumber()
        fresh, _, _ = _turn(chain, target, StreamRequest(follow, max_new_tokens=5, ignore_eos=True))
    assert fresh == _fresh(target, StreamRequest(follow, max_new_tokens=5, ignore_eos=True), 1)


def test_a_failover_in_a_resumed_turn_feeds_the_whole_prompt_on_the_new_chain(target: Path) -> None:
    spec = load_manifest(target).spec
    prompt = _tokens(7, 24, spec.vocab_size)
    with ExitStack() as stack:
        chain = ReleaseRecordingChain(stack.enter_context(LocalPipeline(target, 2, F32)), break_at=None)
        reply, kept, _ = _turn(chain, target, StreamRequest(prompt, max_new_tokens=6, ignore_eos=True, keep_kv=True))
        assert kept is not None
        follow = prompt + reply + [3, 4, 5]
        chain.break_at = chain.collected + 3  # breaks in the middle of the resumed reply
        replacement = ReleaseRecordingChain(stack.enter_context(LocalPipeline(target, 1, F32)))
        engine = Engine(chain, spec, None, EngineOptions())
        engine.add(StreamRequest(follow, max_new_tokens=10, ignore_eos=True, keep_kv=True, resume=kept))
        tokens = engine.run(recover=lambda error: replacement)[0].tokens
        assert len(engine.failovers) == 1
        assert replacement.steps[0][1] == len(follow) + 3  # the whole prompt and the 3 tokens before the break
        kept2 = engine.kept_kv(0)
        assert kept2 is not None and kept2.chain is replacement  # kept on the chain the turn ended on
    assert tokens == _fresh(target, StreamRequest(follow, max_new_tokens=10, ignore_eos=True), 1)


def test_a_kept_state_serves_one_request_on_its_own_chain_and_is_taken_when_the_run_starts(target: Path) -> None:
    spec = load_manifest(target).spec
    prompt = _tokens(8, 10, spec.vocab_size)
    with LocalPipeline(target, 1, F32) as first, LocalPipeline(target, 1, F32) as second:
        chain = ReleaseRecordingChain(first)
        _, kept, _ = _turn(chain, target, StreamRequest(prompt, 3, ignore_eos=True, keep_kv=True))
        assert kept is not None
        kept_id = kept.micro_batch_id
        with pytest.raises(ValueError, match="another chain"):
            Engine(second, spec).add(StreamRequest(prompt, 3, resume=kept))
        engine = Engine(chain, spec)
        engine.add(StreamRequest(prompt, 3, resume=kept, keep_kv=True))
        with pytest.raises(ValueError, match="given to another of this engine's"):
            engine.add(StreamRequest(prompt, 3, resume=kept))
        assert kept.micro_batch_id == kept_id  # an engine that has not run yet has not taken it: still the caller's
        engine.run()
        with pytest.raises(ValueError, match="resumed or released already"):
            Engine(chain, spec).add(StreamRequest(prompt, 3, resume=kept))
        kept.release()  # taken: nothing to release
        assert chain.released == []
        resumed = engine.kept_kv(0)
        assert resumed is not None and resumed.micro_batch_id == kept_id
        resumed.release()
        assert chain.released == [kept_id]


def test_the_shared_prefix_leaves_the_prompts_last_token_to_feed(target: Path) -> None:
    spec = load_manifest(target).spec
    prompt = _tokens(9, 16, spec.vocab_size)
    with LocalPipeline(target, 1, F32) as pipeline:
        chain = RecordingChain(pipeline)
        _, kept, _ = _turn(chain, target, StreamRequest(prompt, 4, ignore_eos=True, keep_kv=True))
        assert kept is not None
        same = list(kept.tokens)  # exactly what the KV state holds: its last token is fed again for the logits
        assert kept.shared_prefix(same) == len(same) - 1 and kept.shared_prefix([same[0] + 1]) == 0
        steps = len(chain.steps)
        tokens, _, _ = _turn(chain, target, StreamRequest(same, 5, ignore_eos=True, resume=kept))
        assert _fed(chain, steps) == 1
    assert tokens == _fresh(target, StreamRequest(same, 5, ignore_eos=True), 1)


def test_a_prompt_that_shares_too_little_of_a_kept_state_is_fed_whole(target: Path) -> None:
    spec = load_manifest(target).spec
    prompt = _tokens(11, 120, spec.vocab_size)
    with LocalPipeline(target, 1, F32) as pipeline:
        chain = ReleaseRecordingChain(pipeline)
        _, kept, _ = _turn(chain, target, StreamRequest(prompt, 4, ignore_eos=True, keep_kv=True))
        assert kept is not None
        kept_id = kept.micro_batch_id
        # shares 70 of 80 tokens: resumed, fed the 10 after them
        near = prompt[:70] + _tokens(12, 10, spec.vocab_size)
        steps = len(chain.steps)
        engine = Engine(chain, spec, None, EngineOptions())
        engine.add(StreamRequest(near, 5, ignore_eos=True, keep_kv=True, resume=kept))
        resumed = engine.run()[0]
        assert resumed.reused_tokens == 70 and chain.steps[steps][:2] == (kept_id, 10)
        assert resumed.tokens == _fresh(target, StreamRequest(near, 5, ignore_eos=True), 1)
        kept = engine.kept_kv(0)
        assert kept is not None
        # shares 10 of 40: less than RESUME_MIN_SHARED, so the state is released and the prompt fed whole
        far = prompt[:10] + _tokens(13, 30, spec.vocab_size)
        assert 10 < RESUME_MIN_SHARED * len(far)
        steps = len(chain.steps)
        engine = Engine(chain, spec, None, EngineOptions())
        engine.add(StreamRequest(far, 5, ignore_eos=True, resume=kept))
        fresh = engine.run()[0]
        fresh_id = kept_id + 1  # new micro-batches take ids after the kept one
        assert chain.released == [kept_id, fresh_id]  # the kept state as the run began, then the run's own
        assert fresh.reused_tokens == 0 and chain.steps[steps][:2] == (fresh_id, len(far))
    assert fresh.tokens == _fresh(target, StreamRequest(far, 5, ignore_eos=True), 1)


def test_a_rollback_that_leaves_many_dead_slots_is_compacted_before_the_prefill(target: Path) -> None:
    spec = load_manifest(target).spec
    prompt = _tokens(14, 150, spec.vocab_size)
    with LocalPipeline(target, 1, F32) as pipeline:
        chain = ReleaseRecordingChain(pipeline)
        _, kept, _ = _turn(chain, target, StreamRequest(prompt, 3, ignore_eos=True, keep_kv=True))
        assert kept is not None
        # keeps 80 of 152 slots: 72 dead, past the default policy (64 and a quarter), so the first step compacts
        resumed = prompt[:80] + _tokens(15, 20, spec.vocab_size)
        steps = len(chain.steps)
        tokens, _, _ = _turn(chain, target, StreamRequest(resumed, 4, ignore_eos=True, resume=kept))
        assert chain.deltas[steps][:2] == ["InvalidateSlots", "Compact"]
    assert tokens == _fresh(target, StreamRequest(resumed, 4, ignore_eos=True), 1)
