"""Review of the search for a moved controller (agent/controller_search.py, AgentService._find_moved_controller):
hostile announcements, bounded dials, and membership.json left alone when the controller did not move.

mDNS runs on loopback only (see tests/agent/test_advertise.py for why that works here)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import psutil
import pytest
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from deskfleet.agent import advertise
from deskfleet.agent import link as link_module
from deskfleet.agent import service as service_module
from deskfleet.agent.advertise import Advertiser
from deskfleet.agent.controller_search import find_controller
from deskfleet.agent.enroll import Membership, join
from deskfleet.agent.link import Link, LinkError, LinkRefused, utc_now
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentOptions, AgentService
from deskfleet.common.discovery_record import CONTROLLER_SERVICE_TYPE, ControllerRecord
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

Result = TypeVar("Result")


async def _register(zeroconf: AsyncZeroconf, name: str, port: int, addresses: list[bytes],
                    properties: dict[str, str]) -> None:
    await (await zeroconf.async_register_service(AsyncServiceInfo(
        CONTROLLER_SERVICE_TYPE, f"{name}.{CONTROLLER_SERVICE_TYPE}", addresses=addresses, port=port,
        properties=properties, server=f"{name[:20]}.local.")))



def register_for(agent: AgentService, seconds: float) -> None:
    """Run the agent's registration loop for `seconds`, then stop it."""
    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(seconds):
                await agent._register_forever()

    asyncio.run(scenario())

def test_a_flood_of_other_announcements_does_not_hide_the_controller() -> None:
    # Announcements that are not this controller's (here: names that never resolve, each costing the old search
    # a 1 s resolve) came first and used up the search, so the controller announced a moment later was missed.
    # The controller is found ~2 s after the search starts (its announcement's probing, zeroconf's timers): a
    # 10 s search leaves a slow machine room, and 12 floods (12 s of the old resolves) still outlast it.
    async def scenario() -> list[str]:
        flood = AsyncZeroconf(interfaces=[LOOPBACK])
        try:
            await asyncio.gather(*(_register(flood, f"f{n}-{RUN}", 7100 + n, [], {"id": "x"}) for n in range(12)))
            search = asyncio.create_task(find_controller(FLEET, CONTROLLER, [LOOPBACK], search_s=10.0))
            await asyncio.sleep(0.3)
            async with Advertiser(ControllerRecord(CONTROLLER, FLEET), 7000, [LOOPBACK]):
                return await search
        finally:
            await flood.async_close()

    assert asyncio.run(scenario()) == [f"{LOOPBACK}:7000"]


def test_a_forged_announcement_of_the_controllers_name_gives_only_addresses_worth_a_dial() -> None:
    # Port 0 gives nothing; unspecified, multicast and link-local addresses are left out.
    record = ControllerRecord(CONTROLLER, FLEET).to_txt()
    weird = [bytes([127, 0, 0, 1]), bytes(4), bytes([224, 0, 0, 251]), bytes([169, 254, 1, 1])]

    async def scenario(port: int) -> list[str]:
        forged = AsyncZeroconf(interfaces=[LOOPBACK])
        try:
            await _register(forged, CONTROLLER, port, weird, record)
            return await find_controller(FLEET, CONTROLLER, [LOOPBACK], search_s=2.0)
        finally:
            await forged.async_close()

    assert asyncio.run(scenario(7005)) == [f"{LOOPBACK}:7005"]
    assert asyncio.run(scenario(0)) == []


def test_a_search_cancelled_midway_closes_its_mdns_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[AsyncZeroconf] = []

    class Recorded(AsyncZeroconf):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            opened.append(self)

    monkeypatch.setattr(advertise, "AsyncZeroconf", Recorded)  # what open_zeroconf makes

    async def scenario() -> None:
        search = asyncio.create_task(find_controller(FLEET, CONTROLLER, [LOOPBACK]))
        await asyncio.sleep(0.5)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search

    asyncio.run(scenario())
    assert len(opened) == 1 and opened[0].zeroconf.done


@dataclasses.dataclass
class Joined:
    store: FleetStore
    data_dir: Path
    state_dir: Path
    membership: Membership


@pytest.fixture
def joined(tmp_path: Path) -> Joined:
    """An agent joined to a controller that is stopped again (its address no longer answers)."""
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    data_dir = tmp_path / "agent"
    state_dir = AgentPaths.resolve(data_dir).state_dir

    async def join_once() -> Membership:
        server = FleetServer(store, f"{LOOPBACK}:{free_port()}", announce_at=_nowhere)
        running = asyncio.create_task(server.run())
        while server.bound_port is None:
            await asyncio.sleep(0.01)
        try:
            return await join(token_for(store, f"{LOOPBACK}:{server.bound_port}"), state_dir, "pc-1")
        finally:
            server.stop()
            await running

    return Joined(store, data_dir, state_dir, asyncio.run(join_once()))


