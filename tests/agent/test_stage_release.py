"""A serving PC that stays on battery or too hot past the employee's `release_stages_after_s` gives its stages
up: its files unpinned, the next step refused naming this agent and why (so the driver re-plans without it),
and nothing given up for a moment unplugged, for low memory, or while no stage is hosted."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent.core import AgentCore, CommandError
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import GIB, MonitorReading
from deskfleet.common.wire import ErrorCode, Forward, Role, StageRef, StatusReport, StatusRequest
from deskfleet.controller.batch_track import BatchTrack
from tests.agent.test_core import _host_tiny_stage, handle
from tests.fleet_pki import make_ca, make_member


class SwitchableMonitor:
    """A laptop whose charger the test plugs and unplugs."""

    def __init__(self) -> None:
        self.on_ac_power = True
        self.memory_free_bytes = 8 * GIB

    def read(self) -> MonitorReading:
        return MonitorReading(cpu_load=0.1, memory_free_bytes=self.memory_free_bytes, memory_total_bytes=16 * GIB,
                              battery_percent=41.0, on_ac_power=self.on_ac_power, temperatures=(), igpu_busy=None)


@pytest.fixture
def laptop(tmp_path: Path) -> tuple[AgentCore, SwitchableMonitor]:
    ca = make_ca(tmp_path / "ca")
    files = make_member(ca, tmp_path / "agent", "agent")
    monitor = SwitchableMonitor()
    settings = AgentSettings(thresholds=Thresholds(release_stages_after_s=30.0))  # AC required, 2 GiB free
    return AgentCore(files, settings, ShardCache(tmp_path / "cache", 1 << 30), monitor), monitor


def _enforce(core: AgentCore, now: float) -> tuple[StageRef, ...]:
    return asyncio.run(core.enforce_limits(now))


def test_a_pc_left_on_battery_gives_its_stage_up_and_the_next_step_names_it(
        laptop: tuple[AgentCore, SwitchableMonitor], tiny_export: Path) -> None:
    core, monitor = laptop
    assignment = _host_tiny_stage(core, tiny_export)
    monitor.on_ac_power = False
    assert _enforce(core, 100.0) == () and _enforce(core, 129.0) == ()  # unplugged 29 s: still serving
    assert _enforce(core, 130.0) == (assignment.stage,)
    assert core.stages == {}
    core.cache.evict(0)
    assert not any(core.cache.has(entry.sha256) for entry in assignment.manifest)  # nothing pinned any more
    with pytest.raises(CommandError,
                       match=r"gave its stages up: battery 41%, unplugged \(require_ac_power\) for 30 s") as refused:
        handle(core, Role.AGENT, replace(_one_step(), model_id=assignment.stage.model_id))
    assert refused.value.code is ErrorCode.NOT_ASSIGNED and refused.value.agent_id == core.agent_id
    report = handle(core, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport) and report.state is AgentState.UNAVAILABLE and report.stages == ()
    assert report.last_error is not None and "gave up 1 stage(s)" in report.last_error
    monitor.on_ac_power = True  # plugged in again: a new plan may give it a stage, which it then serves
    assert _host_tiny_stage(core, tiny_export).stage in core.stages


def test_a_moment_unplugged_low_memory_or_no_stage_gives_nothing_up(
        laptop: tuple[AgentCore, SwitchableMonitor], tiny_export: Path) -> None:
    core, monitor = laptop
    monitor.on_ac_power = False
    assert _enforce(core, 0.0) == () and _enforce(core, 100.0) == ()  # no stage: the spell is not counted
    assignment = _host_tiny_stage(core, tiny_export)
    assert _enforce(core, 101.0) == ()
    monitor.on_ac_power = True
    assert _enforce(core, 120.0) == ()
    monitor.on_ac_power = False
    assert _enforce(core, 140.0) == ()  # 20 s into a new spell, not 39 since the first
    monitor.on_ac_power = True
    monitor.memory_free_bytes = GIB  # below the 2 GiB limit: the planner's business, not a reason to drop out
    assert _enforce(core, 1000.0) == () and _enforce(core, 2000.0) == ()
    assert assignment.stage in core.stages


def _one_step() -> Forward:
    track = BatchTrack(1, 4096)
    track.add_row(0)
    return track.step([[1, 5, 9]])
