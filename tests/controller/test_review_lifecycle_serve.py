"""`fleet serve` over days: an agent's registration while the controller's data dir cannot be written (its
disk full) or its roster is damaged, and an agent that registers again from a new address."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path

import pytest

from deskfleet.agent.enroll import agent_tls_files, join
from deskfleet.agent.link import Link, LinkError, open_link
from deskfleet.common.wire import Register, RevocationUpdate, StatusRequest
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import token_for, with_server


async def register(store: FleetStore, server: FleetServer, address: str, folder: Path,
                   listen: str) -> tuple[str, Link]:
    """Join (once per folder), then register as listening at `listen`; (agent id, the registration link)."""
    if not (folder / "membership.json").exists():
        await join(token_for(store, address), folder, "pc-1")
    files = agent_tls_files(folder)
    link = await open_link(address, files, expected_agent_id=None)
    agent_id = files.own_identity().agent_id
    await link.send(Register(agent_id, (listen,)))
    assert isinstance(await asyncio.wait_for(link.receive(), 5), RevocationUpdate)  # the server answered
    assert isinstance(await asyncio.wait_for(link.receive(), 5), StatusRequest)  # for the stages it holds
    return agent_id, link


def test_an_agent_registers_while_the_data_dir_is_full_and_its_link_is_kept(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Saving the roster raised in the connection handler: websockets logged a traceback, dropped the link with
    # 1011, and the agent retried (and was dropped) every 30 s for as long as the disk stayed full.
    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def scenario(server: FleetServer, address: str) -> None:
        await join(token_for(store, address), tmp_path / "agent", "pc-1")
        monkeypatch.setattr(store, "save_roster", full)
        agent_id, link = await register(store, server, address, tmp_path / "agent", "10.0.0.7:7431")
        assert agent_id in server.live
        with pytest.raises(TimeoutError):  # the link stays open: nothing closes it
            await asyncio.wait_for(link.receive(), 0.5)
        await link.close()

    caplog.set_level(logging.INFO)
    with_server(store, scenario)
    said = [record for record in caplog.records if "10.0.0.7:7431" in record.getMessage()
            and "cannot" in record.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0].getMessage(), [r.getMessage() for r in said]
    assert "agents.json" in said[0].getMessage()
    assert not [record for record in caplog.records if record.exc_info], "a traceback was logged"


def test_an_agent_registers_while_the_roster_is_damaged_and_its_link_is_kept(
        store: FleetStore, tmp_path: Path) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        await join(token_for(store, address), tmp_path / "agent", "pc-1")
        (store.data_dir / "agents.json").write_text("{")
        agent_id, link = await register(store, server, address, tmp_path / "agent", "10.0.0.7:7431")
        assert agent_id in server.live
        await link.close()

    with_server(store, scenario)


def test_an_agent_that_registers_again_from_a_new_address_is_recorded_there(
        store: FleetStore, tmp_path: Path) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        agent_id, dock = await register(store, server, address, tmp_path / "agent", "10.1.0.5:7431")
        assert store.roster()[agent_id].addresses == ("10.1.0.5:7431",)
        _, wifi = await register(store, server, address, tmp_path / "agent", "192.168.7.23:7431")
        assert store.roster()[agent_id].addresses == ("192.168.7.23:7431",)  # the old one is not dialled first
        with pytest.raises(LinkError):  # the older registration link is closed, not kept beside the new one
            for _ in range(10):
                await asyncio.wait_for(dock.receive(), 5)
        assert server.live[agent_id] is not None and len(server.live) == 1
        await wifi.close()

    with_server(store, scenario)
