"""A deploy that moves a model off an agent (another policy, a re-plan after a PC dropped out) releases the
stage that agent held of it: it no longer holds the memory and cache pins of a stage no chain uses."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.planner import PlanOptions, PlanPolicy
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_deploy import deploy
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import SurveyOptions, survey
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_member

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_deploy_that_moves_a_model_off_an_agent_releases_its_old_stage(tmp_path: Path, tiny_export: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    ports = [free_port(), free_port()]

    async def scenario() -> dict[str, list[str]]:
        cores: dict[str, AgentCore] = {}
        servers = []
        for index, port in enumerate(ports):
            files = make_member(ca, tmp_path / f"agent{index}", "agent")
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor())
            cores[core.agent_id] = core
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
        options = SurveyOptions(peers=tuple(f"127.0.0.1:{port}" for port in ports), discover_seconds=0)
        try:
            for policy in (PlanPolicy.ALL_BY_SPEED, PlanPolicy.FEWEST_AGENTS):
                found = await survey(store, options)
                try:
                    _, report = await deploy(store, tiny_export, found, PlanOptions(policy=policy))
                finally:
                    await found.close()
            assert len(report.stages) == 1
            await asyncio.sleep(0.2)  # the release travels on its own; nothing answers it
            return {agent_id: [f"{ref.layer_start}:{ref.layer_end}" for ref in core.stages]
                    for agent_id, core in cores.items()}
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    hosted = asyncio.run(scenario())
    assert sorted(map(len, hosted.values())) == [0, 1], hosted
