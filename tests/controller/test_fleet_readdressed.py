"""A PC of the deployed chain that no longer registers an address it did when the deployment was saved (a new DHCP
lease, a rotated IPv6 address, while no run drove the model), found at the next run's start: the record keeps where
its PCs registered (`roster_addresses`), the roster where they do now, and FleetFailover.rejoin re-plans, spending no
failover, so that the stage before that PC, and the driver, are given its new addresses.

From an exploratory test of a renumbered office: the chain on record gave the stage before the PC its old address,
whose dial timed out at the run's first step; the failover then marked the link between the two broken and moved the
stages apart (13-20 s of an 8-token run)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.controller import fleet_failover
from deskfleet.controller.fleet_deploy import DeployError, ReaddressedSinceAssigned, placed_pcs_readdressed
from deskfleet.controller.fleet_failover import FleetFailover, TakeBackLook
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_rejoin import ADMINS, EARLY, B, _registered
from tests.controller.test_fleet_stages_gone import _deployed, fleet  # noqa: F401 (the fixture)

BEFORE = "2026-12-01T07:00:00+00:00"  # B's registration, before the deploy (EARLY)
OLD, NEW = "127.0.0.1:7432", "10.0.0.23:7432"  # where B registered when deployed (_registered), and now


def _registers_at(store: FleetStore, agent_id: str, *addresses: str) -> None:
    """The roster's addresses of `agent_id` are now `addresses`, with no call-in (AddressesChanged)."""
    roster = store.roster()
    roster[agent_id] = replace(roster[agent_id], addresses=addresses)
    store.save_roster(roster)


@pytest.fixture
def renumbered(store: FleetStore, tiny_export: Path, fleet: dict[str, object]) -> dict[str, object]:  # noqa: F811
    """A and B deployed at EARLY while B registered at OLD; neither called in since; B now registers at NEW alone."""
    _registered(store, B, BEFORE)
    _deployed(store, tiny_export)  # again: the roster now lists where A and B registered
    _registers_at(store, B, NEW)
    return fleet


def test_a_pc_no_longer_at_an_address_it_was_deployed_at_is_re_planned_for_at_the_runs_start_spending_no_failover(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object]) -> None:
    assert placed_pcs_readdressed(store, tiny_export) == ReaddressedSinceAssigned((B,), EARLY, ((OLD,),), ((NEW,),))
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    chain = failover.rejoin()
    assert chain is not None and chain.stages == ADMINS  # the same stages, assigned again with B's new address
    assert len(renumbered["surveys"]) == 1  # type: ignore[arg-type]  # the re-plan's own: no one asked about a stage
    assert notes == [f"agent bbbbbbbbbbbb on desk-b no longer registers {OLD}, given to the PC before it and to the "
                     f"driver by the chain on record: re-planned in {failover.rejoined[0]['seconds']:.1f} s over 2 "
                     "agent(s): aaaa -> bbbb"]
    assert failover.rejoined[0]["addresses_gone"] == [OLD]
    assert failover.replans == [] and failover._spent() == 0  # the run's whole budget: 0 re-plans of 0
    # the new deployment keeps where B registers now: the next run re-plans nothing
    assert placed_pcs_readdressed(store, tiny_export) is None
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin() is None


def test_an_address_added_a_first_registration_or_a_running_chain_re_plans_nothing(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object]) -> None:
    # a busy `serve --fleet` holds its chain's links open: its next break re-plans, if one comes
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin(running=True) is None
    _registers_at(store, B, NEW, OLD)  # an address added (its IPv6 came up): the one the chain was given is there
    assert placed_pcs_readdressed(store, tiny_export) is None
    _registers_at(store, B)  # deployed before it ever registered (found by mDNS, or `--peer`)...
    _deployed(store, tiny_export)
    _registers_at(store, B, NEW)  # ... then its first registration: no address of the chain's went
    assert placed_pcs_readdressed(store, tiny_export) is None
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin() is None
    assert renumbered["surveys"] == [] and renumbered["deploys"] == []


def test_a_run_that_starts_while_others_drive_the_model_does_not_re_plan_under_their_streams(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    # unlike a stage gone, which their chain lacks too, the old address may still answer for them (from a review)
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: 1)
    notes: list[str] = []
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append).rejoin() is None
    assert renumbered["deploys"] == [] and "1 other run(s) do now" in notes[0]


def test_a_re_plan_for_a_change_that_failed_is_not_tried_again_until_the_pc_changes_again(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_fit(*args: object, **kwargs: object) -> object:
        renumbered["deploys"].append(kwargs)  # type: ignore[attr-defined]
        raise DeployError("the model does not fit the fleet")

    monkeypatch.setattr(fleet_failover, "deploy", no_fit)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    assert failover.rejoin() is None  # the run opens the chain on record
    assert "but the run goes on on the deployment on record: the model does not fit the fleet" in notes[0]
    assert failover._spent() == -1  # its first failover is free: the chain on record may well fail its first step
    assert placed_pcs_readdressed(store, tiny_export) is None  # the next runs do not re-plan for it at every start
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin() is None
    _registers_at(store, B, "10.0.0.33:7432")  # its addresses changed again
    assert placed_pcs_readdressed(store, tiny_export) == ReaddressedSinceAssigned(
        (B,), EARLY, ((OLD,),), (("10.0.0.33:7432",),))
    assert len(renumbered["deploys"]) == 1  # type: ignore[arg-type]


def test_an_idle_run_holding_its_chain_open_opens_it_again_once_for_a_change(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object]) -> None:
    # `serve --fleet` between requests, `chat --fleet` between replies: the opening re-plans (rejoin), and the next
    # request's first step does not fail over on the gone address
    look = TakeBackLook(store, tiny_export)
    assert look() and not look()  # once for each change
    assert renumbered["surveys"] == []  # no dial: the roster and the record alone
    _registers_at(store, B, "10.0.0.33:7432")
    assert look()
