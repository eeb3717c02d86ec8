"""A PC that can take stages again (its user resumed it, it was plugged in again) tells `fleet serve` so on its
registration link, and the next fleet run takes it back: before, a PC its user paused and resumed stayed out of
the chain a re-plan made without it until an admin's `fleet deploy` or the agent's restart.

The controller's side here (a real FleetServer, the roster, fleet_deploy.pcs_back); the agent's in
tests/agent/test_opt_out.py; the whole run in the integration fleet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from deskfleet.agent import link as link_module
from deskfleet.agent.link import Link, open_link, utc_now
from deskfleet.common.wire import AddressesChanged, Register, RevocationUpdate, Role
from deskfleet.controller import fleet_server
from deskfleet.controller.fleet_ca import load_ca
from deskfleet.controller.fleet_deploy import pcs_back
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from tests.controller.test_fleet_ca import with_server
from tests.controller.test_fleet_rejoin import ADMINS, _left_out_b_at
from tests.fleet_pki import make_member
from tests.log_records import records_of


def test_a_registered_agent_that_calls_in_again_is_back_for_the_next_run(
        store: FleetStore, tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_server, "CALL_IN_MIN_INTERVAL_S", 4.0)  # a call-in within 2 s is not heard
    member = make_member(load_ca(store), tmp_path / "agent-b", "agent")
    b = member.own_identity().agent_id
    other = make_member(load_ca(store), tmp_path / "agent-c", "agent")
    a = ADMINS[0].agent_id
    store.save_roster({agent_id: RosterEntry(agent_id, f"desk-{agent_id[0]}", utc_now().isoformat())
                       for agent_id in (a, b)})

    async def heard(within: float) -> bool:  # fleet serve writes the roster in batches, in a thread
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if pcs_back(store, tiny_export) is not None:
                return True
            await asyncio.sleep(0.05)
        return False

    async def scenario(server: FleetServer, address: str) -> None:
        link = await open_link(address, member, expected_agent_id=None)
        await link.send(Register(b, ("127.0.0.1:7432",)))
        assert isinstance(await asyncio.wait_for(link.receive(), 10), RevocationUpdate)
        registered = time.monotonic()
        # B registered, then a run's re-plan went on without it (its user paused it): not back yet
        _left_out_b_at(store, tiny_export, utc_now().isoformat(), left_out=b)
        assert pcs_back(store, tiny_export) is None
        await link.send(Register(b, ("127.0.0.1:7432",)))  # too soon after its registration: a member spamming
        assert not await heard(0.5)
        await asyncio.sleep(max(0.0, registered + 2.5 - time.monotonic()))
        # another agent's id on B's link is not B calling in
        await link.send(Register(other.own_identity().agent_id, ("127.0.0.1:7433",)))
        assert not await heard(0.5)
        await link.send(Register(b, ("127.0.0.1:7432",)))  # resumed: it calls in on the same link
        assert await heard(30.0)
        back = pcs_back(store, tiny_export)
        assert back is not None and back.agents == (b,)
        assert server.live[b] is not None  # the link stays up
        await link.close()

    with_server(store, scenario)


def test_an_agent_removed_after_its_handshake_is_not_registered(store: FleetStore, tmp_path: Path) -> None:
    # its Register 2 s after `fleet remove` was recorded (new addresses, a registered_at after the removal) and its
    # link lived until the revocation watcher's next look
    from deskfleet.agent.link import LinkError
    from deskfleet.controller.fleet_ca import remove_agent

    member = make_member(load_ca(store), tmp_path / "agent-d", "agent")
    agent_id = member.own_identity().agent_id
    store.save_roster({agent_id: RosterEntry(agent_id, "doomed", utc_now().isoformat())})

    async def scenario(server: FleetServer, address: str) -> None:
        link = await open_link(address, member, expected_agent_id=None)  # the handshake passed
        await asyncio.to_thread(remove_agent, store, "doomed")
        await link.send(Register(agent_id, ("127.0.0.1:7434",)))
        with pytest.raises(LinkError):
            while True:  # refused: an Error, then the close
                await asyncio.wait_for(link.receive(), 10)
        assert agent_id not in server.live

    with_server(store, scenario)
    assert store.roster().get(agent_id) is None or store.roster()[agent_id].addresses == ()


def test_an_agent_closing_a_spare_link_unused_is_not_said_to_have_failed_to_register(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an agent dials the controller's addresses at once and closes those that lose the race: after each restart of
    # fleet serve, one line said that a live agent "did not register" (exploratory test); a link that dies before
    # its Register still says so
    monkeypatch.setattr(fleet_server, "REGISTER_TIMEOUT_S", 0.5)
    member = make_member(load_ca(store), tmp_path / "agent-s", "agent")
    agent_id = member.own_identity().agent_id

    real_hello = link_module._hello
    hello_done = asyncio.Event()

    async def hello_then_cancelled(link: Link, *args: Any) -> None:  # the dial loses the race once both Hellos are in
        await real_hello(link, *args)
        if link.peer.role is Role.CONTROLLER:
            hello_done.set()
            await asyncio.Event().wait()

    async def scenario(server: FleetServer, address: str) -> None:
        spare = await open_link(address, member, expected_agent_id=None)  # opened, then closed unused
        await spare.close()
        await asyncio.sleep(0.2)
        monkeypatch.setattr(link_module, "_hello", hello_then_cancelled)
        dial = asyncio.create_task(open_link(address, member, expected_agent_id=None))
        await hello_done.wait()
        dial.cancel()  # as open_first cancels the dials still going once one opened
        with contextlib.suppress(asyncio.CancelledError):
            await dial
        monkeypatch.setattr(link_module, "_hello", real_hello)
        await asyncio.sleep(0.2)
        silent = await open_link(address, member, expected_agent_id=None)  # opens, then says nothing
        await asyncio.sleep(1.5)
        await silent.close()

    with records_of(fleet_server.log.name, logging.DEBUG) as records:
        with_server(store, scenario)
    said = [(record.levelno, record.getMessage()) for record in records.records
            if record.getMessage().startswith(f"agent {agent_id[:12]}")]
    unused = (logging.DEBUG, f"agent {agent_id[:12]} closed a link before registering on it (another of its dials "
                             "answered first, or it was stopping)")
    assert said == [unused, unused, (logging.INFO, f"agent {agent_id[:12]} did not register: timed out")]


def _recorded_at(store: FleetStore, agent_id: str, addresses: tuple[str, ...]) -> Callable[[float], Awaitable[bool]]:
    """Whether the roster lists `agent_id` at `addresses` within a time (fleet serve writes it in batches, in a
    thread)."""
    async def recorded(within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            entry = store.roster().get(agent_id)
            if entry is not None and entry.addresses == addresses:
                return True
            await asyncio.sleep(0.05)
        return False

    return recorded


def test_an_agent_whose_addresses_changed_is_recorded_there_and_not_taken_for_a_call_in(
        store: FleetStore, tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A rotated IPv6 address stayed in the roster until the PC's registration link dropped, and the stage before the
    # PC was given it (stop 63's dual-stack office). AddressesChanged replaces the roster's addresses; a Register would
    # have too, but as a call-in, which takes the PC back into runs that left it out
    monkeypatch.setattr(fleet_server, "ADDRESSES_CHANGED_MIN_INTERVAL_S", 2.0)
    member = make_member(load_ca(store), tmp_path / "agent-b", "agent")
    b = member.own_identity().agent_id
    store.save_roster({agent_id: RosterEntry(agent_id, f"desk-{agent_id[0]}", utc_now().isoformat())
                       for agent_id in (ADMINS[0].agent_id, b)})

    async def scenario(server: FleetServer, address: str) -> None:
        link = await open_link(address, member, expected_agent_id=None)
        registered = ("10.62.0.30:7431", "[fd62::30]:7431")
        await link.send(Register(b, registered))
        assert isinstance(await asyncio.wait_for(link.receive(), 10), RevocationUpdate)
        assert await _recorded_at(store, b, registered)(10.0)
        registered_at = store.roster()[b].registered_at
        _left_out_b_at(store, tiny_export, utc_now().isoformat(), left_out=b)  # a run's re-plan went on without B
        rotated = ("10.62.0.30:7431", "[fd62::3a]:7431")
        await link.send(AddressesChanged(rotated))
        written = time.monotonic()
        assert await _recorded_at(store, b, rotated)(10.0)
        assert store.roster()[b].registered_at == registered_at  # no call-in
        assert pcs_back(store, tiny_export) is None  # so no run takes B back for it
        assert server._live_at[b] == rotated
        # two more changes within 2 s (a member spamming agents.json, or changes a held-up link read at once): the
        # newest is written once the 2 s are up, not dropped (the agent says each change once)
        await link.send(AddressesChanged(("10.62.0.30:7431", "[fd62::3b]:7431")))
        newest = ("10.62.0.30:7431",)
        await link.send(AddressesChanged(newest))
        assert not await _recorded_at(store, b, newest)(max(0.0, written + 1.5 - time.monotonic()))
        assert await _recorded_at(store, b, newest)(10.0)
        assert time.monotonic() - written >= 1.9
        assert server.live.get(b) is not None  # the link stays up
        await link.close()

    with_server(store, scenario)


def test_the_old_link_of_an_agent_registering_again_does_not_write_its_addresses_over_the_new_ones(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # From a review: while a new link's registration waited for its batched write, the old link (the PC registered
    # again while the controller still held its dying link, or a clone of its disk) was still the live one, and its
    # address change was written after the registration, keeping the registration's time: the roster listed the old
    # link's addresses, `fleet serve` the new one's
    monkeypatch.setattr(fleet_server, "ROSTER_BATCH_S", 1.0)
    monkeypatch.setattr(fleet_server, "CALL_IN_MIN_INTERVAL_S", 0.2)  # the old link's call-in comes late enough
    member = make_member(load_ca(store), tmp_path / "agent-b", "agent")
    b = member.own_identity().agent_id
    store.save_roster({b: RosterEntry(b, "desk-b", utc_now().isoformat())})

    async def scenario(server: FleetServer, address: str) -> None:
        old = await open_link(address, member, expected_agent_id=None)
        await old.send(Register(b, ("10.0.0.1:7431",)))
        assert isinstance(await asyncio.wait_for(old.receive(), 10), RevocationUpdate)
        new = await open_link(address, member, expected_agent_id=None)
        registered = ("10.0.0.2:7431", "[fd00::2]:7431")
        await new.send(Register(b, registered))
        await asyncio.sleep(0.3)  # the new registration waits for its write; the old link is live meanwhile
        await old.send(AddressesChanged(("10.0.0.1:7431", "[fd00::1]:7431")))
        await old.send(Register(b, ("10.0.0.1:7431",)))  # nor is a call-in on it heard
        assert isinstance(await asyncio.wait_for(new.receive(), 10), RevocationUpdate)
        await asyncio.sleep(1.5)  # any write the old link's messages made has landed
        assert store.roster()[b].addresses == registered and server._live_at[b] == registered
        await new.close()

    with_server(store, scenario)


def test_a_registration_and_an_address_change_written_together_keep_the_registrations_time(
        store: FleetStore, tmp_path: Path) -> None:
    # one batched write of agents.json takes both: the registration's time is the call-in, whatever came after it
    member = make_member(load_ca(store), tmp_path / "agent-b", "agent")
    b = member.own_identity().agent_id
    store.save_roster({b: RosterEntry(b, "desk-b", "2026-01-01T00:00:00+00:00")})

    async def scenario(server: FleetServer, address: str) -> None:
        await asyncio.gather(server._record(b, ("10.62.0.30:7431",)),
                             server._record(b, ("10.62.0.31:7431",), registered=False))

    with_server(store, scenario)
    entry = store.roster()[b]
    assert entry.addresses == ("10.62.0.31:7431",) and entry.registered_at is not None


def test_an_address_change_of_an_agent_the_roster_lost_lists_it_without_a_call_in(
        store: FleetStore, tmp_path: Path) -> None:
    b = make_member(load_ca(store), tmp_path / "agent-b", "agent").own_identity().agent_id

    async def scenario(server: FleetServer, address: str) -> None:
        await server._record(b, ("10.62.0.31:7431",), registered=False)

    with_server(store, scenario)
    entry = store.roster()[b]
    assert (entry.hostname, entry.addresses, entry.registered_at) == ("?", ("10.62.0.31:7431",), None)
