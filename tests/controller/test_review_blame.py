"""A blame relayed through the chain is checked by the controller before the failover leaves a PC out for it.

Before, what a stage's Error named (within what its place in the chain allows) was left out of the next plan
on that stage's word: a PC that could not reach its next hop across a firewall had the healthy next hop left
out, and a buggy or hostile member could have an honest earlier stage left out, one failover at a time. Now
the re-plan's own survey weighs it: an accused PC that answers the controller and still hosts its stage is
kept, and an accusation of the reporter's own next hop keeps both, planned apart (the link between them is
broken: tests/controller/test_review_broken_links.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deskfleet.agent import core as agent_core
from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import Link, LinkError, TlsFiles, start_server
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.agent_state import AgentState
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.planner import Plan, PlanOptions, PlanPolicy
from deskfleet.common.wire import Precision, StageRef, StatusReport
from deskfleet.controller import fleet_failover
from deskfleet.controller.engine import Engine, StreamRequest
from deskfleet.controller.fleet_ca import add_removals, load_ca
from deskfleet.controller.fleet_deploy import (
    DeployError,
    DeployReport,
    DeploySettings,
    StagePlacement,
    deploy,
    footprint_of,
    model_id_of,
    plan_survey,
)
from deskfleet.controller.fleet_failover import FleetFailover
from deskfleet.controller.fleet_pipeline import ChainError, FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import AgentView, Survey, SurveyOptions, survey
from tests.agent.test_core import FakeMonitor
from tests.controller.test_fleet_deploy import local_tokens
from tests.controller.test_fleet_failover import NewChain
from tests.fleet_pki import make_member
from tests.ports import free_port

A, B, C = "a" * 52, "b" * 52, "c" * 52  # the agents of stages 0, 1 and 2
# free hops: the tiny model computes a token in less than a hop, so with hops priced one PC would take it all
FREE_HOPS = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.0)
CHAIN = tuple(StagePlacement(agent_id, f"10.0.0.{index}:7431", index, index + 1)
              for index, agent_id in enumerate((A, B, C)))


class _SurveyedLink:
    async def close(self) -> None:
        pass




def scripted_failover(store: FleetStore, model: Path, monkeypatch: pytest.MonkeyPatch,
                      answering: dict[str, bool], settings: DeploySettings | None = None,
                      planned: list[tuple[PlanOptions, Plan]] | None = None,
                      ) -> tuple[FleetFailover, list[frozenset[str]]]:
    """A failover whose survey finds the agents of `answering` (True: hosting its stage of CHAIN, False: hosting
    none) and whose deploy records whom it was told to leave out; it plans as a deploy does (with `settings`
    where given, else those of a model never deployed), recording the options and the plan in `planned`."""
    model_id = model_id_of(model)
    excluded: list[frozenset[str]] = []
    if settings is not None:
        monkeypatch.setattr(fleet_failover, "load_deploy_settings", lambda *args: settings)

    async def fake_survey(*args: object) -> Survey:
        agents = [AgentView(agent_id, "?", "-", ("peer",), StatusReport(
            AgentState.AVAILABLE, 8 << 30, 0.1, None, None, None, None,
            tuple(StageRef(model_id, stage.layer_start, stage.layer_end) for stage in CHAIN
                  if stage.agent_id == agent_id and hosting), None), None)
            for agent_id, hosting in answering.items()]
        return Survey(agents, {agent_id: _SurveyedLink() for agent_id in answering})  # type: ignore[misc]

    async def fake_deploy(store: FleetStore, model_dir: Path, found: Survey, options: PlanOptions,
                          precision: Precision, device: str, exclude: frozenset[str],
                          **kwargs: object) -> tuple[Plan, DeployReport]:
        excluded.append(exclude)
        result = plan_survey(footprint_of(load_manifest(model_dir), device, precision), found, options, exclude,
                             model_id=model_id)
        if planned is not None:
            planned.append((options, result))
        if not result.feasible:
            raise DeployError("the model does not fit the fleet: " + "; ".join(result.problems))
        return result, DeployReport(model_id, tuple(
            StagePlacement(stage.agent_id, "?", stage.first_layer, stage.stop_layer) for stage in result.stages),
            {}, {})

    monkeypatch.setattr(fleet_failover, "survey", fake_survey)
    monkeypatch.setattr(fleet_failover, "deploy", fake_deploy)
    monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
    return FleetFailover(store, model, max_failovers=2, notify=lambda text: None), excluded


def relayed(accused: str, reporter: str | None) -> ChainError:
    return ChainError("internal from the chain: next hop unreachable", accused, reporter, CHAIN)


# (who reported, whom it blamed, which agents answer the survey (True: still hosting), who is left out)
@pytest.mark.parametrize(("reporter", "accused", "answering", "left_out"), [
    # stage 0 cannot reach stage 1, the controller reaches both (a firewall between two desks): both stay, planned
    # apart (before that the reporter was left out, and before that the healthy accused)
    (A, B, {A: True, B: True, C: True}, set()),
    # the accused does not answer the controller either: it is gone
    (A, B, {A: True, C: True}, {B}),
    # a relayed blame of an earlier, healthy stage: the maker cannot be told, nobody is left out (before: the
    # honest stage 0 was)
    (C, A, {A: True, B: True, C: True}, set()),
    (B, A, {A: True, B: True, C: True}, set()),
    # the accused answers but lost its stage (restarted): kept, re-planned onto it; the reporter was right
    (A, B, {A: True, B: False, C: True}, set()),
    # a stage that gave its stages up blamed itself: taken at its word
    (B, B, {A: True, B: True, C: True}, {B}),
], ids=["firewall-between-two", "next-hop-gone", "relayed-by-last", "relayed-by-next", "next-hop-restarted",
        "gave-up-itself"])
def test_an_agents_blame_is_checked_against_the_survey_before_anyone_is_left_out(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, reporter: str, accused: str,
        answering: dict[str, bool], left_out: set[str]) -> None:
    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, answering)
    failover(relayed(accused, reporter))
    assert excluded == [frozenset(left_out)] and failover.lost == left_out
    replan = failover.replans[0]
    assert replan["blamed_agent"] == accused
    assert replan["lost_agent"] == (next(iter(left_out)) if left_out else None)


def test_the_log_says_why_the_reporter_and_the_pc_it_blamed_are_kept_apart(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failover, _ = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    told: list[str] = []
    failover.notify = told.append
    failover(relayed(B, A))
    assert len(told) == 1
    assert (f"agent {A[:12]} (stage 0) reported its next hop agent {B[:12]} (stage 1) at fault, but that agent "
            "answers the controller and still hosts its stage") in told[0]
    assert (f"so that link is marked broken for this run and the re-plan weighs both (never with agent {A[:12]} "
            f"directly before agent {B[:12]})") in told[0]
    assert told[0].startswith(f"the chain broke (internal from the chain: next hop unreachable); "
                              f"{failover.replans[0]['blame_check']}; re-planned in ")


def test_a_pc_whose_link_closed_but_that_answers_is_kept_once_per_run(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The controller saw stage 1's link close, and the survey finds the agent back (restarted, without its stage):
    # it is re-planned onto, not left out for the run. Breaking the chain again in the same run leaves it out.
    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: False, C: True})
    closed = ChainError(f"agent {B[:12]} (stage 1): the link closed", B, stages=CHAIN)
    failover(closed)
    assert "answers the controller, but no longer hosts its stage (restarted?): it is kept" in \
        str(failover.replans[0]["blame_check"])
    failover(closed)
    assert excluded == [frozenset(), frozenset({B})]
    assert "kept once already in this run: it is left out" in str(failover.replans[1]["blame_check"])
    failover.start_run()  # the next reply of a chat: a clean slate
    assert failover.kept == set() and failover.lost == set()


def test_a_pc_that_cannot_reach_its_next_hop_and_the_healthy_next_hop_serve_on_in_the_other_order(
        tmp_path: Path, store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two real agents on loopback; the first cannot dial the second (a firewall between the two desks), while the
    # controller reaches both. The run goes on over both, the second first (it can dial the first), with the
    # tokens of a local run.
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    ports = [free_port(), free_port()]
    addresses = tuple(f"127.0.0.1:{port}" for port in ports)
    dial = agent_core.open_link
    blocked: dict[str, str] = {}  # the agent that cannot dial -> the one it cannot dial

    async def firewalled_open_link(address: str, files: TlsFiles, *args: object, **kwargs: object) -> Link:
        if blocked.get(files.own_identity().agent_id) == kwargs.get("expected_agent_id"):
            raise LinkError(f"cannot connect to {address}: no route to host")
        return await dial(address, files, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(agent_core, "open_link", firewalled_open_link)
    told: list[str] = []

    def generate() -> tuple[list[int], FleetFailover]:
        with FleetFailover(store, tiny_export, 1, SurveyOptions(peers=addresses, discover_seconds=0),
                           notify=told.append) as failover, FleetPipeline.from_store(store, tiny_export) as chain:
            engine = Engine(chain, load_manifest(tiny_export).spec)
            engine.add(StreamRequest([1, 7, 9, 3], max_new_tokens=6, ignore_eos=True))
            return engine.run(recover=failover)[0].tokens, failover

    async def scenario() -> tuple[list[int], FleetFailover, tuple[StagePlacement, ...]]:
        servers = []
        for index, port in enumerate(ports):
            files = make_member(ca, tmp_path / f"agent{index}", "agent")
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor())
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
        found = await survey(store, SurveyOptions(peers=addresses, discover_seconds=0))
        try:
            _, report = await deploy(store, tiny_export, found, FREE_HOPS,
                                     Precision.F32, kv_cache="f32")
        finally:
            await found.close()
        assert len(report.stages) == 2
        blocked[report.stages[0].agent_id] = report.stages[1].agent_id
        try:
            return *await asyncio.to_thread(generate), report.stages
        finally:
            for server in servers:
                server.close()
                await server.wait_closed()

    tokens, failover, stages = asyncio.run(scenario())
    reporter, accused = (stage.agent_id for stage in stages)
    # before: the reporter was left out (and before that the accused), the run going on over one PC
    assert [replan["lost_agent"] for replan in failover.replans] == [None], told
    assert [[stage.agent_id for stage in chain.stages] for chain in failover.chains] == [[accused, reporter]]
    assert len(told) == 1 and f"reported its next hop agent {accused[:12]} (stage 1) at fault" in told[0]
    assert (f"the new chain keeps both: agent {accused[:12]} (stage 0) now comes before agent {reporter[:12]} "
            "(stage 1)") in told[0]
    assert failover.broken_links == {(reporter, accused)}
    assert tokens == local_tokens(tiny_export)


def test_a_blame_carries_who_reported_it_and_the_chain() -> None:
    error = ChainError("x", B, A, CHAIN)
    assert (error.agent_id, error.reported_by, error.stages) == (B, A, CHAIN)
    assert ChainError("no one at fault", None, A).reported_by is None  # no blame: no reporter of one
    assert ChainError(f"agent {B[:12]}: the link closed", B).reported_by is None  # the controller's own observation


def test_a_next_hop_removed_from_the_fleet_is_said_to_be_removed(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `fleet remove` during a run: the survey does not reach the removed PC, and the log said it "does not answer
    # the controller either", as of a PC that died.
    add_removals(store, [B])
    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, C: True})
    told: list[str] = []
    failover.notify = told.append
    failover(relayed(B, A))
    assert excluded == [frozenset({B})]
    assert f"; agent {B[:12]} was removed from the fleet: it is left out; re-planned in " in told[0]
