"""A PC of the deployed chain whose addresses changed while no run drove the model (a new DHCP lease, a rotated IPv6
address), found at the next run's start: the roster says when (`addresses_at`, fleet serve's), the deployment record
when its stages were assigned, and FleetFailover.rejoin re-plans, spending no failover, so that the stage before that
PC, and the driver, are given its new addresses.

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
from tests.controller.test_fleet_rejoin import ADMINS, EARLY, LATE, B, _registered
from tests.controller.test_fleet_stages_gone import fleet  # noqa: F401 (the fixture)

BEFORE = "2026-12-01T07:00:00+00:00"  # before the deploy assigned the stages (EARLY)


def _readdressed(store: FleetStore, agent_id: str, when: str) -> None:
    """The roster's addresses of `agent_id` changed at `when`, with no call-in (AddressesChanged)."""
    roster = store.roster()
    roster[agent_id] = replace(roster[agent_id], addresses=("10.0.0.23:7432",), addresses_at=when)
    store.save_roster(roster)


@pytest.fixture
def renumbered(store: FleetStore, fleet: dict[str, object]) -> dict[str, object]:  # noqa: F811
    """A and B deployed at EARLY, neither called in since; B's addresses changed at LATE."""
    _registered(store, B, BEFORE)
    _readdressed(store, B, LATE)
    return fleet


def test_a_pc_whose_addresses_changed_is_re_planned_for_at_the_runs_start_spending_no_failover(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object]) -> None:
    assert placed_pcs_readdressed(store, tiny_export) == ReaddressedSinceAssigned((B,), EARLY, (LATE,))
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    chain = failover.rejoin()
    assert chain is not None and chain.stages == ADMINS  # the same stages, assigned again with B's new addresses
    assert len(renumbered["surveys"]) == 1  # type: ignore[arg-type]  # the re-plan's own: no one asked about a stage
    assert notes == [f"agent bbbbbbbbbbbb on desk-b has other addresses than when the stages were assigned at "
                     f"2026-12-01 08:00:00 UTC (the chain on record gives the PC before it, and the driver, the old "
                     f"ones): re-planned in {failover.rejoined[0]['seconds']:.1f} s over 2 agent(s): aaaa -> bbbb"]
    assert failover.rejoined[0]["readdressed"] == [LATE]
    assert failover.replans == [] and failover._spent() == 0  # the run's whole budget: 0 re-plans of 0
    # the new deployment's stages were assigned after the change: the next run re-plans nothing
    assert placed_pcs_readdressed(store, tiny_export) is None
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin() is None


def test_a_change_before_the_stages_were_assigned_or_a_running_chain_re_plans_nothing(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object]) -> None:
    # a busy `serve --fleet` holds its chain's links open: its next break re-plans, if one comes
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin(running=True) is None
    _readdressed(store, B, BEFORE)  # what the deploy's survey knew already
    assert placed_pcs_readdressed(store, tiny_export) is None
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin() is None
    assert renumbered["surveys"] == [] and renumbered["deploys"] == []


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
    _readdressed(store, B, "2026-12-01T10:00:00+00:00")  # its addresses changed again
    assert placed_pcs_readdressed(store, tiny_export) == ReaddressedSinceAssigned(
        (B,), EARLY, ("2026-12-01T10:00:00+00:00",))
    assert len(renumbered["deploys"]) == 1  # type: ignore[arg-type]


def test_an_idle_run_holding_its_chain_open_opens_it_again_once_for_a_change(
        store: FleetStore, tiny_export: Path, renumbered: dict[str, object]) -> None:
    # `serve --fleet` between requests, `chat --fleet` between replies: the opening re-plans (rejoin), and the next
    # request's first step does not fail over on the gone address
    look = TakeBackLook(store, tiny_export)
    assert look() and not look()  # once for each change
    assert renumbered["surveys"] == []  # no dial: the roster and the record alone
    _readdressed(store, B, "2026-12-01T10:00:00+00:00")
    assert look()
