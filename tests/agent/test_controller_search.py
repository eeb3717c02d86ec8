"""A controller that moved is found over mDNS: its announcement, the agent's search, and the agent registering
at the found address (saved first in membership.json) when the one it joined with no longer answers.

mDNS runs on loopback only (see tests/agent/test_advertise.py for why that works here)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from deskfleet.agent import controller_search
from deskfleet.agent import service as service_module
from deskfleet.agent.advertise import Advertiser
from deskfleet.agent.controller_search import find_controller, interfaces_to_search
from deskfleet.agent.enroll import Membership, join
from deskfleet.agent.link import utc_now
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentOptions, AgentService
from deskfleet.common.discovery_record import CONTROLLER_SERVICE_TYPE, ControllerRecord, RecordError
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.agent.test_core import FakeMonitor
from tests.controller.test_fleet_ca import token_for
from tests.ports import free_port
from tests.run_ids import RUN, run_agent_id, run_fleet_id

LOOPBACK = "127.0.0.1"
FLEET = run_fleet_id("fleet")
CONTROLLER = run_agent_id("controller")
FORGED = run_agent_id("forged")
OTHER_CONTROLLER, OTHER_FLEETS = run_agent_id("another controller"), run_agent_id("another fleet's")
OTHER_FLEET = run_fleet_id("another fleet")


def test_a_controller_record_round_trips_and_refuses_what_is_not_one() -> None:
    record = ControllerRecord(CONTROLLER, FLEET)
    assert ControllerRecord.from_txt(record.to_txt()) == record
    assert ControllerRecord.from_txt({key.encode(): value.encode() for key, value in record.to_txt().items()}) == record
    assert record.instance_name == f"{CONTROLLER}.{CONTROLLER_SERVICE_TYPE}"
    for broken, key in (({"id": "not-a-controller-id"}, "id"), ({"fleet": "FLEET"}, "fleet"),
                        ({"proto": "-1"}, "proto"), ({"id": None}, "id")):
        properties: dict[str, str | None] = {**record.to_txt(), **broken}
        with pytest.raises(RecordError, match=repr(key)):
            ControllerRecord.from_txt({name.encode(): None if value is None else value.encode()
                                       for name, value in properties.items()})
    with pytest.raises(RecordError, match="'fleet' is missing"):
        ControllerRecord.from_txt({"id": CONTROLLER, "proto": "1"})


def test_the_search_returns_only_this_fleets_controller() -> None:
    async def scenario() -> tuple[list[str], list[str], list[str]]:
        others = [Advertiser(ControllerRecord(OTHER_CONTROLLER, FLEET), 7001, [LOOPBACK]),  # another controller id
                  Advertiser(ControllerRecord(OTHER_FLEETS, OTHER_FLEET), 7002, [LOOPBACK])]  # another fleet
        forged = AsyncZeroconf(interfaces=[LOOPBACK])  # this controller's name with a TXT that is not a record
        await (await forged.async_register_service(AsyncServiceInfo(
            CONTROLLER_SERVICE_TYPE, f"{FORGED}.{CONTROLLER_SERVICE_TYPE}", addresses=[bytes([127, 0, 0, 1])],
            port=7003, properties={"id": FORGED, "fleet": FLEET, "proto": "many"}, server=f"forged-{RUN}.local.")))
        try:
            for other in others:
                await other.start()
            before = await find_controller(FLEET, CONTROLLER, [LOOPBACK], search_s=1.5)
            async with Advertiser(ControllerRecord(CONTROLLER, FLEET), 7000, [LOOPBACK]):
                found = await find_controller(FLEET, CONTROLLER, [LOOPBACK])
            forged_id = await find_controller(FLEET, FORGED, [LOOPBACK], search_s=1.5)
        finally:
            for other in others:
                await other.close()
            await forged.async_close()
        return before, found, forged_id

    before, found, forged_id = asyncio.run(scenario())
    assert before == []  # only others' announcements: nothing to dial
    assert found == [f"{LOOPBACK}:7000"]
    assert forged_id == []  # a malformed announcement gives nothing
    assert asyncio.run(find_controller(FLEET, CONTROLLER, [])) == []


def test_an_agent_whose_controller_moved_finds_it_registers_and_saves_the_new_address(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # The controller's address in the join token stops answering (a new DHCP lease, or its data dir moved to
    # another PC): before, the agent retried that address for ever and the PC was lost to the fleet.
    monkeypatch.setattr(service_module, "RETRY_MAX_S", 0.2)
    # The first search (3 s) began 0.2 s after the controller, whose announcement was up 1.1 s later here; a
    # search that missed it on a slow machine was tried again only after 30 s, past the wait below.
    monkeypatch.setattr(service_module, "CONTROLLER_SEARCH_INTERVAL_S", 0.5)
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    data_dir = tmp_path / "agent"
    state_dir = AgentPaths.resolve(data_dir).state_dir
    dead = f"{LOOPBACK}:{free_port()}"

    async def announce_on_loopback() -> tuple[list[str], str]:
        return [LOOPBACK], ""

    async def scenario() -> tuple[str, bool]:
        server = FleetServer(store, f"{LOOPBACK}:{free_port()}", announce_at=announce_on_loopback)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(server.run())
            while server.bound_port is None:
                await asyncio.sleep(0.01)
            address = f"{LOOPBACK}:{server.bound_port}"
            membership = await join(token_for(store, address), state_dir, "pc-1")
            dataclasses.replace(membership, controller_addresses=(dead,)).save(state_dir)  # the old address
            agent = AgentService(AgentOptions(data_dir, listen=f"{LOOPBACK}:{free_port()}"), monitor=FakeMonitor())
            assert agent.controller_search_interfaces() == []  # on loopback, the agent itself would not search
            agent.controller_search_interfaces = lambda: [LOOPBACK]
            running = tasks.create_task(agent.run())
            try:
                async with asyncio.timeout(60):
                    while membership.agent_id not in server.live:
                        await asyncio.sleep(0.05)
                registered = True
            finally:
                agent.stop()
                await running
                server.stop()
        return address, registered

    with caplog.at_level(logging.WARNING, logger="deskfleet.agent.service"):
        address, registered = asyncio.run(scenario())
    assert registered
    assert Membership.load(state_dir).controller_addresses == (address, dead)  # found first, the old kept after
    assert any(f"no longer answers at {dead}; its mDNS announcement gives {address}" in record.getMessage()
               for record in caplog.records)


def test_moves_to_new_ip_addresses_never_push_out_a_host_name() -> None:
    # The saved list was cut to its first 4: after three moves a DNS name given to `fleet init` (the admin's
    # way to move a controller) was gone, and so were the last addresses of a token that listed four or more.
    from deskfleet.agent.service import SAVED_CONTROLLER_ADDRESSES, addresses_after_move

    saved: tuple[str, ...] = ("ctl.corp.example:7341",)
    for step in range(6):
        saved = addresses_after_move(f"10.0.0.{step}:7341", saved)
    assert saved == ("10.0.0.5:7341", "10.0.0.4:7341", "10.0.0.3:7341", "ctl.corp.example:7341")
    assert len(saved) == SAVED_CONTROLLER_ADDRESSES
    names = tuple(f"ctl{index}.corp.example:7341" for index in range(5))
    assert addresses_after_move("10.0.0.9:7341", names) == ("10.0.0.9:7341", *names)  # names are all kept
    assert addresses_after_move("10.0.0.4:7341", ("10.0.0.3:7341", "10.0.0.4:7341")) == \
        ("10.0.0.4:7341", "10.0.0.3:7341")  # no duplicate


@pytest.mark.parametrize(("listen", "controllers", "searched"), [
    ("127.0.0.1:7431", ("10.0.0.5:7341",), False),  # listening on loopback: no controller elsewhere reaches it
    ("0.0.0.0:7431", ("127.0.0.1:7341",), False),  # a controller on this PC, on loopback: it announces nothing
    ("0.0.0.0:7431", ("localhost:7341", "[::1]:7341"), False),
    ("0.0.0.0:7431", ("127.0.0.1:7341", "10.0.0.5:7341"), True),  # one address off this PC: it may have moved
    ("0.0.0.0:7431", ("ctl.example.com:7341",), True),  # a name resolves anywhere
    ("10.0.0.7:7431", ("10.0.0.5:7341",), True),
])
def test_a_moved_controller_is_looked_for_only_where_an_announcement_can_help(
        listen: str, controllers: tuple[str, ...], searched: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # An agent on loopback whose controller was down sent mDNS queries out of every interface of the PC
    monkeypatch.setattr(controller_search, "interface_addresses", lambda: ["10.0.0.7"])
    assert interfaces_to_search(listen, controllers) == (["10.0.0.7"] if searched else [])
