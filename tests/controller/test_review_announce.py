"""Review of `fleet serve`'s mDNS announcement (FleetServer._announce_forever): a hostile announcement of its
name, and a stop that comes while the announcement is still probing.

mDNS runs on loopback only (see tests/agent/test_advertise.py for why that works here)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from deskfleet.agent import advertise
from deskfleet.agent.link import utc_now
from deskfleet.common.discovery_record import CONTROLLER_SERVICE_TYPE
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import free_port

LOOPBACK = "127.0.0.1"


@pytest.fixture
def store(tmp_path: Path) -> FleetStore:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    return store


async def _announce_on_loopback() -> tuple[list[str], str]:
    return [LOOPBACK], ""


def test_a_stranger_announcing_the_controllers_name_does_not_stop_fleet_serve(
        store: FleetStore, caplog: pytest.LogCaptureFixture) -> None:
    # The name is public (the controller id): anyone on the LAN could announce it first, and the controller's
    # probe then raised NonUniqueNameException (not an OSError) through the server's TaskGroup: `fleet serve` ended.
    name = f"{store.tls_files.own_identity().agent_id}.{CONTROLLER_SERVICE_TYPE}"

    async def scenario() -> bool:
        squatter = AsyncZeroconf(interfaces=[LOOPBACK])
        await (await squatter.async_register_service(AsyncServiceInfo(
            CONTROLLER_SERVICE_TYPE, name, addresses=[bytes([127, 0, 0, 1])], port=9, properties={"x": "y"},
            server="squatter.local.")))
        server = FleetServer(store, f"{LOOPBACK}:{free_port()}", announce_at=_announce_on_loopback)
        try:
            running = asyncio.create_task(server.run())
            while server.bound_port is None and not running.done():
                await asyncio.sleep(0.01)
            await asyncio.sleep(3.0)  # probing takes ~0.75 s
            serving = not running.done()
            server.stop()
            await running
        finally:
            await squatter.async_close()
        return serving

    with caplog.at_level(logging.WARNING, logger="deskfleet.controller.fleet_server"):
        assert asyncio.run(scenario())
    assert any("another host announces its name" in record.getMessage() for record in caplog.records)


def test_a_stop_while_the_announcement_probes_closes_its_sockets_and_a_later_one_says_goodbye(
        store: FleetStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # Cancelled inside Advertiser.start (the ~0.75 s of probing), the announcer left its AsyncZeroconf open:
    # its port 5353 sockets and transports leaked (ResourceWarning) each time `fleet serve` stopped that early.
    opened: list[AsyncZeroconf] = []

    class Recorded(AsyncZeroconf):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            opened.append(self)

    monkeypatch.setattr(advertise, "AsyncZeroconf", Recorded)

    async def serve_for(seconds: float) -> None:
        server = FleetServer(store, f"{LOOPBACK}:{free_port()}", announce_at=_announce_on_loopback)
        running = asyncio.create_task(server.run())
        while server.bound_port is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(seconds)
        server.stop()
        await running

    asyncio.run(serve_for(0.2))
    assert len(opened) == 1 and opened[0].zeroconf.done  # closed, though cancelled while probing

    removed = asyncio.Event()

    async def goodbye_seen() -> bool:
        listener = AsyncZeroconf(interfaces=[LOOPBACK])

        def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
            if state_change is ServiceStateChange.Removed:
                removed.set()

        browser = AsyncServiceBrowser(listener.zeroconf, CONTROLLER_SERVICE_TYPE, handlers=[on_change])
        try:
            await serve_for(2.0)
            async with asyncio.timeout(3):
                await removed.wait()
            return True
        finally:
            await browser.async_cancel()
            await listener.async_close()

    assert asyncio.run(goodbye_seen())
    assert all(zeroconf.zeroconf.done for zeroconf in opened)
