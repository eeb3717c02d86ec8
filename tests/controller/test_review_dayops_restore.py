"""Day 2 on the controller's data dir: a copy restored from an older backup, and the controller moved to
another PC (another address). An agent that joined after the backup registered with the restored controller
and was filed as host '?' without a word; a removal made after the backup is lost (documented: remove
again), and an agent that re-joins with a token of the new address keeps its id."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from deskfleet.agent.enroll import Membership, agent_tls_files, join
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import token_for, with_server
from tests.controller.test_review_lifecycle_serve import register


def test_an_agent_enrolled_after_the_backup_is_named_when_it_registers(
        store: FleetStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backup = tmp_path / "backup"
    shutil.copytree(store.data_dir, backup)
    joined: list[str] = []

    async def enroll(server: FleetServer, address: str) -> None:
        await join(token_for(store, address), tmp_path / "late", "pc-late")
        joined.append(agent_tls_files(tmp_path / "late").own_identity().agent_id)

    with_server(store, enroll)
    assert store.roster()[joined[0]].hostname == "pc-late"
    shutil.rmtree(store.data_dir)
    shutil.copytree(backup, store.data_dir)  # the restore: the roster of the backup's day
    assert joined[0] not in store.roster()

    async def comes_back(server: FleetServer, address: str) -> None:
        _, link = await register(store, server, address, tmp_path / "late", "10.0.0.9:7431")
        await link.close()

    caplog.set_level(logging.INFO)
    with_server(store, comes_back)
    said = [record for record in caplog.records if joined[0][:12] in record.getMessage()
            and "agents.json" in record.getMessage()]
    assert said and said[0].levelno == logging.WARNING, [record.getMessage() for record in caplog.records]
    assert "restored from an older backup" in said[0].getMessage()
    assert store.roster()[joined[0]].addresses == ("10.0.0.9:7431",)  # still its certificate is the fleet's


def test_a_controller_moved_to_another_address_is_found_by_joining_again(store: FleetStore, tmp_path: Path) -> None:
    # What the README's move procedure relies on: a token carrying the new address; a PC that joins again
    # keeps its key, its id and its roster entry, and its membership names the new address.
    async def first(server: FleetServer, address: str) -> None:
        await join(token_for(store, address), tmp_path / "pc", "pc-1")

    with_server(store, first)
    before = Membership.load(tmp_path / "pc")
    moved = FleetStore(tmp_path / "new-pc")
    shutil.copytree(store.data_dir, moved.data_dir)

    async def again(server: FleetServer, address: str) -> None:
        assert address not in before.controller_addresses
        await join(token_for(moved, address), tmp_path / "pc", "pc-1")
        after = Membership.load(tmp_path / "pc")
        assert after.agent_id == before.agent_id and after.controller_addresses == (address,)
        _, link = await register(moved, server, address, tmp_path / "pc", "10.0.0.7:7431")
        await link.close()

    with_server(moved, again)
    roster = json.loads((moved.data_dir / "agents.json").read_text())["body"]
    assert list(roster) == [before.agent_id] and roster[before.agent_id]["hostname"] == "pc-1"


def test_joining_again_without_a_hostname_keeps_the_name_it_joined_with(store: FleetStore, tmp_path: Path) -> None:
    # The README's move procedure runs `deskfleet-agent join TOKEN` again, without --hostname: the admin's name for
    # the PC was replaced by the PC's own ("vm") in the roster and `fleet ls`.
    async def joins(server: FleetServer, address: str) -> None:
        await join(token_for(store, address), tmp_path / "pc", "pc-alice")
        await join(token_for(store, address), tmp_path / "pc")
        assert Membership.load(tmp_path / "pc").hostname == "pc-alice"
        assert store.roster()[agent_tls_files(tmp_path / "pc").own_identity().agent_id].hostname == "pc-alice"
        await join(token_for(store, address), tmp_path / "pc", "pc-bob")  # a name given wins

    with_server(store, joins)
    agent_id = agent_tls_files(tmp_path / "pc").own_identity().agent_id
    assert store.roster()[agent_id].hostname == "pc-bob" and Membership.load(tmp_path / "pc").hostname == "pc-bob"
