"""Review: a resumed stream's draft-model prefill is not chunked while other streams run.

Engine._feed_draft gives the draft model, at the resumed prefill's first call, the whole prefix the kept KV state
holds plus the first chunk (`stream.confirmed[:stream.reused] + tokens`) in ONE call, in the driver's thread. The
module's rule (and test_engine_chunked_prefill: "no call, the target's or the draft model's, carries more than a
chunk of a prompt that arrived while streams ran") is that a draft model prefills chunk for chunk, because a whole
prompt there stalls the running streams; a resumed chat-length prefix is exactly such a whole prompt.
"""

from __future__ import annotations

from pathlib import Path

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.draft import DraftModel
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from tests.controller.test_engine_chunked_prefill import record_draft_widths
from tests.controller.test_engine_kept_kv import _tokens

F32 = CompileSettings(precision=Precision.F32)


def test_a_resumed_prompt_goes_to_the_draft_model_chunk_for_chunk_while_streams_run(
        target: Path, other_draft: Path) -> None:
    spec = load_manifest(target).spec
    vocab = spec.vocab_size
    first = _tokens(21, 90, vocab)
    draft = DraftModel(other_draft, F32)
    with LocalPipeline(target, 1, F32) as pipeline:
        engine = Engine(pipeline, spec, draft, EngineOptions())
        engine.add(StreamRequest(first, max_new_tokens=4, ignore_eos=True, keep_kv=True))
        reply = engine.run()[0].tokens
        kept = engine.kept_kv(0)
        assert kept is not None

        widths = record_draft_widths(draft)
        engine = Engine(pipeline, spec, draft, EngineOptions(max_rows=3, prefill_chunk=16))
        engine.add(StreamRequest(_tokens(22, 6, vocab), max_new_tokens=30, ignore_eos=True))  # runs throughout
        follow = first + reply + _tokens(23, 40, vocab)  # arrives while stream 0 runs: 93 tokens kept, 41 fed
        engine.add(StreamRequest(follow, max_new_tokens=6, ignore_eos=True, keep_kv=True, resume=kept,
                                 arrival_step=3))
        results = engine.run()
        assert results[1].reused_tokens == len(first) + len(reply) - 1
        resumed = engine.kept_kv(1)
        assert resumed is not None
        resumed.release()
    # the drafter caught up a chunk a step: the tokens are those of the prompt fed whole, drafted or not
    with LocalPipeline(target, 1, F32) as pipeline:
        fresh = Engine(pipeline, spec, None, EngineOptions())
        fresh.add(StreamRequest(follow, max_new_tokens=6, ignore_eos=True))
        assert results[1].tokens == fresh.run()[0].tokens
    # the target was fed the resumed tail in chunks of 16; the draft model must be too
    assert max(widths) <= 16, f"a draft-model call of {max(widths)} tokens while a stream ran"
