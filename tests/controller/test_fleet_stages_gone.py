"""A PC of the deployed chain that lost its stage while no run drove the model (paused and resumed, restarted), found
at the next run's start: the deployment record says when its stages were assigned (fleet_deploy), placed_pcs_called_in
names the PCs that called in since, and FleetFailover.rejoin asks only those whether they still host their stage and
re-plans for those that do not, spending no failover; TakeBackLook does the same for a run that holds its chain open
(the whole run, with agents, in the integration fleet).
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import PlanOptions
from deskfleet.common.wire import StageRef, StatusReport
from deskfleet.controller import fleet_deploy, fleet_failover
from deskfleet.controller.fleet_deploy import (
    CalledInSinceAssigned,
    DeployError,
    DeployReport,
    DeploySettings,
    load_deployment,
    model_id_of,
    note_hosting_checked,
    placed_pcs_called_in,
)
from deskfleet.controller.fleet_failover import FleetFailover
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import AgentView, Survey, SurveyOptions
from tests.controller.test_fleet_rejoin import ADMINS, EARLY, LATE, A, B, _Chain, _deployments, _Link, _registered
from tests.log_records import records_of

ASSIGNED = datetime.datetime.fromisoformat(EARLY)  # when the admin's deploy assigned the stages


def _deployed(store: FleetStore, model: Path, assigned_at: datetime.datetime = ASSIGNED) -> None:
    fleet_deploy._save_deployment(store, model, DeployReport(model_id_of(model), ADMINS, {}, {}), DeploySettings(),
                                  assigned_at=assigned_at)


def _record(store: FleetStore, model: Path) -> dict[str, object]:
    return _deployments(store)[model_id_of(model)]


def test_a_deploy_records_when_it_assigned_the_stages_and_which_pcs_called_in_since(
        store: FleetStore, tiny_export: Path) -> None:
    assert placed_pcs_called_in(store, tiny_export) is None  # never deployed
    _deployed(store, tiny_export)
    assert _record(store, tiny_export)["assigned_at"] == EARLY
    _registered(store, A, "2026-12-01T07:59:00+00:00")  # registered before its stage was assigned
    _registered(store, B, None)  # enrolled, never registered
    assert placed_pcs_called_in(store, tiny_export) is None
    _registered(store, B, LATE)
    called_in = placed_pcs_called_in(store, tiny_export)
    assert called_in == CalledInSinceAssigned((ADMINS[1],), EARLY, (LATE,))
    _registered(store, A, "2026-12-01T09:40:00+00:00")  # A calls in while a run asks B about its call-in
    note_hosting_checked(store, tiny_export, called_in)
    # B's call-in was asked about; A's was not, though it came before the ask was noted
    assert placed_pcs_called_in(store, tiny_export) == CalledInSinceAssigned((ADMINS[0],), EARLY,
                                                                             ("2026-12-01T09:40:00+00:00",))
    _registered(store, B, "2026-12-01T10:00:00+00:00")  # the next call-in is asked about again
    assert placed_pcs_called_in(store, tiny_export) == CalledInSinceAssigned(
        ADMINS, EARLY, ("2026-12-01T09:40:00+00:00", "2026-12-01T10:00:00+00:00"))
    # an ask noted against stages since assigned anew is not theirs
    _deployed(store, tiny_export, datetime.datetime.fromisoformat("2026-12-01T08:30:00+00:00"))
    note_hosting_checked(store, tiny_export, called_in)
    assert "hosting_checked" not in _record(store, tiny_export)
    # a save without a time given stamps now
    fleet_deploy._save_deployment(store, tiny_export, DeployReport(model_id_of(tiny_export), ADMINS, {}, {}),
                                  DeploySettings())
    stamped = datetime.datetime.fromisoformat(str(_record(store, tiny_export)["assigned_at"]))
    assert abs((datetime.datetime.now(datetime.UTC) - stamped).total_seconds()) < 60
    assert placed_pcs_called_in(store, tiny_export) is None


def test_a_record_older_than_assigned_at_counts_every_call_in_once_and_a_damaged_one_nothing(
        store: FleetStore, tiny_export: Path) -> None:
    _deployed(store, tiny_export)
    _registered(store, A, EARLY)
    _registered(store, B, LATE)
    for older in (None, "soon", 7):  # as an earlier release wrote it (no key), or damaged
        deployments = _deployments(store)
        if older is None:
            del deployments[model_id_of(tiny_export)]["assigned_at"]
        else:
            deployments[model_id_of(tiny_export)]["assigned_at"] = older
        store.write("deployments", deployments)
        called_in = placed_pcs_called_in(store, tiny_export)
        assert called_in == CalledInSinceAssigned(ADMINS, None, (EARLY, LATE))
    note_hosting_checked(store, tiny_export, called_in)
    assert placed_pcs_called_in(store, tiny_export) is None
    deployments = _deployments(store)
    deployments[model_id_of(tiny_export)]["hosting_checked"] = ["damaged"]
    store.write("deployments", deployments)
    assert placed_pcs_called_in(store, tiny_export) == called_in  # asked about by nobody, as far as can be read
    deployments = _deployments(store)
    deployments[model_id_of(tiny_export)]["stages"] = "two"
    store.write("deployments", deployments)
    assert placed_pcs_called_in(store, tiny_export) is None
    store.write("deployments", [])
    assert placed_pcs_called_in(store, tiny_export) is None


def _status(model_id: str, agent_id: str, state: AgentState, hosting: bool) -> StatusReport:
    stages = tuple(StageRef(model_id, stage.layer_start, stage.layer_end) for stage in ADMINS
                   if stage.agent_id == agent_id and hosting)
    return StatusReport(state, 8 << 30, 0.1, None, None, None, None, stages, None, weight_gb_per_s=5.0)


@pytest.fixture
def fleet(store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A and B deployed; B called in since. The survey answers with `fleet["answers"]` (agent id -> (state,
    hosting its stage of ADMINS)) and records the options it was given in `fleet["surveys"]`; deploys are recorded
    in `fleet["deploys"]` and place both."""
    _deployed(store, tiny_export)
    _registered(store, A, "2026-12-01T07:00:00+00:00")
    _registered(store, B, LATE)
    model_id = model_id_of(tiny_export)
    state: dict[str, object] = {"answers": {A: (AgentState.SERVING, True), B: (AgentState.AVAILABLE, False)},
                                "surveys": [], "deploys": []}

    async def survey(store: FleetStore, options: SurveyOptions) -> Survey:
        state["surveys"].append(options)  # type: ignore[attr-defined]
        answers: dict[str, tuple[AgentState, bool]] = state["answers"]  # type: ignore[assignment]
        views = [AgentView(agent_id, f"desk-{agent_id[0]}", "127.0.0.1:7431", ("registration",),
                           _status(model_id, agent_id, agent_state, hosting), None)
                 for agent_id, (agent_state, hosting) in answers.items()
                 if options.only is None or agent_id in options.only]
        return Survey(views, {view.agent_id: _Link() for view in views})  # type: ignore[misc]

    async def deploy(store: FleetStore, model: Path, found: Survey, options: PlanOptions, *args: object,
                     **kwargs: object) -> tuple[None, DeployReport]:
        state["deploys"].append(kwargs)  # type: ignore[attr-defined]
        report = DeployReport(model_id, ADMINS, {}, {})
        fleet_deploy._save_deployment(store, model, report, DeploySettings(), kwargs["replanned_at"])  # type: ignore[arg-type]
        return None, report

    monkeypatch.setattr(fleet_failover, "survey", survey)
    monkeypatch.setattr(fleet_failover, "deploy", deploy)
    monkeypatch.setattr(fleet_failover, "FleetPipeline", _Chain)
    return state


