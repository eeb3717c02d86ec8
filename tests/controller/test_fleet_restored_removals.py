"""A controller data dir restored from a backup older than a removal learns of it again from the agents.

`fleet remove` writes the removal to revoked.json; the agents keep it, with the CA's signature, for good. A
backup made before the removal, restored, used to let the removed PC in again and tell every agent to forget
it. Now the agents keep it and give it back at registration, and `fleet serve` removes the PC again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.enroll import Membership, agent_tls_files, join
from deskfleet.agent.link import LinkError, open_link, utc_now
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentOptions, AgentService
from deskfleet.common import pki
from deskfleet.common.wire import KnownRemovals, Register
from deskfleet.controller.fleet_ca import Revocations, init_fleet, load_ca, remove_agent, restore_removals
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.agent.test_core import FakeMonitor
from tests.controller.test_fleet_ca import token_for
from tests.fleet_pki import make_ca
from tests.ports import LOOPBACK, free_address

DEADLINE_S = 30.0


@pytest.fixture
def store(tmp_path: Path) -> FleetStore:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    return store


def new_agent_id() -> str:
    return pki.agent_id_for_key(pki.create_private_key().public_key())


def test_only_removals_the_fleets_ca_signed_are_restored(store: FleetStore, tmp_path: Path) -> None:
    ca = load_ca(store)
    listed, lost, foreign = new_agent_id(), new_agent_id(), new_agent_id()
    store.write("revoked", [listed])
    update = Revocations(store).update()
    assert update.revoked_agent_ids == (listed,)
    pki.check_removal(ca.certificate, listed, update.signatures[0])  # what agents are told is signed
    signed = KnownRemovals((listed, lost), (pki.sign_removal(ca, listed), pki.sign_removal(ca, lost)))
    assert restore_removals(store, signed) == [lost]
    assert restore_removals(store, signed) == []  # already there
    assert Revocations(store)().agent_ids == {listed, lost}
    stranger = make_ca(tmp_path / "stranger")
    before = (store.data_dir / "revoked.json").read_bytes()
    genuine = new_agent_id()
    forged = KnownRemovals((genuine, foreign), (pki.sign_removal(ca, genuine), pki.sign_removal(stranger, foreign)))
    with pytest.raises(pki.PkiError, match=f"removal of agent {foreign[:12]} is not signed by this fleet's CA"):
        restore_removals(store, forged)
    with pytest.raises(pki.PkiError, match=f"removal of agent {lost[:12]} is not signed"):  # another id's signature
        restore_removals(store, KnownRemovals((lost,), (pki.sign_removal(ca, listed),)))
    assert (store.data_dir / "revoked.json").read_bytes() == before  # nothing added, not even the first


async def wait_until(what: str, condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            await asyncio.sleep(0.02)


async def _nowhere() -> tuple[list[str], str]:
    return [], "not announced in this test"


def test_a_restored_controller_removes_again_the_pcs_the_agents_know_were_removed(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async def no_search(fleet_id: str, controller_id: str, interfaces: list[str]) -> list[str]:
        return []

    monkeypatch.setattr(service_module, "find_controller", no_search)
    address = free_address()  # both runs of the controller listen here, as a restarted one would
    kept_dir, removed_dir = tmp_path / "kept", tmp_path / "removed"

    async def serving() -> tuple[FleetServer, asyncio.Task[None]]:
        server = FleetServer(store, address, announce_at=_nowhere)
        running = asyncio.create_task(server.run())
        await wait_until("the controller listening", lambda: server.bound_port is not None)
        return server, running

    async def scenario() -> str:
        server, running = await serving()
        await join(token_for(store, address), AgentPaths.resolve(kept_dir).state_dir, "pc-kept")
        removed: Membership = await join(token_for(store, address), AgentPaths.resolve(removed_dir).state_dir,
                                         "pc-removed")
        backup = {path.name: path.read_bytes() for path in store.data_dir.iterdir() if path.is_file()}
        agent = AgentService(AgentOptions(kept_dir, listen=free_address()), monitor=FakeMonitor())
        agent.bound_port = 7431
        registering = asyncio.create_task(agent._register_forever())
        try:
            await wait_until("the agent registered", lambda: agent.core.agent_id in server.live)
            remove_agent(store, "pc-removed")
            await wait_until("the agent told", lambda: agent.core.revocations().is_revoked(removed.agent_id))
            server.stop()
            await running
            for name, data in backup.items():  # the data dir restored from the backup made before the removal
                (store.data_dir / name).write_bytes(data)
            assert not Revocations(store)().is_revoked(removed.agent_id)

            server, running = await serving()
            await wait_until("the removal restored", lambda: Revocations(store)().is_revoked(removed.agent_id))
            removed_files = agent_tls_files(AgentPaths.resolve(removed_dir).state_dir)
            with pytest.raises(LinkError, match="403"):  # refused again
                await open_link(address, removed_files, expected_agent_id=removed.controller_id)
            assert agent.core.revocations().is_revoked(removed.agent_id)  # and the agent never forgot it
            server.stop()
            await running
            return removed.agent_id
        finally:
            registering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await registering
            await agent.core.close()

    removed_id = asyncio.run(scenario())
    assert any(record.getMessage().endswith(f"removed again: {removed_id[:12]}") for record in caplog.records)


def test_removals_a_member_did_not_get_from_the_ca_are_ignored_by_fleet_serve(
        store: FleetStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # An enrolled PC is trusted with its stages, not with who else is in the fleet.
    victim = new_agent_id()
    member_key = pki.create_private_key()

    async def scenario() -> None:
        server = FleetServer(store, free_address(), announce_at=_nowhere)
        running = asyncio.create_task(server.run())
        await wait_until("the controller listening", lambda: server.bound_port is not None)
        address = f"{LOOPBACK}:{server.bound_port}"
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")
        files = agent_tls_files(tmp_path / "agent")
        link = await open_link(address, files, expected_agent_id=membership.controller_id)
        await link.send(Register(membership.agent_id, ("127.0.0.1:7431",)))
        await link.receive()  # the controller's list
        forged = pki.sign_removal(pki.FleetCa(load_ca(store).certificate, member_key), victim)
        await link.send(KnownRemovals((victim,), (forged,)))
        await wait_until("the forgery logged", lambda: any("did not sign" in record.getMessage()
                                                           for record in caplog.records))
        assert not Revocations(store)().is_revoked(victim)
        assert membership.agent_id in server.live  # the link is kept: a fault, not a reason to drop the PC
        await link.close()
        server.stop()
        await running

    asyncio.run(scenario())
