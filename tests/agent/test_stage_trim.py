"""A stage idle with no micro-batch gives back the memory of its calls, and computes as before afterwards.

A burst of `serve --fleet` requests left an agent at 400-480 MB against 60 MB before it, for as long as it hosted
the stage: the idle sessions a stage recycles keep the buffers of their largest calls, and the plugin what it
allocated for them (from an exploratory soak test).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.batch_track import BatchTrack
from tests.agent.test_stage_executor_refusals import PROMPT, result


@pytest.fixture
def stage(tiny_export: Path) -> Stage:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    return Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))


def _generate(executor: StageExecutor, micro_batch_id: int) -> np.ndarray:
    track = BatchTrack(micro_batch_id, 256)
    track.add_row(0)
    result(executor, track.step([PROMPT]))
    logits = result(executor, track.step([[9]])).logits
    assert logits is not None
    return logits


def test_a_stage_is_trimmed_once_idle_with_no_micro_batch_and_then_computes_as_before(
        stage: Stage, monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[bool] = []
    real = stage.compiled

    class Spied:  # the plugin's release_memory is what gives the buffers back: it must be called
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def release_memory(self) -> None:
            released.append(True)
            real.release_memory()

    monkeypatch.setattr(stage, "compiled", Spied())
    executor = StageExecutor(stage, 256)
    assert not executor.trim_if_idle(0.0)  # nothing ran since it was built
    before = _generate(executor, 1)
    assert not executor.trim_if_idle(0.0)  # micro-batch 1 is still held: its session is in use
    assert not executor.trim_if_idle(3600.0, now=executor._last_step + 10)  # not idle long enough
    executor.release(1)
    assert stage._idle_sessions  # recycled: what keeps its buffers
    assert executor.trim_if_idle(0.0)
    assert not stage._idle_sessions and released == [True]
    assert not executor.trim_if_idle(0.0)  # once: nothing ran since
    np.testing.assert_array_equal(_generate(executor, 2), before)
    executor.release(2)
    assert executor.trim_if_idle(0.0)  # ran again since: trimmed again


def test_an_agent_trims_only_its_idle_stages(tmp_path: Path, tiny_export: Path) -> None:
    from tests.agent.test_review_hop_auth import host, make_core

    core = make_core(tmp_path, "agent")
    manifest = load_manifest(tiny_export)
    host(core, tiny_export, 0, manifest.spec.num_layers, None)
    (hosted,) = core.stages.values()
    _generate(hosted.executor, 1)
    assert asyncio.run(core.trim_idle_stages(0.0)) == 0  # it holds micro-batch 1
    hosted.executor.release(1)
    assert asyncio.run(core.trim_idle_stages(3600.0)) == 0  # a step ran within the hour
    assert asyncio.run(core.trim_idle_stages(0.0)) == 1
