"""`fleet plan` and `fleet deploy` show agents as `fleet ls` does (the id's first 12 characters and the
hostname, not the 52-character id that broke the columns) and layers as the half-open [start:stop] that
`fleet ls` and the chain's messages use (they printed inclusive 0-1 and 2-3 where ls printed [0:2] [2:4])."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import AgentCandidate, ModelFootprint, plan
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.plan_text import render_plan
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_member
from tests.ports import free_port

pytestmark = pytest.mark.slow




def test_render_plan_shows_short_ids_hostnames_and_half_open_ranges() -> None:
    model = ModelFootprint.uniform("m", 8, 10**6, 0, 0, 0, 16)
    ids = ["a" * 52, "b" * 52, "c" * 52]
    agents = [AgentCandidate(ids[0], AgentState.AVAILABLE, 8 * 10**9, 2.0, hostname="pc-fast"),
              AgentCandidate(ids[1], AgentState.AVAILABLE, 8 * 10**9, 2.0),
              AgentCandidate(ids[2], AgentState.PAUSED, 8 * 10**9, 2.0, hostname="pc-paused")]
    text = render_plan(plan(model, agents))
    assert ids[0] not in text and ids[1] not in text and ids[2] not in text
    assert re.search(r"^\s+0  aaaaaaaaaaaa  pc-fast\s+\[0:8\]\s+embed\+head ", text, re.M), text
    assert re.search(r"^  cccccccccccc  pc-paused\s+paused \(by its user or in its settings\)$", text, re.M), text
    assert re.search(r"^  bbbbbbbbbbbb  -\s+not needed", text, re.M), text
    assert not re.search(r"\b\d+-\d+\b", text), text


def test_plan_and_deploy_tables_match_ls(tmp_path: Path, tiny_export: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "controller"
    store = FleetStore(data)
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    ports = [free_port(), free_port()]
    common = ["--discover-seconds", "0", "--data-dir", str(data)]
    outputs: dict[str, str] = {}

    async def scenario() -> list[str]:
        servers, ids = [], []
        for index, port in enumerate(ports):
            files = make_member(load_ca(store), tmp_path / f"agent{index}", "agent")
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor())
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
            ids.append(core.agent_id)
        store.save_roster({agent_id: RosterEntry(agent_id, f"pc-{index}", utc_now().isoformat(),
                                                 (f"127.0.0.1:{port}",))
                           for index, (agent_id, port) in enumerate(zip(ids, ports, strict=True))})
        try:
            for command in ("plan", "deploy", "ls"):
                policy = ["--policy", "all_by_speed"] if command != "ls" else []
                model = ["--model", str(tiny_export)] if command != "ls" else []
                assert await asyncio.to_thread(main, ["fleet", command, *model, *policy, *common]) == 0
                outputs[command] = capsys.readouterr().out
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()
        return ids

    ids = asyncio.run(scenario())
    listed = {(agent_id[:12], host, ranges) for agent_id, host, ranges in re.findall(
        r"^(\S{12})\s+(pc-\d)\s+.*?((?:\S+\[\d+:\d+\])?)$", outputs["ls"], re.M)}
    for command in ("plan", "deploy"):
        text = outputs[command]
        assert not any(agent_id in text for agent_id in ids), text  # no 52-character ids breaking the columns
        stages = re.findall(r"^\s+\d+  (\S{12})  (pc-\d)\s+\[(\d+):(\d+)\] ", text, re.M)
        assert stages and stages[0][2] == "0" and stages[-1][3] == "4", text
        assert not re.search(r"\b\d+-\d+\b", text.split("\n", 1)[1]), text  # no inclusive ranges
        if command == "deploy":  # what `fleet ls` lists for each agent is what deploy printed
            for short, host, start, stop in stages:
                assert any(entry[0] == short and entry[1] == host and entry[2].endswith(f"[{start}:{stop}]")
                           for entry in listed), (stages, outputs["ls"])
