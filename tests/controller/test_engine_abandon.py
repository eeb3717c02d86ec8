"""A run that stops early frees everything it opened, the prefill it was merging included, and a callback
that fails on a stream's last token leaves that stream's result consistent."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward
from deskfleet.controller.draft import DraftModel
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline, PipelineError

F32 = CompileSettings(precision=Precision.F32)
FIRST, SECOND = [1, 17, 99, 230, 5, 42, 7, 300, 11], [1, 8, 8, 3]


def _two_streams_merged(engine: Engine) -> None:
    """The second stream arrives while the first runs: it is prefilled alone, then merged into the first's
    micro-batch by a step that carries admit_from."""
    engine.add(StreamRequest(FIRST, max_new_tokens=10, ignore_eos=True))
    engine.add(StreamRequest(SECOND, max_new_tokens=10, ignore_eos=True, arrival_step=2))


@pytest.mark.parametrize(("stages", "stopped_by"), [(1, KeyboardInterrupt), (2, PipelineError)])
def test_a_refused_admission_step_frees_the_prefill_it_was_merging(target: Path, stages: int,
                                                                   stopped_by: type[BaseException]) -> None:
    manifest = load_manifest(target)
    with LocalPipeline(target, stages, F32, manifest) as pipeline:
        last = pipeline._executors[-1]
        run = last.run

        def refusing(message: Forward, return_logits: bool = False) -> object:
            if message.admit_from:
                if message.hidden_states is not None:  # a later stage: stage 0 already took the source
                    message = dataclasses.replace(message, hidden_states=np.full_like(message.hidden_states, np.nan))
                else:  # a lone stage: Ctrl-C lands before it runs the step
                    raise KeyboardInterrupt
            return run(message, return_logits)

        last.run = refusing  # type: ignore[method-assign]
        if pipeline._inline is not None:
            pipeline._inline = last
        engine = Engine(pipeline, manifest.spec, None, EngineOptions(max_rows=4, micro_batches=1))
        _two_streams_merged(engine)
        with pytest.raises(stopped_by):
            engine.run()
    assert pipeline.micro_batches == (0,) * stages  # after the releases it queued: the merged prefill's too


def test_the_draft_model_frees_a_prefill_whose_admission_step_was_interrupted(target: Path,
                                                                             other_draft: Path) -> None:
    manifest = load_manifest(target)
    drafter = DraftModel(other_draft, F32)
    run = drafter._executor.run

    def interrupted(message: Forward, return_logits: bool = False) -> object:
        if message.admit_from:
            raise KeyboardInterrupt  # Ctrl-C while the draft model takes the step that merges the prefill
        return run(message, return_logits)

    drafter._executor.run = interrupted  # type: ignore[method-assign]
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, drafter, EngineOptions(max_rows=4, micro_batches=1, fixed_k=2))
        _two_streams_merged(engine)
        with pytest.raises(KeyboardInterrupt):
            engine.run()
        assert pipeline.micro_batches == (0,)
    assert drafter._executor.micro_batches == 0 and not drafter._tracks  # the drafter outlives the run


def test_a_callback_failing_on_the_last_token_leaves_the_stream_finished(target: Path) -> None:
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        alone = Engine(pipeline, manifest.spec)
        alone.add(StreamRequest(FIRST, max_new_tokens=4, ignore_eos=True))
        eos = alone.run()[0].tokens[2]
        engine = Engine(pipeline, dataclasses.replace(manifest.spec, eos_token_ids=(eos,)))
        engine.add(StreamRequest(FIRST, max_new_tokens=10))

        def closed_stdout(stream_id: int, token: int) -> None:
            if token == eos:
                raise BrokenPipeError("stdout closed")

        with pytest.raises(BrokenPipeError):
            engine.run(closed_stdout)
        result = engine.results()[0]
    assert result.tokens[-1] == eos and result.stopped_by_eos and result.last_token_s >= result.first_token_s > 0


def test_a_stream_stopped_early_is_timed_to_its_latest_token_and_one_token_has_no_rate(target: Path) -> None:
    # `generate --json` said "tok_s": 0.0 for a stream a Ctrl-C stopped (it was timed to a finish it never had),
    # and for a 1-token run, whose only token comes from the prefill (nothing decoded to time)
    manifest = load_manifest(target)
    with LocalPipeline(target, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec)
        engine.add(StreamRequest(FIRST, max_new_tokens=50, ignore_eos=True))
        seen: list[int] = []

        def ctrl_c_at_the_sixth(stream_id: int, token: int) -> None:
            seen.append(token)
            if len(seen) == 6:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            engine.run(ctrl_c_at_the_sixth)
        stopped = engine.results()[0]
        single = Engine(pipeline, manifest.spec)
        single.add(StreamRequest(FIRST, max_new_tokens=1, ignore_eos=True))
        (one,) = single.run().values()
    assert len(stopped.tokens) >= 6 and stopped.last_token_s > stopped.first_token_s
    assert stopped.decode_tok_s == pytest.approx((len(stopped.tokens) - 1)
                                                 / (stopped.last_token_s - stopped.first_token_s))
    assert len(one.tokens) == 1 and one.decode_tok_s is None