def test_a_pc_that_called_in_without_its_stage_is_re_planned_for_at_the_runs_start_spending_no_failover(
        store: FleetStore, tiny_export: Path, fleet: dict[str, object]) -> None:
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    chain = failover.rejoin()
    assert chain is not None and chain.stages == ADMINS
    asked = fleet["surveys"][0]  # type: ignore[index]
    # only the PC that called in is dialled, with the short timeout, and no mDNS browse
    assert asked.only == {B} and asked.recheck == {B} and asked.discover_seconds == 0
    assert len(fleet["surveys"]) == 2  # type: ignore[arg-type]  # then the re-plan's own survey
    (deployed,) = fleet["deploys"]  # type: ignore[misc]
    # any plan is better than the chain on record, which lacks B's stage: one that leaves B out too
    assert deployed["placing"] == frozenset() and deployed["exclude"] == frozenset()
    assert notes == [f"agent bbbbbbbbbbbb on desk-b no longer hosts its stage (it called in since the stage was "
                     f"assigned at 2026-12-01 08:00:00 UTC): re-planned in {failover.rejoined[0]['seconds']:.1f} s "
                     f"over 2 agent(s): aaaa -> bbbb"]
    assert failover.rejoined == [{"agents": [B], "assigned_at": EARLY, "seconds": failover.rejoined[0]["seconds"],
                                  "stages": [[A, 0, 2], [B, 2, 4]]}]
    assert failover.replans == [] and failover._spent() == 0  # the run's whole budget: 0 re-plans of 0
    # the new deployment's stages were assigned after the call-in: the next run asks nobody
    assert placed_pcs_called_in(store, tiny_export) is None
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=pytest.fail).rejoin() is None