async def _nowhere() -> tuple[list[str], str]:
    return [], "not announced in this test"


@pytest.fixture
def tarpits() -> Iterator[list[str]]:
    """Addresses that take a TCP connection and never answer it (a black-holed address, as a dial sees it)."""
    sockets = []
    for _ in range(3):
        listener = socket.socket()
        listener.bind((LOOPBACK, 0))
        listener.listen(8)
        sockets.append(listener)
    yield [f"{LOOPBACK}:{listener.getsockname()[1]}" for listener in sockets]
    for listener in sockets:
        listener.close()


def _agent(joined: Joined, found: list[str], monkeypatch: pytest.MonkeyPatch) -> AgentService:
    async def fake_find(fleet_id: str, controller_id: str, interfaces: list[str]) -> list[str]:
        return found

    monkeypatch.setattr(service_module, "find_controller", fake_find)
    return AgentService(AgentOptions(joined.data_dir, listen=f"{LOOPBACK}:{free_port()}"), monitor=FakeMonitor())


def _serving(joined: Joined, scenario: Callable[[str], Awaitable[Result]]) -> Result:
    """Run `scenario(address)` while the controller serves again, at a new address."""
    async def run() -> Result:
        server = FleetServer(joined.store, f"{LOOPBACK}:{free_port()}", announce_at=_nowhere)
        running = asyncio.create_task(server.run())
        while server.bound_port is None:
            await asyncio.sleep(0.01)
        try:
            return await scenario(f"{LOOPBACK}:{server.bound_port}")
        finally:
            server.stop()
            await running

    return asyncio.run(run())


