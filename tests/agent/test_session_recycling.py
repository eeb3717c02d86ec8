"""A stage recycles the sessions its micro-batches no longer need: handed out again empty, bounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.stage import IDLE_SESSIONS, CompileSettings, LayerRange, Precision, Stage, StageSession
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.batch_track import BatchTrack
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline


@pytest.fixture(scope="module")
def stage(tiny_export: Path) -> Stage:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    return Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))


def _prompt(session: StageSession, ids: list[int]) -> np.ndarray:
    """Feed a prompt from slot 0 on; the logits of its last position."""
    count = len(ids)
    output = session.forward(np.array([ids], dtype=np.int64), np.ones((1, count), dtype=np.int64),
                             np.arange(count, dtype=np.int64)[None, :], np.zeros(1, dtype=np.int32),
                             want_logits=True, logits_positions=np.array([[count - 1]], dtype=np.int64))
    assert output.logits is not None
    return output.logits


def test_a_recycled_session_comes_back_empty_and_computes_like_a_new_one(stage: Stage) -> None:
    used = stage.open_session()
    _prompt(used, [1, 5, 9, 4])  # four slots of KV state
    stage.recycle(used)
    again = stage.open_session()
    assert again is used
    # from slot 0 again: with the old four slots still there, the mask would not fit the state
    np.testing.assert_array_equal(_prompt(again, [2, 7]), _prompt(StageSession(stage), [2, 7]))
    stage.recycle(again)


def test_a_stage_keeps_a_bounded_number_of_idle_sessions(stage: Stage) -> None:
    while stage._idle_sessions:  # start from an empty pool
        stage.open_session()
    opened = [stage.open_session() for _ in range(IDLE_SESSIONS + 2)]
    for session in opened:
        stage.recycle(session)
    stage.recycle(opened[0])  # twice: still one entry
    reopened = [stage.open_session() for _ in range(IDLE_SESSIONS + 2)]
    kept = {id(session) for session in opened[:IDLE_SESSIONS]}
    assert {id(session) for session in reopened[:IDLE_SESSIONS]} == kept
    assert not {id(session) for session in reopened[IDLE_SESSIONS:]} & {id(session) for session in opened}


def test_a_session_goes_back_only_to_the_stage_that_opened_it(stage: Stage, tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    other = Stage(tiny_export, manifest, LayerRange(0, 2, manifest.spec.num_layers),
                  CompileSettings(precision=Precision.F32))
    with pytest.raises(ValueError, match="only go back to the stage that opened it"):
        stage.recycle(other.open_session())


def test_the_executor_recycles_released_and_idle_micro_batches(stage: Stage) -> None:
    spec_context = 64
    executor = StageExecutor(stage, spec_context)
    sessions = {}
    for batch_id in (1, 2):
        track = BatchTrack(batch_id, spec_context)
        track.add_row(stream_id=batch_id)
        executor.run(track.step([[1, 5, 9]]))
        sessions[batch_id] = executor._batches[batch_id].session
    executor.release(1)
    assert any(idle is sessions[1] for idle in stage._idle_sessions)
    assert executor.release_idle(0.0, now=float("inf")) == [2]
    assert any(idle is sessions[2] for idle in stage._idle_sessions)


def test_engine_runs_on_recycled_sessions_give_the_same_tokens(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    prompts = [[1, 5, 9, 4, 2], [1, 7, 3], [1, 8, 8, 6, 2, 9, 11]]
    with LocalPipeline(tiny_export, 1, CompileSettings(precision=Precision.F32), manifest) as pipeline:
        runs = []
        for _ in range(3):  # the second and third runs reuse the first's requests
            engine = Engine(pipeline, manifest.spec, None, EngineOptions(max_rows=2, micro_batches=1))
            for index, prompt in enumerate(prompts):  # one arrives later: prefilled alone, then merged
                engine.add(StreamRequest(prompt, max_new_tokens=12, ignore_eos=True, arrival_step=2 * index))
            runs.append({stream: result.tokens for stream, result in engine.run().items()})
        assert pipeline.stages[0]._idle_sessions  # what the runs released came back
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_a_refused_input_shape_leaves_the_session_computing_on_what_it_is_fed(tiny_export: Path) -> None:
    """A later stage fed hidden states of the wrong width refuses them; the session's next call must still
    read the inputs it is given, not a buffer the request never took."""
    manifest = load_manifest(tiny_export)
    layers, hidden = manifest.spec.num_layers, manifest.spec.hidden_size
    last = Stage(tiny_export, manifest, LayerRange(layers // 2, layers, layers),
                 CompileSettings(precision=Precision.F32))
    probe = np.random.default_rng(0).standard_normal((1, 1, hidden)).astype(np.float32)

    def run(session: StageSession, states: np.ndarray) -> np.ndarray:
        rows, count = states.shape[:2]
        output = session.forward(states, np.ones((rows, count), dtype=np.int64),
                                 np.arange(count, dtype=np.int64)[None, :], np.zeros(1, dtype=np.int32),
                                 want_logits=True, logits_positions=np.array([[count - 1]], dtype=np.int64))
        assert output.logits is not None
        return output.logits

    expected = run(StageSession(last), probe)
    session = StageSession(last)
    run(session, np.zeros((1, 3, hidden), dtype=np.float32))
    session.reset()
    with pytest.raises(RuntimeError):
        run(session, np.zeros((1, 100, 7), dtype=np.float32))  # larger than the buffer, and the wrong width
    session.reset()
    np.testing.assert_array_equal(run(session, probe), expected)


def test_recycled_sessions_serve_a_batch_in_fast_precision_like_new_ones(tiny_export: Path) -> None:
    """A session reset after one stream, then handed a two-row micro-batch (one row admitted from another
    session's state): with the CPU plugin's u8 KV cache, reset_state alone left it reading garbage and
    row 1's logits turned NaN after some steps (StageSession.reset)."""
    manifest = load_manifest(tiny_export)
    settings = CompileSettings(precision=Precision.FAST, num_threads=1)
    prompts = [[5, 9, 13, 2, 7, 11, 3, 8], [4, 6, 10, 12, 14, 1, 15, 16]]

    def generate(pipeline: LocalPipeline, streams: int) -> list[list[int]]:
        engine = Engine(pipeline, manifest.spec, None, EngineOptions(max_rows=streams))
        for prompt in prompts[:streams]:
            engine.add(StreamRequest(prompt, max_new_tokens=60, ignore_eos=True))
        return [stream.tokens for stream in engine.run().values()]

    with LocalPipeline(tiny_export, 1, settings, manifest) as fresh:
        expected = generate(fresh, 2)
    with LocalPipeline(tiny_export, 1, settings, manifest) as reused:
        generate(reused, 1)  # its session goes back to the stage's idle pool
        assert generate(reused, 2) == expected


def test_a_stage_dropped_with_idle_sessions_is_freed_at_once_not_at_a_full_collection(tiny_export: Path) -> None:
    # A session held its stage and the stage its idle sessions: a cycle only Python's full collection frees, seldom
    # in a busy agent. Every stage an agent released kept its compiled model, weight files and their mappings for
    # many minutes (6 redeploys of the demo target: 314 -> 650 MB, 38 -> 80 file handles)
    import gc
    import weakref

    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    stage = Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))
    executor = StageExecutor(stage, manifest.spec.max_context)
    track = BatchTrack(1, manifest.spec.max_context)
    track.add_row(0)
    executor.run(track.step([[1, 5, 9]]))  # a micro-batch's session, running
    stage.recycle(stage.open_session())  # and one idle
    gone = weakref.ref(stage)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del stage, executor
        assert gone() is None
    finally:
        if was_enabled:
            gc.enable()