def test_a_run_that_starts_during_the_re_plan_for_a_stage_gone_asks_too_and_opens_what_it_saved(
        store: FleetStore, tiny_export: Path, fleet: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    # the ask was noted before the re-plan: a run starting meanwhile opened the chain on record, which lacked the stage
    replanning = fleet_failover.deploy
    seen: list[object] = []

    async def deploy(*args: object, **kwargs: object) -> object:
        seen.append(placed_pcs_called_in(store, tiny_export))  # what a run that starts now finds
        return await replanning(*args, **kwargs)  # type: ignore[operator]

    monkeypatch.setattr(fleet_failover, "deploy", deploy)
    assert FleetFailover(store, tiny_export, max_failovers=0, notify=lambda text: None).rejoin() is not None
    assert seen == [CalledInSinceAssigned((ADMINS[1],), EARLY, (LATE,))]


def test_a_pc_left_out_that_is_not_taken_back_leaves_the_stages_of_the_chain_on_record_asked_about(
        store: FleetStore, tiny_export: Path, fleet: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    # PCs rebooted overnight: C, left out by yesterday's re-plan, and B of the chain on record. C waits while another
    # run drives the model; B's stage is gone for that run and this one alike.
    from tests.controller.test_fleet_rejoin import C

    deployments = _deployments(store)
    deployments[model_id_of(tiny_export)].update(replanned_at=EARLY, deployed_agents=[A, B, C])
    store.write("deployments", deployments)
    _registered(store, C, LATE)
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: 1)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    assert failover.rejoin() is not None
    assert [entry["agents"] for entry in failover.rejoined] == [[C], [B]]
    assert "1 other run(s) do now" in notes[0] and "no longer hosts its stage" in notes[1]


@pytest.mark.parametrize(("answers", "why"), [
    ({A: (AgentState.SERVING, True), B: (AgentState.SERVING, True)}, "still hosts it (a link that came back)"),
    ({A: (AgentState.SERVING, True), B: (AgentState.PAUSED, False)}, "paused again: the failover's business"),
    ({A: (AgentState.SERVING, True), B: (AgentState.UNAVAILABLE, False)}, "unavailable"),
    ({A: (AgentState.SERVING, True)}, "does not answer"),
], ids=["hosting", "paused", "unavailable", "silent"])
def test_a_pc_that_called_in_and_hosts_its_stage_or_cannot_take_one_is_asked_once_and_the_chain_opens(
        store: FleetStore, tiny_export: Path, fleet: dict[str, object],
        answers: dict[str, tuple[AgentState, bool]], why: str) -> None:
    fleet["answers"] = answers
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail)
    assert failover.rejoin() is None, why
    assert len(fleet["surveys"]) == 1 and fleet["deploys"] == []  # type: ignore[arg-type]
    assert failover.rejoined == [] and load_deployment(store, tiny_export) == ADMINS
    # asked once: the next run does not dial it again until it calls in again
    assert FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail).rejoin() is None
    assert len(fleet["surveys"]) == 1  # type: ignore[arg-type]


