"""Micro-batches a vanished driver left behind are freed once idle long enough; busy ones stay."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from deskfleet.agent.core import AgentCore, HostedStage
from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.kv_ledger import LedgerError
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import AssignStage, StageRef
from deskfleet.common.wire import Precision as WirePrecision
from deskfleet.controller.batch_track import BatchTrack
from tests.agent.test_core import core  # noqa: F401 (a fixture)


def test_idle_micro_batches_are_freed_and_busy_ones_kept(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    executor = StageExecutor(Stage(tiny_export, manifest, LayerRange(0, layers, layers),
                                   CompileSettings(precision=Precision.F32)), manifest.spec.max_context)
    tracks = {}
    for batch_id in (1, 2):
        tracks[batch_id] = BatchTrack(batch_id, manifest.spec.max_context)
        tracks[batch_id].add_row(stream_id=batch_id)
        executor.run(tracks[batch_id].step([[1, 5, 9]]))
    assert executor.release_idle(600.0) == []  # both just used
    assert executor.release_idle(600.0, now=time.monotonic() + 601) == [1, 2]  # as seen 10 minutes on...
    executor = StageExecutor(executor.stage, manifest.spec.max_context)  # ...so start again
    for batch_id in (1, 2):
        tracks[batch_id] = BatchTrack(batch_id, manifest.spec.max_context)
        tracks[batch_id].add_row(stream_id=batch_id)
        executor.run(tracks[batch_id].step([[1, 5, 9]]))
    time.sleep(0.3)
    executor.run(tracks[2].step([[4]]))  # micro-batch 2 keeps stepping, 1 does not
    assert executor.release_idle(0.25) == [1]
    assert executor.micro_batches == 1
    executor.run(tracks[2].step([[7]]))  # the busy one is intact
    with pytest.raises(LedgerError, match="the micro-batch has 0"):  # the freed one's state is gone
        executor.run(tracks[1].step([[8]]))


def test_the_agent_frees_idle_micro_batches_of_every_hosted_stage(core: AgentCore, tiny_export: Path) -> None:  # noqa: F811
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    executor = StageExecutor(Stage(tiny_export, manifest, LayerRange(0, layers, layers),
                                   CompileSettings(precision=Precision.F32)), manifest.spec.max_context)
    for batch_id in (1, 2):
        track = BatchTrack(batch_id, manifest.spec.max_context)
        track.add_row(stream_id=batch_id)
        executor.run(track.step([[1, 5]]))
    assignment = AssignStage(StageRef("tiny@1", 0, layers), True, True, "CPU", WirePrecision.F32, None, ())
    core.stages[assignment.stage] = HostedStage(assignment, executor, asyncio.Lock(), "tiny-0-4")
    assert asyncio.run(core.release_idle_micro_batches()) == 0  # the default: 10 minutes
    time.sleep(0.1)
    assert asyncio.run(core.release_idle_micro_batches(0.05)) == 2
    assert executor.micro_batches == 0
