"""Review of 52126be (signed removals): a fleet's list of removed agents, signed id by id, outgrew the codec's
256 KB header at ~1410 removals as JSON (ids alone fitted ~4760), and removals can no longer be pruned. The
list now travels as bytes outside the header: 5000 removals, past either limit, reach the agent."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from deskfleet.agent.enroll import agent_tls_files, join
from deskfleet.agent.link import open_link
from deskfleet.common.wire import Register, RevocationUpdate, StatusRequest
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import token_for
from tests.controller.test_fleet_restored_removals import serving, stopped
from tests.ports import LOOPBACK, free_address

_BASE32 = "abcdefghijklmnopqrstuvwxyz234567"


def some_agent_ids(count: int) -> list[str]:
    return ["".join(secrets.choice(_BASE32) for _ in range(52)) for _ in range(count)]


async def _registered(store: FleetStore, server: FleetServer, folder: Path):  # -> (link, first message)
    address = f"{LOOPBACK}:{server.bound_port}"
    membership = await join(token_for(store, address), folder, "pc-1")
    link = await open_link(address, agent_tls_files(folder), expected_agent_id=membership.controller_id)
    await link.send(Register(membership.agent_id, ("127.0.0.1:7431",)))
    first = await asyncio.wait_for(link.receive(), 10)
    if isinstance(first, RevocationUpdate):  # then fleet serve asks for the stages the PC holds
        assert isinstance(await asyncio.wait_for(link.receive(), 10), StatusRequest)
    return link, first


def test_review_signed_removals_an_agent_registers_with_a_fleet_of_5000_removals(
        store: FleetStore, tmp_path: Path) -> None:
    # 1420 ids with a 128-character hex signature each made a 264 KB header that encode() refused (ProtocolError,
    # not LinkError): the registration handler died and the agent never got the list.
    store.write("revoked", sorted(some_agent_ids(5000)))

    async def scenario() -> None:
        server, running = await serving(store, free_address())
        try:
            link, first = await _registered(store, server, tmp_path / "agent")
            assert isinstance(first, RevocationUpdate) and len(first.agent_ids) == 5000
            await link.close()
        finally:
            await stopped(server, running)

    asyncio.run(scenario())


def test_review_signed_removals_fleet_serve_survives_its_list_growing_past_5000(
        store: FleetStore, tmp_path: Path) -> None:
    # The watcher's link.send raised the same ProtocolError, which ended the watcher's TaskGroup: `fleet serve` exited.
    store.write("revoked", sorted(some_agent_ids(4800)))

    async def scenario() -> None:
        server, running = await serving(store, free_address())
        try:
            link, first = await _registered(store, server, tmp_path / "agent")
            assert isinstance(first, RevocationUpdate)
            store.write("revoked", sorted({*first.agent_ids, *some_agent_ids(400)}))  # `fleet remove` x400
            told = await asyncio.wait_for(link.receive(), 10)
            assert isinstance(told, RevocationUpdate) and len(told.agent_ids) == 5200
            assert not running.done()
            await link.close()
        finally:
            await stopped(server, running)

    asyncio.run(scenario())