def test_a_stage_gone_is_re_planned_for_under_other_runs_too(store: FleetStore, tiny_export: Path,
                                                             fleet: dict[str, object],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # their chain lacks the stage as well: each would spend a failover on it, one at a time
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: 2)
    assert FleetFailover(store, tiny_export, max_failovers=2, notify=lambda text: None).rejoin() is not None
    assert len(fleet["deploys"]) == 1  # type: ignore[arg-type]


def test_a_re_plan_for_a_stage_gone_that_fails_leaves_the_run_its_first_failover_free(
        store: FleetStore, tiny_export: Path, fleet: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_plan(*args: object, **kwargs: object) -> None:
        raise DeployError("the model does not fit the fleet: too little memory")

    monkeypatch.setattr(fleet_failover, "deploy", no_plan)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    assert failover.rejoin() is None
    assert notes == ["agent bbbbbbbbbbbb on desk-b no longer hosts its stage (it called in since the stage was "
                     "assigned at 2026-12-01 08:00:00 UTC), but the run goes on on the deployment on record: the model "
                     "does not fit the fleet: too little memory"]
    # the chain on record lacks B's stage: the failover its first step costs is not the run's
    assert failover._spent() == -1
    record = _record(store, tiny_export)
    assert "rejoin_tried_at" not in record and record["hosting_checked"] == {B: LATE}  # asked about once


def test_a_survey_that_fails_leaves_the_chain_to_its_first_step(store: FleetStore, tiny_export: Path,
                                                                fleet: dict[str, object],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for failure in (OSError("too many open files"), RuntimeError("no interfaces")):
        async def fails(*args: object, failure: Exception = failure) -> None:
            raise failure

        monkeypatch.setattr(fleet_failover, "survey", fails)
        with records_of(fleet_failover.__name__, logging.WARNING) as logged:
            assert FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail).rejoin() is None
        assert any(f"whether they still host it: {failure}" in line for line in logged.messages())
    assert "hosting_checked" not in _record(store, tiny_export)  # the next run asks again


def test_a_run_holding_its_chain_opens_it_again_once_for_a_pc_of_the_chain_that_lost_its_stage(
        store: FleetStore, tiny_export: Path, fleet: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    # An idle `serve --fleet` (or a chat between replies) whose PC was paused and resumed: before, its next request's
    # first step found the stage gone and spent a failover on it. The look asks the PC that called in, and opens the
    # chain again where it lost its stage; the opening re-plans for it (FleetFailover.rejoin).
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: 1)  # a stage gone is gone for all
    look = fleet_failover.TakeBackLook(store, tiny_export)
    with store.deploying():
        assert not look()  # a deploy under way: the opening would wait for it while requests queue
    assert fleet["surveys"] == []
    # while streams run, the look dials no one (their next step finds the stage gone): no step waits on a dial
    assert not look.left_out_back() and fleet["surveys"] == []
    assert look()
    assert fleet["surveys"][0].only == {B}  # type: ignore[index]
    assert not look()  # acted on: the next look waits for B's next call-in
    assert len(fleet["surveys"]) == 1  # type: ignore[arg-type]
    _registered(store, B, "2026-12-01T10:00:00+00:00")
    assert look()


def test_a_pc_of_the_chain_that_called_in_with_its_stage_costs_the_run_holding_it_nothing(
        store: FleetStore, tiny_export: Path, fleet: dict[str, object]) -> None:
    # a link that came back, or `fleet serve` restarted (every agent registers again): reopened for it, a chat fed its
    # whole conversation again
    fleet["answers"] = {A: (AgentState.SERVING, True), B: (AgentState.SERVING, True)}
    look = fleet_failover.TakeBackLook(store, tiny_export)
    assert not look() and len(fleet["surveys"]) == 1  # type: ignore[arg-type]
    assert not look() and len(fleet["surveys"]) == 1  # type: ignore[arg-type]
    assert placed_pcs_called_in(store, tiny_export) is None  # noted: the runs that start next ask nobody
