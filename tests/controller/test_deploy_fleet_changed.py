"""A deploy records nothing where, since its survey, the fleet was made anew or a PC of its plan removed (from an
exploratory test of commands at once on one data dir): `fleet init --force` ran while a deploy hashed its export and
surveyed, and the deploy then pushed over the old fleet's links and wrote its record, of PCs of no member, into the new
fleet's data dir; a `fleet remove` during the push left the removed PC's stage in the deployment on record."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.common import pki
from deskfleet.controller.fleet_ca import init_fleet, load_ca, remove_agent
from deskfleet.controller.fleet_deploy import DeployError, DeployReport, StagePlacement, _check_fleet_unchanged
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from tests.fleet_pki import make_member


def _fleet(tmp_path: Path) -> tuple[FleetStore, str, DeployReport]:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    agent_id = make_member(load_ca(store), tmp_path / "agent", "agent").own_identity().agent_id
    store.save_roster({agent_id: RosterEntry(agent_id, "pc-1", utc_now().isoformat(), ("127.0.0.1:2",))})
    report = DeployReport("m@1", (StagePlacement(agent_id, "127.0.0.1:2", 0, 4),), {}, {})
    return store, agent_id, report


def test_a_fleet_made_anew_during_the_deploy_is_named(tmp_path: Path) -> None:
    store, _, report = _fleet(tmp_path)
    surveyed = pki.fleet_id(store.tls_files.ca_certificate())
    _check_fleet_unchanged(store, report, surveyed)  # the same fleet: recorded
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now(), force=True)
    now = pki.fleet_id(store.tls_files.ca_certificate())
    with pytest.raises(DeployError, match=rf"^the fleet was made anew \(`deskfleet fleet init --force`: fleet {now}, "
                                          rf"was {surveyed}\) while this deploy ran, but the deployment could not be "
                                          "recorded: the PCs were told to release the stages again; deploy once the "
                                          "PCs have joined the new fleet$") as refused:
        _check_fleet_unchanged(store, report, surveyed)
    assert refused.value.failed_run
    _check_fleet_unchanged(store, report, None)  # a survey that did not say its fleet: not checked


def test_a_pc_removed_during_the_deploy_is_named_and_blamed(tmp_path: Path) -> None:
    store, agent_id, report = _fleet(tmp_path)
    fleet = pki.fleet_id(store.tls_files.ca_certificate())
    remove_agent(store, agent_id)
    with pytest.raises(DeployError, match=rf"^agent\(s\) {agent_id[:12]} were removed from the fleet \(`deskfleet "
                                          r"fleet remove`\) while this deploy ran, but the deployment could not be "
                                          "recorded") as refused:
        _check_fleet_unchanged(store, report, fleet)
    assert refused.value.agents == frozenset({agent_id})  # a run's re-plan leaves it out