def test_black_holed_addresses_in_an_announcement_do_not_stall_the_search(
        joined: Joined, tarpits: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The announced addresses were dialed one after another, each black-holed one costing link.OPEN_TIMEOUT_S
    # (10 s; MAX_ADDRESSES = 8 of them: 80 s without registering). They are dialed at once now.
    monkeypatch.setattr(link_module, "OPEN_TIMEOUT_S", 2.0)
    old = joined.membership.controller_addresses

    async def scenario(address: str) -> tuple[float, str | None]:
        agent = _agent(joined, [*tarpits, address], monkeypatch)
        started = time.monotonic()
        link = await agent._find_moved_controller()
        elapsed = time.monotonic() - started
        if link is not None:
            await link.close()
        return elapsed, None if link is None else link.address

    elapsed, address = _serving(joined, scenario)
    assert address is not None and address not in tarpits
    assert elapsed < 2.0
    assert Membership.load(joined.state_dir).controller_addresses == (address, *old)


def test_an_announcement_that_lists_a_membership_address_does_not_rewrite_membership_json(
        joined: Joined, monkeypatch: pytest.MonkeyPatch) -> None:
    # A controller listening on every interface restarts: its membership address fails for a moment, and the
    # announcement lists that address and another interface's. The other one was dialed and saved first, and the
    # agent said the controller no longer answered where it was all along.
    old = joined.membership.controller_addresses

    async def scenario(address: str) -> Link | None:
        agent = _agent(joined, [old[0], address], monkeypatch)
        link = await agent._find_moved_controller()
        if link is not None:
            await link.close()
        return link

    assert _serving(joined, scenario) is None  # the membership's address is the one to dial: not up yet here
    assert Membership.load(joined.state_dir).controller_addresses == old


def test_a_controller_that_refuses_the_link_is_not_searched_for(
        joined: Joined, monkeypatch: pytest.MonkeyPatch) -> None:
    # A refusal other than 403 (websockets answers 503 while a server shuts down) also comes after TLS proved
    # the pinned controller key: the controller is there, and a search could only move the agent elsewhere.
    searched: list[str] = []

    async def refused(address: str, *args: object, **kwargs: object) -> Link:
        raise LinkRefused(f"{address} refused the link: HTTP 503", 503)

    async def fake_find(fleet_id: str, controller_id: str, interfaces: list[str]) -> list[str]:
        searched.append(fleet_id)
        return []

    monkeypatch.setattr(service_module, "open_link", refused)
    monkeypatch.setattr(service_module, "find_controller", fake_find)
    agent = AgentService(AgentOptions(joined.data_dir, listen=f"{LOOPBACK}:{free_port()}"), monitor=FakeMonitor())

    register_for(agent, 1.5)
    assert searched == []


def test_a_search_that_raises_does_not_end_registration(
        joined: Joined, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async def broken_find(fleet_id: str, controller_id: str, interfaces: list[str]) -> list[str]:
        raise ValueError("what a hostile announcement might do")

    monkeypatch.setattr(service_module, "find_controller", broken_find)
    monkeypatch.setattr(service_module, "CONTROLLER_SEARCH_INTERVAL_S", 0.1)
    monkeypatch.setattr(service_module, "RETRY_MAX_S", 0.2)
    agent = AgentService(AgentOptions(joined.data_dir, listen=f"{LOOPBACK}:{free_port()}"), monitor=FakeMonitor())

    def failed_searches() -> int:
        return sum("search for the controller over mDNS failed" in record.getMessage() for record in caplog.records)

    async def scenario() -> None:
        # The second search comes after RETRY_MIN_S (1 s); a fixed 1.5 s run left a slow machine 0.5 s for the
        # rest. Registration runs until the second failed search is logged, and must still be running then.
        registering = asyncio.create_task(agent._register_forever())
        try:
            async with asyncio.timeout(60):
                while failed_searches() < 2:
                    assert not registering.done(), "registration ended after a search raised"
                    await asyncio.sleep(0.01)
            assert not registering.done()
        finally:
            registering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await registering

    asyncio.run(scenario())
    assert failed_searches() >= 2


def test_an_agent_of_one_ip_family_takes_the_announced_address_of_its_family(
        joined: Joined, monkeypatch: pytest.MonkeyPatch) -> None:
    # A controller of both families whose IPv6 address moved is announced at its old IPv4 address, a membership
    # address, and its new IPv6 one. An agent with IPv6 alone took the IPv4 one for the controller not having moved,
    # dialled it alone, and never registered again (from an exploratory test of a mixed IPv4/IPv6 office).
    old_ipv4 = "10.62.0.1:7341"
    replace(joined.membership, controller_addresses=(old_ipv4,)).save(joined.state_dir)
    monkeypatch.setattr(advertise, "interface_addresses", lambda: ["fd62::5"])  # this PC's LAN: IPv6 alone
    dialled: list[str] = []
    real_open_link = service_module.open_link

    async def open_link_here(address: str, *args: Any, **kwargs: Any) -> Link:
        dialled.append(address)
        if not address.startswith("[::1]:"):  # nothing leaves this machine, whatever the code under test does
            raise LinkError(f"cannot reach {address}: [Errno 101] Network is unreachable")
        return await real_open_link(address, *args, **kwargs)

    monkeypatch.setattr(service_module, "open_link", open_link_here)

    async def run() -> str | None:
        server = FleetServer(joined.store, f"[::1]:{free_port()}", announce_at=_nowhere)
        running = asyncio.create_task(server.run())
        while server.bound_port is None:
            await asyncio.sleep(0.01)
        try:
            agent = _agent(joined, [old_ipv4, f"[::1]:{server.bound_port}"], monkeypatch)
            link = await agent._find_moved_controller()
            if link is not None:
                await link.close()
            return None if link is None else link.address
        finally:
            server.stop()
            await running

    address = asyncio.run(run())
    assert address is not None and dialled == [address]  # the IPv4 address was not dialled at all
    assert Membership.load(joined.state_dir).controller_addresses == (address, old_ipv4)


def test_addresses_of_a_family_this_pc_has_none_of_are_not_dialled(monkeypatch: pytest.MonkeyPatch) -> None:
    # the families come from the LAN addresses: loopback has both on nearly every PC, and kept every address
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1"),
               SimpleNamespace(family=socket.AF_INET6, address="::1")],
        "eth0": [SimpleNamespace(family=socket.AF_INET, address="10.1.0.5"),
                 SimpleNamespace(family=socket.AF_INET6, address="fe80::5%2")]})
    assert advertise.dialable_here(["10.62.0.1:7341", "[fd62::99]:7341", "ctl.office.example:7341",
                                         "[::1]:7341"]) == ["10.62.0.1:7341", "ctl.office.example:7341", "[::1]:7341"]
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {"lo": [SimpleNamespace(family=socket.AF_INET,
                                                                                 address="127.0.0.1")]})
    assert advertise.dialable_here(["[fd62::99]:7341"]) == ["[fd62::99]:7341"]  # no LAN address yet: all
