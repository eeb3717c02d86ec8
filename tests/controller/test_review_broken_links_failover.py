"""A stage that cannot reach its next hop, while the controller reaches both, costs the fleet no PC: the failover
marks the link from the reporter to the accused broken for the run and re-plans with both, the reporter never
directly before the accused (PlanOptions.broken_links).

Before, the reporter was left out of the re-plan (a healthy PC lost to a firewall between two desks). Where no
chain over both does as well (both directions broken, and one PC holds the model), the planner leaves one out and
the verdict says which and why.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.planner import GB, ModelFootprint, Plan, PlanOptions, PlanPolicy
from deskfleet.common.wire import Precision, StageRef, StatusReport
from deskfleet.controller import fleet_deploy, fleet_failover
from deskfleet.controller.fleet_deploy import (
    DeployError,
    DeployReport,
    DeploySettings,
    StagePlacement,
    footprint_of,
    model_id_of,
    plan_survey,
)
from deskfleet.controller.fleet_failover import FailoverError, FleetFailover
from deskfleet.controller.fleet_pipeline import ChainError
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import AgentView, Survey
from tests.controller.test_fleet_failover import NewChain

A, B, C = "a" * 52, "b" * 52, "c" * 52
SPEEDS = {A: 3.0, B: 2.0, C: 1.0}  # weight GB/s as measured: the order by speed is A, B, C
FREE_HOPS = DeploySettings(PlanPolicy.ALL_BY_SPEED, hop_cost=0.0)  # every PC that answers takes a share


class _Link:
    async def close(self) -> None:
        pass


class Office:
    """The PCs a failover surveys (those of `answering`, each reporting the stages of `chain` it hosts) and deploys
    on: the deploy plans as a real one does and the PCs then host the new chain. Records each re-plan's options,
    whom it was told to leave out, and its plan."""

    def __init__(self, model: Path, answering: set[str], chain: tuple[StagePlacement, ...],
                 footprint: ModelFootprint | None = None) -> None:
        self.model, self.model_id = model, model_id_of(model)
        self.answering, self.chain, self.footprint = answering, chain, footprint
        self.options: list[PlanOptions] = []
        self.excluded: list[frozenset[str]] = []
        self.plans: list[Plan] = []

    def failover(self, store: FleetStore, monkeypatch: pytest.MonkeyPatch, told: list[str]) -> FleetFailover:
        monkeypatch.setattr(fleet_failover, "survey", self.survey)
        monkeypatch.setattr(fleet_failover, "deploy", self.deploy)
        monkeypatch.setattr(fleet_failover, "load_deploy_settings", lambda *args: FREE_HOPS)
        monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
        return FleetFailover(store, self.model, max_failovers=3, notify=told.append)

    async def survey(self, *args: object) -> Survey:
        agents = [AgentView(agent_id, "?", "-", ("peer",), StatusReport(
            AgentState.AVAILABLE, 8 << 30, 0.1, None, None, None, None,
            tuple(StageRef(self.model_id, stage.layer_start, stage.layer_end) for stage in self.chain
                  if stage.agent_id == agent_id), None, SPEEDS[agent_id]), None)
            for agent_id in sorted(self.answering)]
        return Survey(agents, {agent_id: _Link() for agent_id in self.answering})  # type: ignore[misc]

    async def deploy(self, store: FleetStore, model_dir: Path, found: Survey, options: PlanOptions,
                     precision: Precision, device: str, exclude: frozenset[str],
                     **kwargs: object) -> tuple[Plan, DeployReport]:
        self.options.append(options)
        self.excluded.append(exclude)
        footprint = self.footprint or footprint_of(load_manifest(model_dir), device, precision)
        result = plan_survey(footprint, found, options, exclude, model_id=self.model_id)
        self.plans.append(result)
        if not result.feasible:
            raise DeployError("the model does not fit the fleet: " + "; ".join(result.problems))
        self.chain = tuple(StagePlacement(stage.agent_id, "?", stage.first_layer, stage.stop_layer)
                           for stage in result.stages)
        return result, DeployReport(self.model_id, self.chain, {}, {})

    def order(self) -> list[str]:
        return [stage.agent_id for stage in self.chain]


def chain_of(*agents: str) -> tuple[StagePlacement, ...]:
    """The 4-layer tiny model over `agents` in this order, a layer each (the last takes the rest)."""
    return tuple(StagePlacement(agent_id, f"10.0.0.{index}:7431", index,
                                index + 1 if index + 1 < len(agents) else 4)
                 for index, agent_id in enumerate(agents))


def next_hop_unreachable(reporter: str, accused: str, chain: tuple[StagePlacement, ...]) -> ChainError:
    return ChainError("internal from the chain: next hop unreachable", accused, reporter, chain)


def test_a_next_hop_blame_of_a_pc_that_answers_keeps_both_and_plans_the_reporter_apart_from_it(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    office = Office(tiny_export, {A, B, C}, chain_of(A, B, C))
    told: list[str] = []
    failover = office.failover(store, monkeypatch, told)
    failover(next_hop_unreachable(A, B, office.chain))  # stage 0 cannot reach stage 1: a firewall between them
    assert office.excluded == [frozenset()] and failover.lost == set()  # before: {A}, a healthy PC lost
    assert office.options[0].broken_links == frozenset({(A, B)}) and failover.broken_links == {(A, B)}
    order = office.order()
    assert {A, B} <= set(order)  # both serve on
    assert (A, B) not in list(itertools.pairwise(order))
    replan = failover.replans[0]
    assert replan["lost_agent"] is None and replan["blamed_agent"] == B
    verdict = str(replan["blame_check"])
    assert (f"the link from {A[:12]} to {B[:12]} (a firewall or network fault between those two PCs), or agent "
            f"{A[:12]} itself, is at fault, so that link is marked broken for this run and the re-plan weighs "
            f"both (never with agent {A[:12]} directly before agent {B[:12]}); the new chain keeps both: ") in verdict
    assert verdict in told[0]
    # the next reply of a chat starts clean
    failover.start_run()
    assert failover.broken_links == set() and failover.kept == set()


def test_where_both_directions_broke_the_planner_leaves_one_out_and_the_verdict_says_which_and_why(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    office = Office(tiny_export, {A, B}, chain_of(A, B))
    told: list[str] = []
    failover = office.failover(store, monkeypatch, told)
    failover(next_hop_unreachable(A, B, office.chain))
    assert office.order() == [B, A]  # both kept, B first: B dials A
    assert "the new chain keeps both: agent " + B[:12] + " (stage 0) now comes before agent " + A[:12] + \
        " (stage 1)" in str(failover.replans[0]["blame_check"])
    failover(next_hop_unreachable(B, A, office.chain))  # and B cannot dial A either
    assert office.options[1].broken_links == frozenset({(A, B), (B, A)})
    assert office.excluded == [frozenset(), frozenset()] and failover.lost == set()
    assert office.order() == [A]  # one PC holds the tiny model: the faster one serves
    replan = failover.replans[1]
    assert replan["lost_agent"] == B  # left out by the planner, for the broken links
    verdict = str(replan["blame_check"])
    assert verdict.startswith(f"agent {B[:12]} (stage 0) reported its next hop agent {A[:12]} (stage 1) at fault")
    assert (f"; the new plan leaves agent {B[:12]} out (broken link: agent {A[:12]} cannot dial agent {B[:12]}, "
            f"agent {B[:12]} cannot dial agent {A[:12]} (a firewall or a network fault between them, or no IP family "
            "in common), and no chain "
            "that keeps it, with no PC dialling one it cannot reach, does as well as one without it)") in verdict


def test_a_pc_blamed_again_after_it_was_kept_is_left_out(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    office = Office(tiny_export, {A, B, C}, chain_of(A, B, C))
    failover = office.failover(store, monkeypatch, [])
    failover(next_hop_unreachable(A, B, office.chain))
    failover(ChainError(f"agent {B[:12]}: the link closed", B, stages=office.chain))  # the controller saw it fail
    assert office.excluded == [frozenset(), frozenset({B})] and failover.lost == {B}
    assert "kept once already in this run: it is left out" in str(failover.replans[1]["blame_check"])
    assert B not in office.order()


@pytest.mark.parametrize(("reporter", "accused", "left_out"), [
    (C, A, set()),  # relayed: the maker cannot be told, nobody is left out
    (B, B, {B}),  # a stage that gave its stages up, taken at its word
], ids=["relayed", "self-blame"])
def test_a_relayed_blame_or_a_self_blame_marks_no_link_broken(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, reporter: str, accused: str,
        left_out: set[str]) -> None:
    office = Office(tiny_export, {A, B, C}, chain_of(A, B, C))
    failover = office.failover(store, monkeypatch, [])
    failover(next_hop_unreachable(reporter, accused, office.chain))
    assert office.excluded == [frozenset(left_out)]
    assert office.options[0].broken_links == frozenset() and failover.broken_links == set()


def test_two_pcs_that_hold_the_model_only_together_and_cannot_dial_each_other_end_the_run_and_say_why(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # planned as a 10 GB model of 4 layers: half of it fits a PC's 8 GiB, not all of it
    office = Office(tiny_export, {A, B}, chain_of(A, B), ModelFootprint.uniform("big", 4, 2 * GB, GB, GB, 0, 1024))
    failover = office.failover(store, monkeypatch, [])
    failover(next_hop_unreachable(A, B, office.chain))
    assert office.order() == [B, A]
    with pytest.raises(FailoverError) as raised:
        failover(next_hop_unreachable(B, A, office.chain))
    message = str(raised.value)
    assert (f"so that link is marked broken for this run and the re-plan weighs both (never with agent {B[:12]} "
            f"directly before agent {A[:12]})") in message
    assert "the 2 usable agent(s) hold the model only in chains where a PC dials one it cannot reach" in message
    assert "lost agent" not in message and "lost PC" not in message  # both answer: no one was lost


@pytest.mark.parametrize(("now_at", "gone"), [
    (("10.0.0.41:7431",), True),  # its IPv4 lease moved: 10.0.0.21 went
    (("10.0.0.21:7431", "[fd00::21]:7431"), False),  # an address added: the one the reporter was given still there
], ids=["renumbered", "address-added"])
def test_a_next_hop_that_no_longer_registers_an_address_it_was_deployed_at_marks_no_link_broken(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, now_at: tuple[str, ...],
        gone: bool) -> None:
    # From an exploratory test of an office renumbering: a PC's IPv4 lease moved while a chain was deployed over it;
    # `fleet serve` knew its new address, but the stage before it had been given the old one, could not reach it, and
    # the failover marked the link between the two broken and moved stages apart (recompiled), for no fault of either
    office = Office(tiny_export, {A, B, C}, chain_of(A, B, C))
    store.save_roster({B: RosterEntry(B, "desk-b", "2026-12-01T08:00:00+00:00", ("10.0.0.21:7431",))})
    fleet_deploy._save_deployment(store, tiny_export, DeployReport(office.model_id, office.chain, {}, {}), FREE_HOPS)
    store.save_roster({B: RosterEntry(B, "desk-b", "2026-12-01T08:00:00+00:00", now_at)})
    told: list[str] = []
    failover = office.failover(store, monkeypatch, told)
    failover(next_hop_unreachable(A, B, office.chain))
    verdict = str(failover.replans[0]["blame_check"])
    assert office.excluded == [frozenset()] and failover.lost == set()
    if gone:
        assert failover.broken_links == set() and office.options[0].broken_links == frozenset()
        # not planned apart: A's stage is assigned again with B's new addresses, right before B
        assert (A, B) in list(itertools.pairwise(office.order()))
        assert (f"agent {B[:12]} on desk-b no longer registers 10.0.0.21:7431, which it did when the chain was "
                f"deployed, and agent {A[:12]} was given: both are kept, no link is marked broken, and the re-plan "
                "gives it the new addresses") in verdict
    else:  # a firewall between the two, as before
        assert failover.broken_links == {(A, B)} and "is marked broken for this run" in verdict
