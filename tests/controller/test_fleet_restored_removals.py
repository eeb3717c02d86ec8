"""A controller data dir restored from a backup older than a removal learns of it again from the agents.

`fleet remove` writes the removal to revoked.json; the agents keep it, with the CA's signature, for good. A
backup made before the removal, restored, used to let the removed PC in again and tell every agent to forget
it. Now the agents keep it and give it back at registration, and `fleet serve` removes the PC again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import cast

import pytest

from deskfleet.agent.core import AgentCore
from deskfleet.agent.enroll import Membership, agent_tls_files, join
from deskfleet.agent.link import Link, LinkError, open_link, start_server
from deskfleet.agent.paths import AgentPaths, AgentSettings, Thresholds
from deskfleet.agent.service import AgentOptions, AgentService
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common import pki
from deskfleet.common.wire import Error, ErrorCode, KnownRemovals, Register, RevocationUpdate, Role
from deskfleet.controller import fleet_survey
from deskfleet.controller.fleet_ca import Revocations, load_ca, remove_agent, restore_removals
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import SurveyOptions, survey
from tests.agent.test_core import FakeMonitor, RecordingLink
from tests.controller.test_fleet_ca import token_for
from tests.fleet_pki import make_ca, make_member
from tests.log_records import records_of
from tests.ports import LOOPBACK, free_address, free_port

DEADLINE_S = 30.0


def new_agent_id() -> str:
    return pki.agent_id_for_key(pki.create_private_key().public_key())


def test_only_removals_the_fleets_ca_signed_are_restored(store: FleetStore, tmp_path: Path) -> None:
    ca = load_ca(store)
    listed, lost, foreign = new_agent_id(), new_agent_id(), new_agent_id()
    store.write("revoked", [listed])
    update = Revocations(store).update()
    assert update.agent_ids == (listed,)
    pki.check_removal(ca.certificate, listed, update.signatures[0])  # what agents are told is signed
    signed = KnownRemovals.of((listed, lost), (pki.sign_removal(ca, listed), pki.sign_removal(ca, lost)))
    assert restore_removals(store, signed, Revocations(store)()) == [lost]
    assert Revocations(store)().agent_ids == {listed, lost}
    # what is listed already is neither checked again nor written: a replayed message costs nothing
    replayed = KnownRemovals.of((listed, lost), (bytes(64), bytes(64)))
    before = (store.data_dir / "revoked.json").stat().st_mtime_ns
    assert restore_removals(store, replayed, Revocations(store)()) == []
    assert (store.data_dir / "revoked.json").stat().st_mtime_ns == before
    stranger = make_ca(tmp_path / "stranger")
    before_bytes = (store.data_dir / "revoked.json").read_bytes()
    genuine = new_agent_id()
    forged = KnownRemovals.of((genuine, foreign), (pki.sign_removal(ca, genuine), pki.sign_removal(stranger, foreign)))
    with pytest.raises(pki.PkiError, match=f"removal of agent {foreign[:12]} is not signed by this fleet's CA"):
        restore_removals(store, forged, Revocations(store)())
    assert (store.data_dir / "revoked.json").read_bytes() == before_bytes  # nothing added, not even the first
    with pytest.raises(pki.PkiError, match=f"removal of agent {genuine[:12]} is not signed"):  # another's signature
        restore_removals(store, KnownRemovals.of((genuine,), (pki.sign_removal(ca, listed),)), pki.RevocationSet())


async def wait_until(what: str, condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            await asyncio.sleep(0.02)


async def _nowhere() -> tuple[list[str], str]:
    return [], "not announced in this test"


async def serving(store: FleetStore, address: str) -> tuple[FleetServer, asyncio.Task[None]]:
    """`fleet serve` on `store` at `address`, listening; stop it with stopped()."""
    server = FleetServer(store, address, announce_at=_nowhere)
    running = asyncio.create_task(server.run())
    await wait_until("the controller listening", lambda: server.bound_port is not None)
    return server, running


async def stopped(server: FleetServer, running: asyncio.Task[None]) -> None:
    server.stop()
    await running


@contextlib.asynccontextmanager
async def registering(agent_dir: Path, prepare: Callable[[AgentService], None] | None = None
                      ) -> AsyncIterator[AgentService]:
    """The agent of `agent_dir` registering with its controller (again after each closed link) while the block
    runs; its own port is not opened (it says 7431). `prepare` is given the agent before it registers."""
    agent = AgentService(AgentOptions(agent_dir, listen=free_address()), monitor=FakeMonitor())
    agent.bound_port = 7431
    if prepare is not None:
        prepare(agent)
    task = asyncio.create_task(agent._register_forever())
    try:
        yield agent
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await agent.core.close()


@pytest.mark.usefixtures("no_controller_search")
def test_a_restored_controller_removes_again_the_pcs_the_agents_know_were_removed(
        store: FleetStore, tmp_path: Path) -> None:
    address = free_address()  # both runs of the controller listen here, as a restarted one would
    kept_dir, removed_dir = tmp_path / "kept", tmp_path / "removed"

    async def scenario() -> str:
        server, running = await serving(store, address)
        await join(token_for(store, address), AgentPaths.resolve(kept_dir).state_dir, "pc-kept")
        removed: Membership = await join(token_for(store, address), AgentPaths.resolve(removed_dir).state_dir,
                                         "pc-removed")
        backup = {path.name: path.read_bytes() for path in store.data_dir.iterdir() if path.is_file()}
        async with registering(kept_dir) as agent:
            await wait_until("the agent registered", lambda: agent.core.agent_id in server.live)
            remove_agent(store, "pc-removed")
            await wait_until("the agent told", lambda: agent.core.revocations().is_revoked(removed.agent_id))
            await stopped(server, running)
            for name, data in backup.items():  # the data dir restored from the backup made before the removal
                (store.data_dir / name).write_bytes(data)
            assert not Revocations(store)().is_revoked(removed.agent_id)

            server, running = await serving(store, address)
            await wait_until("the removal restored", lambda: Revocations(store)().is_revoked(removed.agent_id))
            removed_files = agent_tls_files(AgentPaths.resolve(removed_dir).state_dir)
            with pytest.raises(LinkError, match="403"):  # refused again
                await open_link(address, removed_files, expected_agent_id=removed.controller_id)
            assert agent.core.revocations().is_revoked(removed.agent_id)  # and the agent never forgot it
            await stopped(server, running)
            return removed.agent_id

    with records_of("deskfleet.controller") as logged:
        removed_id = asyncio.run(scenario())
    assert any(message.endswith(f"removed again: {removed_id[:12]}") for message in logged.messages())


def test_removals_a_member_did_not_get_from_the_ca_are_ignored_by_fleet_serve(
        store: FleetStore, tmp_path: Path) -> None:
    # An enrolled PC is trusted with its stages, not with who else is in the fleet.
    victim = new_agent_id()
    member_key = pki.create_private_key()

    async def scenario() -> None:
        server, running = await serving(store, free_address())
        address = f"{LOOPBACK}:{server.bound_port}"
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")
        files = agent_tls_files(tmp_path / "agent")
        link = await open_link(address, files, expected_agent_id=membership.controller_id)
        await link.send(Register(membership.agent_id, ("127.0.0.1:7431",)))
        await link.receive()  # the controller's list
        forged = pki.sign_removal(pki.FleetCa(load_ca(store).certificate, member_key), victim)
        await link.send(KnownRemovals.of((victim,), (forged,)))
        await wait_until("the forgery logged", lambda: any("did not sign" in message for message in logged.messages()))
        assert not Revocations(store)().is_revoked(victim)
        # and what it sends after is not even checked: a genuine removal (it was told one) is not taken from it
        genuine = new_agent_id()
        await link.send(KnownRemovals.of((genuine,), (pki.sign_removal(load_ca(store), genuine),)))
        await link.send(Error(ErrorCode.INTERNAL, "marker"))  # read after it, in order
        await wait_until("the marker logged", lambda: any("marker" in message for message in logged.messages()))
        assert not Revocations(store)().is_revoked(genuine)
        assert membership.agent_id in server.live  # the link is kept: a fault, not a reason to drop the PC
        await link.close()
        await stopped(server, running)

    with records_of("deskfleet.controller") as logged:
        asyncio.run(scenario())


def test_a_survey_of_a_restored_controller_learns_the_removals_and_lists_the_removed_pc_no_more(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `fleet ls`, `plan` and `deploy` run without `fleet serve`: a restored data dir's deploy must not pick the
    # removed PC (its neighbours refuse it, and the chain fails).
    monkeypatch.setattr(fleet_survey, "interface_addresses", lambda: [LOOPBACK])
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    cores = {}
    for name in ("kept", "removed"):
        files = make_member(ca, tmp_path / name, name)
        saved = tmp_path / name / "revoked.json"
        cores[name] = AgentCore(files, settings, ShardCache(tmp_path / name / "cache", 1 << 30), FakeMonitor(),
                                revocations_file=saved)
    removed_id = cores["removed"].agent_id
    (tmp_path / "kept" / "revoked.json").write_text(json.dumps({  # told before the backup was restored
        "revoked_agent_ids": [removed_id], "signatures": {removed_id: pki.sign_removal(ca, removed_id).hex()}}))
    cores["kept"] = AgentCore(cores["kept"].files, settings, cores["kept"].cache, FakeMonitor(),
                              revocations_file=tmp_path / "kept" / "revoked.json")
    ports = {name: free_port() for name in cores}
    store.save_roster({core.agent_id: RosterEntry(core.agent_id, f"pc-{name}", "2026-01-01T00:00:00+00:00",
                                                  (f"{LOOPBACK}:{ports[name]}",)) for name, core in cores.items()})

    async def scenario() -> list[str | None]:
        servers = [await start_server(core.serve_link, LOOPBACK, ports[name], core.files)
                   for name, core in cores.items()]
        try:
            found = await survey(store, SurveyOptions(discover_seconds=0))
            await found.close()
            return [agent.agent_id for agent in found.agents]
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    assert asyncio.run(scenario()) == [cores["kept"].agent_id]
    assert Revocations(store)().is_revoked(removed_id)


def test_an_agent_keeps_the_signature_it_holds_and_checks_only_new_ones(
        store: FleetStore, tmp_path: Path) -> None:
    # ECDSA signs anew each time: every controller process (each `fleet ls`) sends other signatures of the same
    # removals, and checking them all again cost every agent ~0.1 s of its event loop per 1,400 removals.
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    saved = tmp_path / "agent" / "revoked.json"
    core = AgentCore(make_member(ca, tmp_path / "agent", "agent"), settings,
                     ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor(), revocations_file=saved)
    held, new = new_agent_id(), new_agent_id()
    controller = cast(Link, RecordingLink(Role.CONTROLLER))
    asyncio.run(core.handle(controller, RevocationUpdate.of([held], [pki.sign_removal(ca, held)])))
    kept = saved.read_bytes()
    checked: list[str] = []
    real_check = pki.check_removal

    def counted(ca_certificate: object, agent_id: str, signature: bytes) -> None:
        checked.append(agent_id)
        real_check(ca_certificate, agent_id, signature)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pki, "check_removal", counted)
        asyncio.run(core.handle(controller, RevocationUpdate.of([held], [pki.sign_removal(ca, held)])))
        assert checked == [] and saved.read_bytes() == kept  # nothing new: nothing checked, nothing written
        asyncio.run(core.handle(controller, RevocationUpdate.of([held, new], [pki.sign_removal(ca, held),
                                                                             pki.sign_removal(ca, new)])))
    assert checked == [new] and core.revocations().agent_ids == {held, new}


def test_an_id_in_the_controllers_list_that_is_no_agent_id_is_named_with_the_file(store: FleetStore) -> None:
    store.write("revoked", ["PC-7 (the old laptop)"])
    with pytest.raises(pki.PkiError, match=r"revoked\.json lists 'PC-7 \(the old laptop\)', which is not an agent id"):
        Revocations(store)()


def test_an_error_an_agent_sends_fleet_serve_is_logged_on_one_printable_line_once_a_minute_a_kind(
        store: FleetStore, tmp_path: Path) -> None:
    # A stage's failure with no driver connected goes to `fleet serve`, which read nothing after Register.
    async def scenario() -> None:
        server, running = await serving(store, free_address())
        address = f"{LOOPBACK}:{server.bound_port}"
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")
        link = await open_link(address, agent_tls_files(tmp_path / "agent"), expected_agent_id=membership.controller_id)
        await link.send(Register(membership.agent_id, ("127.0.0.1:7431",)))
        await link.receive()  # the controller's list
        for _ in range(3):  # any enrolled PC can send these as fast as it likes: a warning once a minute a kind
            await link.send(Error(ErrorCode.INTERNAL, "stage 1 failed\nINFO forged line"))
        await link.send(Error(ErrorCode.NOT_ASSIGNED, "this agent hosts no stage"))
        await wait_until("the errors logged", lambda: sum("reports" in message for message in logged.messages()) == 4)
        await link.close()
        await stopped(server, running)

    with records_of("deskfleet.controller", logging.DEBUG) as logged:
        asyncio.run(scenario())
    lines = [(record.levelno, record.getMessage()) for record in logged.records if "reports" in record.getMessage()]
    said = " (said once a minute at most)"
    assert [level for level, _ in lines] == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.WARNING]
    assert lines[0][1].endswith(f"reports: internal: stage 1 failed?INFO forged line{said}")
    assert lines[1][1].endswith("reports: internal: stage 1 failed?INFO forged line")
    assert lines[3][1].endswith(f"reports: not_assigned: this agent hosts no stage{said}")


def test_a_member_whose_first_message_is_not_its_own_register_is_refused_and_named(
        store: FleetStore, tmp_path: Path) -> None:
    # fleet serve refused it without a word: a member posing as another PC left no trace
    posing = new_agent_id()

    async def scenario() -> None:
        server, running = await serving(store, free_address())
        address = f"{LOOPBACK}:{server.bound_port}"
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")
        files = agent_tls_files(tmp_path / "agent")
        for first in (Register(posing, ("127.0.0.1:7431",)), Register(posing, ("127.0.0.1:7431",)),
                      Error(ErrorCode.INTERNAL, "not a Register")):
            link = await open_link(address, files, expected_agent_id=membership.controller_id)
            await link.send(first)
            refusal = await link.receive()
            assert isinstance(refusal, Error) and "its own Register" in refusal.message
            with contextlib.suppress(LinkError):
                await link.receive()
        await stopped(server, running)
        assert membership.agent_id not in server.live

    with records_of("deskfleet.controller", logging.DEBUG) as logged:
        asyncio.run(scenario())
    lines = [(record.levelno, record.getMessage()) for record in logged.records if "not its own Register" in
             record.getMessage()]
    assert [level for level, _ in lines] == [logging.WARNING, logging.DEBUG, logging.WARNING], lines
    assert f"its first message was a Register as agent {posing[:12]}, not its own" in lines[0][1]
    assert "its first message was Error" in lines[2][1]
