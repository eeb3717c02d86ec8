"""The local pipeline: one stage runs inline, several on worker threads; both report a stage's failure
as a PipelineError that names the stage and the micro-batch, and stay usable for other micro-batches."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward
from deskfleet.controller.batch_track import BatchTrack
from deskfleet.controller.pipeline import LocalPipeline, PipelineError

F32 = CompileSettings(precision=Precision.F32)


def _prefill(batch_id: int, prompt: list[int], max_positions: int) -> Forward:
    track = BatchTrack(batch_id, max_positions)
    track.add_row(stream_id=batch_id)
    return track.step([prompt])


@pytest.mark.parametrize("stages", [1, 2])
def test_a_failing_stage_is_named_and_other_micro_batches_go_on(tiny_export: Path, stages: int) -> None:
    manifest = load_manifest(tiny_export)
    context = manifest.spec.max_context
    with LocalPipeline(tiny_export, stages, F32, manifest) as pipeline:
        good = _prefill(1, [1, 5, 9], context)
        pipeline.submit(good)
        expected = pipeline.collect(timeout=60).next_token_ids

        # position_ids that disagree with the deltas: the stage's mirror refuses the step
        bad = _prefill(2, [1, 5, 9], context)
        bad = replace(bad, position_ids=bad.position_ids + 1)
        pipeline.submit(bad)
        with pytest.raises(PipelineError, match=r"stage 0 .* micro-batch 2: .*desync"):
            pipeline.collect(timeout=60)

        # so does a beam_idx the mirror did not compose
        worse = _prefill(4, [1, 5, 9], context)
        pipeline.submit(replace(worse, beam_idx=worse.beam_idx + 1))
        with pytest.raises(PipelineError, match=r"micro-batch 4: .*beam_idx or position_ids disagree"):
            pipeline.collect(timeout=60)

        pipeline.release(1)
        pipeline.submit(_prefill(3, [1, 5, 9], context))
        assert pipeline.collect(timeout=60).next_token_ids == expected


@pytest.mark.parametrize("stages", [1, 2])
def test_collect_after_close_says_the_pipeline_stopped(tiny_export: Path, stages: int) -> None:
    pipeline = LocalPipeline(tiny_export, stages, F32)
    pipeline.close()
    with pytest.raises(PipelineError, match="closed"):
        pipeline.submit(_prefill(1, [1, 2], 64))
    with pytest.raises(PipelineError, match="stopped"):
        pipeline.collect(timeout=60)


def test_one_stage_runs_in_the_callers_thread(tiny_export: Path) -> None:
    before = threading.active_count()
    with LocalPipeline(tiny_export, 1, F32) as pipeline:
        assert threading.active_count() == before
        pipeline.submit(_prefill(1, [1, 5], 64))
        assert pipeline.collect(timeout=0).next_token_ids  # already there: no thread to wait for
        with pytest.raises(PipelineError, match="no step in flight"):  # nothing would ever arrive
            pipeline.collect(timeout=60)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_micro_batch_released_with_a_step_in_flight_drops_its_result(tiny_export: Path, stages: int) -> None:
    # What a run stopped by Ctrl-C leaves: its steps finish on the stages, then the releases free their
    # micro-batches; after renumber, the next engine's micro-batch 1 step 0 gets its own result, not the
    # stale one of the old micro-batch 1 step 0, and the old steps' failures are dropped too.
    manifest = load_manifest(tiny_export)
    context = manifest.spec.max_context
    with LocalPipeline(tiny_export, stages, F32, manifest) as pipeline:
        expected = pipeline.step(_prefill(5, [1, 7], context)).next_token_ids
        pipeline.release(5)
        stale = pipeline.step(_prefill(6, [1, 5, 9], context)).next_token_ids
        pipeline.release(6)
        assert stale != expected
        pipeline.submit(_prefill(1, [1, 5, 9], context))
        failing = _prefill(2, [1, 5, 9], context)
        pipeline.submit(replace(failing, position_ids=failing.position_ids + 1))  # refused by stage 0
        pipeline.release(1)
        pipeline.release(2)
        pipeline.renumber()
        pipeline.submit(_prefill(1, [1, 7], context))
        result = pipeline.collect(timeout=60)
        assert (result.micro_batch_id, result.step_id, result.next_token_ids) == (1, 0, expected)
        pipeline.release(1)
    assert pipeline.micro_batches == (0,) * stages


def test_a_ctrl_c_during_close_still_stops_every_stage_worker(tiny_export: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # a second Ctrl-C while close() joined the workers (`timeout -s INT` sends two) left the rest running, their
    # compiled stages alive at the interpreter's exit: "terminate called without an active exception", exit 134
    pipeline = LocalPipeline(tiny_export, 3, F32)
    workers = list(pipeline._workers)
    join = threading.Thread.join
    calls: list[str] = []

    def interrupted_once(self: threading.Thread, timeout: float | None = None) -> None:
        calls.append(self.name)
        if len(calls) == 1:
            raise KeyboardInterrupt
        join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        pipeline.close()
    # the interrupted join was made again (those after it find their worker ended already, or wait for it)
    assert calls[:2] == ["stage-0", "stage-0"] and not any(worker.is_alive() for worker in workers)
    # leaving a `with` through another exception: that exception goes on, not the second Ctrl-C
    calls.clear()
    with pytest.raises(ValueError, match="the run's own"):
        with LocalPipeline(tiny_export, 2, F32):
            raise ValueError("the run's own")
    assert calls[:2] == ["stage-0", "stage-0"]


def test_a_ctrl_c_as_the_workers_start_stops_those_started(tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def interrupted_third(self: threading.Thread) -> None:
        if len(started) == 2:
            raise KeyboardInterrupt
        start(self)
        started.append(self)

    monkeypatch.setattr(threading.Thread, "start", interrupted_third)
    with pytest.raises(KeyboardInterrupt):
        LocalPipeline(tiny_export, 3, F32)
    assert len(started) == 2 and not any(worker.is_alive() for worker in started)
