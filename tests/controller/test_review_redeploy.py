"""Deploys that meet: one that moves a model off an agent (another policy, a re-plan after a PC dropped out)
releases the stage that agent held of it; a second deploy from the same data dir while one runs is refused
at once, naming the first, and the first finishes (both pushing the same shards made both fail)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.planner import PlanOptions, PlanPolicy
from deskfleet.controller import fleet_survey
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_deploy import DeployError, DeployReport, deploy
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import SurveyOptions, survey
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_member
from tests.ports import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def patient_surveys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agents here live in the test's own event loop and always answer: a survey's 5 s wait for a status
    measured only how much CPU a busy CI machine left this process. Starved (or stopped) for 5 s while the
    two surveys waited, both listed every agent as unreachable and neither deploy met the lock."""
    monkeypatch.setattr(fleet_survey, "STATUS_TIMEOUT_S", 120.0)




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
            # The release travels on its own; nothing answers it. Waited for rather than slept on (0.2 s was
            # plenty here, but this process was seen starved for seconds on CI): at most 60 s for a broken run.
            deadline = asyncio.get_running_loop().time() + 60
            while sorted(len(core.stages) for core in cores.values()) != [0, 1]:
                if asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.01)
            return {agent_id: [f"{ref.layer_start}:{ref.layer_end}" for ref in core.stages]
                    for agent_id, core in cores.items()}
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    hosted = asyncio.run(scenario())
    assert sorted(map(len, hosted.values())) == [0, 1], hosted


def test_a_second_deploy_from_the_same_data_dir_is_refused_while_one_runs(tmp_path: Path, tiny_export: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    ports = [free_port(), free_port()]

    async def one_deploy(options: SurveyOptions) -> DeployReport:
        found = await survey(store, options)
        try:
            return (await deploy(store, tiny_export, found, PlanOptions(policy=PlanPolicy.ALL_BY_SPEED)))[1]
        finally:
            await found.close()

    async def scenario() -> tuple[list[DeployReport | BaseException], DeployReport]:
        servers = []
        for index, port in enumerate(ports):
            files = make_member(ca, tmp_path / f"agent{index}", "agent")
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor())
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
        options = SurveyOptions(peers=tuple(f"127.0.0.1:{port}" for port in ports), discover_seconds=0)
        try:
            both = await asyncio.gather(one_deploy(options), one_deploy(options), return_exceptions=True)
            return both, await one_deploy(options)  # the lock is free again
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    both, after = asyncio.run(scenario())
    reports = [outcome for outcome in both if isinstance(outcome, DeployReport)]
    refusals = [outcome for outcome in both if isinstance(outcome, DeployError)]
    assert len(reports) == 1 and len(refusals) == 1, both
    assert "another deploy from" in str(refusals[0]) and "is running (pid" in str(refusals[0])
    assert set(after.bytes_sent.values()) == {0}
