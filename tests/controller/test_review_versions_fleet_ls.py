"""`fleet ls` while a fleet is upgraded PC by PC: an admin needs to see which PCs run which deskfleet.

The table and `--json` showed no version at all (the Hello carried one, a constant "0.1.0" of its own, and the
link dropped it), and an agent of a newer protocol was listed as unreachable because it "sent a malformed
message: frame protocol version 6 is not supported". Now each agent's row shows the version its Hello named, and
one of another protocol is listed with that version and which side to upgrade."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import TlsFiles, start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.wire import PROTOCOL_VERSION, Hello, encode
from deskfleet.controller import fleet_survey
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_cli import _print_agents
from deskfleet.controller.fleet_listing import agent_json
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import SurveyOptions, survey
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_member

LOOPBACK = "127.0.0.1"
ENROLLED = "2026-01-01T00:00:00+00:00"


def newer_hello(files: TlsFiles) -> bytes:
    own = files.own_identity()
    frame = encode(Hello(PROTOCOL_VERSION + 1, own.agent_id, "0.2.0", own.role))
    return frame[:4] + struct.pack("<H", PROTOCOL_VERSION + 1) + frame[6:]


def test_fleet_ls_shows_each_agent_s_version_and_whom_to_upgrade(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    current_files = make_member(load_ca(store), tmp_path / "current", "agent")
    newer_files = make_member(load_ca(store), tmp_path / "newer", "agent")
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    core = AgentCore(current_files, settings, ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor())
    newer_id = newer_files.own_identity().agent_id
    older_files = make_member(load_ca(store), tmp_path / "older", "agent")
    older_id = older_files.own_identity().agent_id

    async def older_agent(connection: ServerConnection) -> None:  # a released agent: it closes at our Hello
        await connection.recv()
        await connection.close(1008, f"agent speaks protocol {PROTOCOL_VERSION - 1} (deskfleet 0.1.0), you "
                                     f"{PROTOCOL_VERSION}: upgrade deskfleet on the agent {older_id[:12]}")

    async def newer_agent(connection: ServerConnection) -> None:  # a PC already on the next release
        await connection.recv()
        await connection.send(newer_hello(newer_files))
        try:
            await connection.recv()
        except ConnectionClosed:
            pass

    async def scenario() -> fleet_survey.Survey:
        current = await start_server(core.serve_link, LOOPBACK, 0, current_files)
        newer = await serve(newer_agent, LOOPBACK, 0, ssl=newer_files.server_context())
        older = await serve(older_agent, LOOPBACK, 0, ssl=older_files.server_context())
        async with current, newer, older:
            addresses = {agent_id: (f"{LOOPBACK}:{server.sockets[0].getsockname()[1]}",)
                         for agent_id, server in ((core.agent_id, current), (newer_id, newer), (older_id, older))}
            store.save_roster({core.agent_id: RosterEntry(core.agent_id, "pc-old", ENROLLED, addresses[core.agent_id]),
                               newer_id: RosterEntry(newer_id, "pc-new", ENROLLED, addresses[newer_id]),
                               older_id: RosterEntry(older_id, "pc-older", ENROLLED, addresses[older_id])})
            found = await survey(store, SurveyOptions(discover_seconds=0))
            await found.close()
        return found

    found = asyncio.run(scenario())
    agents = {agent.agent_id: agent for agent in found.agents}
    installed = importlib.metadata.version("deskfleet")
    assert agents[core.agent_id].report is not None and agents[core.agent_id].version == installed
    newer = agents[newer_id]
    assert newer.report is None and newer.version == "0.2.0"
    assert newer.problem is not None and "malformed" not in newer.problem
    assert f"speaks fleet protocol {PROTOCOL_VERSION + 1} (deskfleet 0.2.0)" in newer.problem
    assert "upgrade deskfleet on this controller" in newer.problem

    older = agents[older_id]  # known by its close reason: it was "unreachable", with no version
    assert older.report is None and (older.version, older.other_protocol) == ("0.1.0", PROTOCOL_VERSION - 1)
    assert f"upgrade deskfleet on agent {older_id[:12]}" in str(older.problem)

    _print_agents(found.agents)
    lines = capsys.readouterr().out.splitlines()
    heading = lines[0].split()
    disk, version = heading.index("disk"), heading.index("version")
    rows = {row.split()[1]: row.split() for row in lines[1:4]}
    assert rows["pc-old"][version] == installed and rows["pc-new"][version] == "0.2.0"
    assert rows["pc-older"][version] == "0.1.0"
    assert rows["pc-old"][disk].endswith("GiB") and rows["pc-new"][disk] == rows["pc-older"][disk] == "-"
    assert [rows[host][3] for host in ("pc-old", "pc-older", "pc-new")] == ["available", "outdated", "newer"]
    assert lines[4] == "3 agent(s): 1 available, 1 outdated, 1 newer"
    assert lines[5].startswith(f"1 PC(s) run a deskfleet of an older fleet protocol than this controller's "
                               f"({PROTOCOL_VERSION}): upgrade deskfleet on them")
    assert lines[6].startswith("1 PC(s) run a deskfleet of a newer fleet protocol than this controller's")
    listed = {entry["hostname"]: entry for entry in json.loads(json.dumps([agent_json(a) for a in found.agents]))}
    assert listed["pc-old"]["version"] == installed and listed["pc-new"]["version"] == "0.2.0"
    assert [(listed[host]["state"], listed[host]["protocol"]) for host in ("pc-old", "pc-older", "pc-new")] == [
        ("available", PROTOCOL_VERSION), ("outdated", PROTOCOL_VERSION - 1), ("newer", PROTOCOL_VERSION + 1)]


def test_the_free_column_is_in_gib_as_the_limits_beside_it(capsys: pytest.CaptureFixture[str]) -> None:
    # "8.6G" in the column beside "(8.0 GiB free of 16.0 ...)" in the notes: one number, two units
    from types import SimpleNamespace

    from deskfleet.common.agent_state import AgentState

    report = SimpleNamespace(state=AgentState.AVAILABLE, free_memory_bytes=8 << 30, stages=(), reasons=(), detail="",
                             shard_room_bytes=3 << 29, clock_s=None, cpu_load=0.0, igpu_busy=None,
                             temperature_c=None, battery_percent=None, on_ac_power=None)
    agent = SimpleNamespace(agent_id="a" * 52, hostname="pc-ann", address="10.0.0.5:7341", report=report,
                            sources=("registered",), problem=None, version="1.0")
    _print_agents([agent])
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[4:6] == ["8.0GiB", "1.5GiB"]  # free memory, and what its shard cache can take
    _print_agents([SimpleNamespace(**{**vars(agent), "report": SimpleNamespace(**{**vars(report),
                                                                                  "shard_room_bytes": None})})])
    assert capsys.readouterr().out.splitlines()[1].split()[4:6] == ["8.0GiB", "-"]  # not reported


def survey_an_older_agent(tmp_path: Path, roster: Callable[[str, str], RosterEntry],
                          peer: Callable[[str], str]) -> tuple[str, list[fleet_survey.AgentView]]:
    """A released agent of the previous protocol (it closes at our Hello, its version in the reason), listed in the
    roster as `roster(its id, its address)` says and asked at `peer(its port)`: (its id, the agents surveyed)."""
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    older_files = make_member(load_ca(store), tmp_path / "older", "agent")
    older_id = older_files.own_identity().agent_id

    async def older_agent(connection: ServerConnection) -> None:
        await connection.recv()
        await connection.close(1008, f"agent speaks protocol {PROTOCOL_VERSION - 1} (deskfleet 0.7.0), you "
                                     f"{PROTOCOL_VERSION}: upgrade deskfleet on the agent {older_id[:12]}")

    async def scenario() -> fleet_survey.Survey:
        older = await serve(older_agent, LOOPBACK, 0, ssl=older_files.server_context())
        async with older:
            port = older.sockets[0].getsockname()[1]
            store.save_roster({older_id: roster(older_id, f"{LOOPBACK}:{port}")})
            found = await survey(store, SurveyOptions(peers=(peer(port),), discover_seconds=0))
            await found.close()
        return found

    return older_id, asyncio.run(scenario()).agents


def test_a_pc_of_another_protocol_given_by_peer_is_listed_once_under_its_roster_name(tmp_path: Path) -> None:
    # A downgraded PC that never registered, asked with --peer: listed twice, as "?" (outdated) and as its roster
    # entry ("never called in: start `deskfleet-agent`"), and counted as two PCs to upgrade
    older_id, (agent,) = survey_an_older_agent(
        tmp_path, lambda agent_id, _: RosterEntry(agent_id, "pc-down", ENROLLED),  # no address: never registered
        lambda port: f"{LOOPBACK}:{port}")
    assert (agent.agent_id, agent.hostname, agent.version, agent.other_protocol) == (
        older_id, "pc-down", "0.7.0", PROTOCOL_VERSION - 1)


def test_a_pc_of_another_protocol_at_two_addresses_is_listed_once(tmp_path: Path) -> None:
    # registered at one address and given by --peer at an alias of it: two rows, "2 PC(s) to upgrade"
    older_id, (agent,) = survey_an_older_agent(
        tmp_path, lambda agent_id, address: RosterEntry(agent_id, "pc-old", ENROLLED, (address,)),
        lambda port: f"localhost:{port}")
    assert (agent.agent_id, agent.hostname, agent.other_protocol) == (older_id, "pc-old", PROTOCOL_VERSION - 1)
