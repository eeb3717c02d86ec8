"""A PC that a run's re-plan left out, back at the next run's start: the deployment record says which PCs the admin
deployed and when a run re-planned without some (fleet_deploy), pcs_back finds those that called in since, and
FleetFailover.rejoin re-plans to take them back before the chain opens (the whole run, with agents, in the
integration fleet)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.common import event_loop
from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import PlanOptions
from deskfleet.common.stop_signal import Stopped, StopSignal
from deskfleet.common.wire import Precision, StageRef, StatusReport
from deskfleet.controller import fleet_deploy, fleet_failover
from deskfleet.controller.fleet_deploy import (
    DeployReport,
    DeploySettings,
    NotPlaced,
    PcsBack,
    StagePlacement,
    load_deployment,
    model_id_of,
    pcs_back,
)
from deskfleet.controller.fleet_failover import FailoverError, FleetFailover
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import AgentView, Survey, SurveyOptions

A, B, C = "a" * 52, "b" * 52, "c" * 52
ADMINS = (StagePlacement(A, "127.0.0.1:7431", 0, 2), StagePlacement(B, "127.0.0.1:7432", 2, 4))
WITHOUT_B = (StagePlacement(A, "127.0.0.1:7431", 0, 4),)
EARLY, LATE = "2026-12-01T08:00:00+00:00", "2026-12-01T09:30:00+00:00"


def _save(store: FleetStore, model: Path, stages: tuple[StagePlacement, ...], replan: bool) -> None:
    """An admin's deploy (`replan` False) or a run's re-plan whose survey began now, saved."""
    fleet_deploy._save_deployment(store, model, DeployReport(model_id_of(model), stages, {}, {}), DeploySettings(),
                                  utc_now() if replan else None)


def _deployments(store: FleetStore) -> dict[str, dict[str, object]]:
    deployments = store.read("deployments", {})
    assert isinstance(deployments, dict)
    return deployments


def _record(store: FleetStore, model: Path) -> dict[str, object]:
    record = _deployments(store)[model_id_of(model)]
    assert isinstance(record, dict)
    return record


def _set_replanned_at(store: FleetStore, model: Path, when: object) -> None:
    deployments = _deployments(store)
    deployments[model_id_of(model)]["replanned_at"] = when
    store.write("deployments", deployments)


def _registered(store: FleetStore, agent_id: str, when: str | None) -> None:
    roster = store.roster()
    roster[agent_id] = RosterEntry(agent_id, f"desk-{agent_id[0]}", EARLY, ("127.0.0.1:7432",), when)
    store.save_roster(roster)


def _left_out_b_at(store: FleetStore, model: Path, replanned_at: str, left_out: str = B) -> None:
    """The admin deployed A and B (`left_out`); a run's re-plan went on without B at `replanned_at`."""
    _save(store, model, (ADMINS[0], replace(ADMINS[1], agent_id=left_out)), replan=False)
    _save(store, model, WITHOUT_B, replan=True)
    _set_replanned_at(store, model, replanned_at)


def test_an_admins_deploy_records_its_pcs_and_a_re_plan_keeps_them(store: FleetStore, tiny_export: Path) -> None:
    _save(store, tiny_export, ADMINS, replan=False)
    assert _record(store, tiny_export)["deployed_agents"] == [A, B]
    assert "replanned_at" not in _record(store, tiny_export)
    _save(store, tiny_export, WITHOUT_B, replan=True)
    record = _record(store, tiny_export)
    assert record["deployed_agents"] == [A, B]  # the admin's, not the re-plan's
    replanned = datetime.datetime.fromisoformat(str(record["replanned_at"]))
    assert abs((datetime.datetime.now(datetime.UTC) - replanned).total_seconds()) < 60
    _save(store, tiny_export, (StagePlacement(C, "127.0.0.1:7433", 0, 4),), replan=True)  # a second re-plan
    assert _record(store, tiny_export)["deployed_agents"] == [A, B]
    _save(store, tiny_export, (StagePlacement(C, "127.0.0.1:7433", 0, 4),), replan=False)  # the admin again
    assert _record(store, tiny_export)["deployed_agents"] == [C]
    assert "replanned_at" not in _record(store, tiny_export)


def test_a_re_plan_of_a_record_saved_before_deployed_agents_keeps_its_stages_pcs(store: FleetStore,
                                                                               tiny_export: Path) -> None:
    _save(store, tiny_export, ADMINS, replan=False)
    deployments = _deployments(store)
    del deployments[model_id_of(tiny_export)]["deployed_agents"]  # as an earlier release wrote it
    store.write("deployments", deployments)
    _save(store, tiny_export, WITHOUT_B, replan=True)
    assert _record(store, tiny_export)["deployed_agents"] == [A, B]


def test_a_pc_left_out_is_back_once_it_registers_after_the_re_plan(store: FleetStore, tiny_export: Path) -> None:
    _left_out_b_at(store, tiny_export, EARLY)
    assert pcs_back(store, tiny_export) is None  # never registered
    _registered(store, B, "2026-12-01T07:59:59+00:00")  # registered before the re-plan left it out: still gone
    assert pcs_back(store, tiny_export) is None
    _registered(store, B, LATE)
    assert pcs_back(store, tiny_export) == PcsBack((B,), EARLY, (B,))
    _registered(store, A, LATE)  # a PC the deployment places is not "back"
    assert pcs_back(store, tiny_export) == PcsBack((B,), EARLY, (B,))


def test_nothing_is_back_after_an_admins_deploy_or_in_a_record_that_cannot_be_read(store: FleetStore,
                                                                                     tiny_export: Path) -> None:
    assert pcs_back(store, tiny_export) is None  # never deployed
    _save(store, tiny_export, WITHOUT_B, replan=False)
    _registered(store, B, LATE)
    assert pcs_back(store, tiny_export) is None  # the admin deployed without B: B is not missed
    _left_out_b_at(store, tiny_export, EARLY)
    assert pcs_back(store, tiny_export) is not None
    for damaged in ("yesterday", "2026-12-05T08:00:00", 7, None):  # not a time, no time zone, not a string
        _set_replanned_at(store, tiny_export, damaged)
        assert pcs_back(store, tiny_export) is None
    _set_replanned_at(store, tiny_export, EARLY)
    _registered(store, B, "soon")
    assert pcs_back(store, tiny_export) is None
    store.write("deployments", [])
    assert pcs_back(store, tiny_export) is None


class _Link:
    async def close(self) -> None:
        pass


def _fleet_of(*agents: tuple[str, AgentState]) -> Survey:
    views = [AgentView(agent_id, f"desk-{agent_id[0]}", f"127.0.0.{index + 1}:7431", ("registration",),
                       StatusReport(state, 8 << 30, 0.1, None, None, None, None, (), None, weight_gb_per_s=5.0), None)
             for index, (agent_id, state) in enumerate(agents)]
    return Survey(views, {view.agent_id: _Link() for view in views})  # type: ignore[misc]


def test_a_deploy_for_pcs_back_sends_nothing_when_its_plan_leaves_them_out(store: FleetStore,
                                                                             tiny_export: Path) -> None:
    found = _fleet_of((A, AgentState.AVAILABLE), (B, AgentState.PAUSED))
    with pytest.raises(NotPlaced, match=r"the plan over the fleet leaves agent bbbbbbbbbbbb on desk-b out \(agent "
                                        r"bbbbbbbbbbbb on desk-b: .*paused"):
        event_loop.run(fleet_deploy.deploy(store, tiny_export, found, PlanOptions(), placing=frozenset({B})))
    assert not (store.data_dir / "deployments.json").exists()  # nothing assigned, nothing saved


class _Chain:
    def __init__(self, stages: tuple[StagePlacement, ...], *args: object, **kwargs: object) -> None:
        self.stages = stages
        self.num_stages = len(stages)

    def describe(self) -> str:
        return " -> ".join(stage.agent_id[:4] for stage in self.stages)

    def close(self) -> None:
        pass


@pytest.fixture
def b_is_back(store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """B was left out by a run's re-plan and has registered since; the survey finds A and B; deploys are recorded
    (what they were asked) and place both."""
    _left_out_b_at(store, tiny_export, EARLY)
    _registered(store, B, LATE)
    asked: list[dict[str, object]] = []

    async def both(store: FleetStore, options: SurveyOptions) -> Survey:
        asked.append({"recheck": options.recheck})
        return _fleet_of((A, AgentState.AVAILABLE), (B, AgentState.AVAILABLE))

    async def deploy(store: FleetStore, model: Path, found: Survey, options: PlanOptions, *args: object,
                     **kwargs: object) -> tuple[None, DeployReport]:
        asked.append(kwargs)
        _save(store, model, ADMINS, replan=kwargs.get("replanned_at") is not None)
        return None, DeployReport(model_id_of(model), ADMINS, {}, {})

    monkeypatch.setattr(fleet_failover, "survey", both)
    monkeypatch.setattr(fleet_failover, "deploy", deploy)
    monkeypatch.setattr(fleet_failover, "FleetPipeline", _Chain)
    return asked


def test_a_run_starts_by_re_planning_for_a_pc_that_is_back(store: FleetStore, tiny_export: Path,
                                                           b_is_back: list[dict[str, object]]) -> None:
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=1, notify=notes.append)
    chain = failover.rejoin()
    assert chain is not None and chain.stages == ADMINS
    # B was dialled with the short timeout: one that called in and went again must not hold the run up
    surveyed_at = b_is_back[1].pop("replanned_at")  # when its survey began: a registration after it is "back"
    assert isinstance(surveyed_at, datetime.datetime) and surveyed_at.tzinfo is not None
    assert b_is_back == [{"recheck": {B}}, {"exclude": frozenset(), "kv_cache": None, "lock_held": True,
                                            "placing": frozenset({B})}]
    assert failover._survey_options().recheck == frozenset()  # once that re-plan is over
    assert notes == [f"agent bbbbbbbbbbbb on desk-b called in since the re-plan at 2026-12-01 08:00:00 UTC that left "
                     f"it out: re-planned in {failover.rejoined[0]['seconds']:.1f} s over 2 agent(s): aaaa -> bbbb"]
    assert failover.rejoined == [{"agents": [B], "replanned_at": EARLY, "seconds": failover.rejoined[0]["seconds"],
                                  "stages": [[A, 0, 2], [B, 2, 4]]}]
    assert failover.replans == []  # not a failover
    assert load_deployment(store, tiny_export) == ADMINS and pcs_back(store, tiny_export) is None
    # the run's whole --max-failovers budget is left: a PC dropping out later is still re-planned around
    assert len(failover.chains) - failover.run_start + failover.failed_replans == 0


@pytest.mark.parametrize("called_in_since_lost", [True, False])
def test_a_running_server_takes_back_a_pc_it_lost_itself_once_it_called_in_since(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]], called_in_since_lost: bool) -> None:
    # a busy `serve --fleet` lost B in one of its own failovers (its user paused it) and asks to take it back while its
    # run goes on: B stayed in the run's lost PCs, so every plan left it out, however long it had been back
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=lambda text: None)
    failover._lose(B)
    failover._lost_at[B] = datetime.datetime.fromisoformat("2026-12-01T09:00:00+00:00" if called_in_since_lost
                                                           else "2026-12-01T10:00:00+00:00")  # B called in at 09:30
    failover.rejoin()
    deployed = b_is_back[-1]
    assert deployed["exclude"] == (frozenset() if called_in_since_lost else frozenset({B}))
    assert (B in failover.lost) is not called_in_since_lost


def test_a_run_goes_on_on_the_deployment_on_record_when_the_re_plan_for_a_pc_back_cannot_be_made(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def leaves_b_out(*args: object, **kwargs: object) -> None:
        raise NotPlaced("the plan over the fleet leaves agent bbbbbbbbbbbb on desk-b out (paused)")

    monkeypatch.setattr(fleet_failover, "deploy", leaves_b_out)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append)
    assert failover.rejoin() is None
    assert notes == ["agent bbbbbbbbbbbb on desk-b called in since the re-plan at 2026-12-01 08:00:00 UTC that left "
                     "it out, but the run goes on on the deployment on record: the plan over the fleet leaves agent "
                     "bbbbbbbbbbbb on desk-b out (paused)"]
    assert failover.rejoined[0]["stages"] == [] and "paused" in str(failover.rejoined[0]["problem"])
    assert failover.chains == [] and load_deployment(store, tiny_export) == WITHOUT_B
    assert failover._survey_options().recheck == frozenset()


def test_a_run_starts_on_the_deployed_chain_when_no_pc_is_back(store: FleetStore, tiny_export: Path,
                                                               b_is_back: list[dict[str, object]]) -> None:
    _registered(store, B, "2026-12-01T07:00:00+00:00")  # its last registration is older than the re-plan
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail)
    assert failover.rejoin() is None and failover.rejoined == [] and b_is_back == []  # nothing surveyed


def test_an_admins_deploy_since_the_re_plan_leaves_nothing_to_take_back(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]]) -> None:
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail)
    _save(store, tiny_export, (StagePlacement(C, "127.0.0.1:7433", 0, 4),), replan=False)  # without B: the admin's say
    assert failover.rejoin() is None and b_is_back == []


def test_a_deployment_another_run_saved_meanwhile_is_opened_as_it_is(store: FleetStore, tiny_export: Path,
                                                                      b_is_back: list[dict[str, object]]) -> None:
    # it may place none of the PCs back: "B called in ...: went on on the deployment saved meanwhile" read as if
    # B had been taken back; the run opens the newest deployment, as it would have, and the next run looks again
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail)
    _save(store, tiny_export, (StagePlacement(C, "127.0.0.1:7433", 0, 4),), replan=True)  # another run's re-plan
    _set_replanned_at(store, tiny_export, EARLY)
    assert failover.rejoin() is None and b_is_back == [] and failover.rejoined == []
    assert failover._known == (StagePlacement(C, "127.0.0.1:7433", 0, 4),)


def test_a_running_server_goes_on_on_a_deployment_another_run_saved_meanwhile(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]]) -> None:
    # mid-run, None kept the streams on the old chain, which that deployment had replaced: its next step broke, and the
    # failover then re-planned afresh instead of going on on the saved deployment (it was the run's "known" one)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append)
    saved = (StagePlacement(C, "127.0.0.1:7433", 0, 4),)
    _save(store, tiny_export, saved, replan=True)  # another run's re-plan
    _set_replanned_at(store, tiny_export, EARLY)
    chain = failover.rejoin(running=True)
    assert chain is not None and chain.stages == saved and failover.chains == [chain] and b_is_back == []
    assert notes == ["agent bbbbbbbbbbbb on desk-b called in since the re-plan at 2026-12-01 08:00:00 UTC that left "
                     "it out: the run goes on on the deployment saved meanwhile (a `fleet deploy`, or another run's "
                     "re-plan) over 1 agent(s): cccc"]


def test_a_running_servers_take_back_leaves_the_failovers_it_spent_spent(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]]) -> None:
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=lambda text: None)
    failover(fleet_failover.ChainError("agent cccccccccccc: the link closed", C))
    assert failover._spent() == 1
    _left_out_b_at(store, tiny_export, EARLY)  # the fixture's deploy placed B again: left out once more
    assert failover.rejoin(running=True) is not None
    assert failover._spent() == 1  # not a failure, nor a fresh budget


def test_a_pc_the_running_server_lost_and_forgave_once_already_is_left_to_the_next_run(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]]) -> None:
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail)
    failover._lose(B)
    failover._lost_at[B] = datetime.datetime.fromisoformat("2026-12-01T09:00:00+00:00")  # B called in at 09:30
    failover._forgiven.add(B)  # it flapped before in this run
    assert failover.rejoin(running=True) is None and b_is_back == []  # nothing surveyed, nothing deployed
    assert pcs_back(store, tiny_export) is not None  # nor noted as tried: the next run's start takes it back
    assert FleetFailover(store, tiny_export, max_failovers=2, notify=lambda text: None).rejoin() is not None


def test_a_running_servers_take_back_waits_for_a_deploy_under_way_a_few_seconds_only(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_failover, "RUNNING_LOCK_WAIT_S", 0.2)  # (a run's start: DEPLOY_LOCK_WAIT_S, 600 s)
    monkeypatch.setattr(fleet_failover, "_LOCK_POLL_S", 0.02)
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=lambda text: None)
    started = time.monotonic()
    with store.deploying():  # another deploy under way
        assert failover.rejoin(running=True) is None
    assert time.monotonic() - started < 30 and b_is_back == []
    assert failover._spent() == 0  # no credit: a deployment it saves breaks the chain as DeploymentReplaced, free


def test_the_rejoined_entry_is_in_generates_json_over_the_fleet(store: FleetStore, tiny_export: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller import chat

    class Rejoining:
        def __init__(self) -> None:
            self.replans: list[object] = []
            self.rejoined = [{"agents": [B]}]

    class Chain:
        num_stages = 2

    @contextlib.contextmanager
    def opened(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        yield Chain(), Rejoining()

    monkeypatch.setattr(chat, "open_fleet_chain", opened)
    monkeypatch.setattr(chat, "run_generate", lambda *args, **kwargs: {"tokens": [1]})
    report = chat.generate_on_fleet(type("Options", (), {"model": tiny_export, "draft": None,  # type: ignore[arg-type]
                                                         "prompt_lookup": False})(), store.data_dir)
    assert report["rejoined"] == [{"agents": [B]}] and report["fleet"] is True


def test_a_re_plan_for_a_pc_back_that_fails_is_no_failure_of_the_run(store: FleetStore, tiny_export: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # rejoin must never cost the run: a FailoverError (here the survey's; the export's check: exported again) is a note
    _left_out_b_at(store, tiny_export, EARLY)
    _registered(store, B, LATE)

    async def broken(*args: object, **kwargs: object) -> None:
        raise FailoverError("the survey failed")

    monkeypatch.setattr(FleetFailover, "_redeploy", lambda self, lock_held=False: broken())
    notes: list[str] = []
    assert FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append).rejoin() is None
    assert notes[0].endswith("the run goes on on the deployment on record: the survey failed")


def test_fleet_ls_says_which_pcs_a_re_plan_left_out_and_what_takes_them_back(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # the model ran on 1 of its 2 PCs with nothing in `fleet ls` to say so
    from deskfleet.controller import fleet_survey
    from deskfleet.controller.cli import main

    fleet_deploy._save_deployment(store, tiny_export, DeployReport(model_id_of(tiny_export), ADMINS, {}, {}),
                                  DeploySettings(precision=Precision.F32), None)
    fleet_deploy._save_deployment(store, tiny_export, DeployReport(model_id_of(tiny_export), WITHOUT_B, {}, {}),
                                  DeploySettings(precision=Precision.F32), utc_now())
    _set_replanned_at(store, tiny_export, EARLY)
    _registered(store, B, LATE)

    hosting = [True]

    async def survey(*args: object) -> Survey:
        found = _fleet_of((A, AgentState.SERVING), (B, AgentState.AVAILABLE))
        if hosting[0]:  # A hosts the stage the re-plan gave it
            found.agents[0] = replace(found.agents[0], report=replace(
                found.agents[0].report, stages=(StageRef(model_id_of(tiny_export), 0, 4),)))
        return found

    monkeypatch.setattr(fleet_survey, "survey", survey)
    assert main(["fleet", "ls", "--data-dir", str(store.data_dir), "--discover-seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert "no longer hosts" not in out, out
    assert (f"note: {model_id_of(tiny_export)} runs on 1 of the 2 PCs its `fleet deploy` placed: a run's re-plan at "
            "2026-12-01 08:00:00 UTC went on without agent bbbbbbbbbbbb on desk-b (available, called in since: the "
            "next run on the model takes it back if it can take work); `deskfleet fleet deploy --model "
            f"{tiny_export} --data-dir {store.data_dir} --precision f32` plans over every PC that answers") in out, out
    from deskfleet.controller import fleet_runs

    monkeypatch.setattr(fleet_runs, "others_driving", lambda store, model_id: 2)  # a run in flight leaves it be
    assert main(["fleet", "ls", "--data-dir", str(store.data_dir), "--discover-seconds", "0"]) == 0
    assert ("(available, called in since: the run that drives the model now, if it is the only one and a `serve "
            "--fleet` (when idle) or a chat (before its next message), else the first run that starts while none does "
            "(2 run(s) drive it now) takes it back if it can take work)") in capsys.readouterr().out
    hosting[0] = False  # A restarted since: it runs nothing, and the model on none of its PCs
    assert main(["fleet", "ls", "--data-dir", str(store.data_dir), "--discover-seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert (f"note: {model_id_of(tiny_export)} runs on 0 of the 2 PCs its `fleet deploy` placed (not on agent "
            "aaaaaaaaaaaa on desk-a, placed but no longer hosting its stage: see the note below): a run's re-plan at "
            ) in out, out
    assert f"note: {model_id_of(tiny_export)} has 1 deployed stage(s) that the PC it was assigned to no longer " \
           "hosts ([0:4] on agent aaaaaaaaaaaa on desk-a;" in out, out
    _registered(store, B, "2026-12-01T07:00:00+00:00")  # back, but it has not called in since: a deploy takes it
    assert main(["fleet", "ls", "--data-dir", str(store.data_dir), "--discover-seconds", "0", "--json"]) == 0
    err = capsys.readouterr().err
    assert ("went on without agent bbbbbbbbbbbb on desk-b (available, not called in since: taken back if its agent "
            "calls in (one its user resumed does, within a minute), else by the deploy below); `deskfleet fleet "
            "deploy") in err, err
    _save(store, tiny_export, ADMINS, replan=False)  # the admin deployed again: nothing left out
    assert main(["fleet", "ls", "--data-dir", str(store.data_dir), "--discover-seconds", "0"]) == 0
    assert "PCs its `fleet deploy` placed" not in capsys.readouterr().out  # (the fake PCs host no stage: noted)


def test_a_pc_removed_from_the_fleet_is_not_missed(store: FleetStore, tiny_export: Path) -> None:
    # `fleet remove` keeps it in the roster with its registration: every run surveyed the fleet for it, in vain
    _left_out_b_at(store, tiny_export, EARLY)
    _registered(store, B, LATE)
    assert pcs_back(store, tiny_export) is not None
    store.write("revoked", [B])
    assert pcs_back(store, tiny_export) is None
    assert fleet_deploy.left_out_by_replans(store) == []  # and `fleet ls` counts it no more


def test_a_pc_a_run_could_not_take_back_is_tried_again_only_after_it_registers_again(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # paused, short of memory, or gone again: every run surveyed the whole fleet for it (10 s for each PC that is off)
    async def leaves_b_out(*args: object, **kwargs: object) -> None:
        raise NotPlaced("the plan over the fleet leaves agent bbbbbbbbbbbb on desk-b out (paused)")

    monkeypatch.setattr(fleet_failover, "deploy", leaves_b_out)
    _registered(store, B, (datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=60)).isoformat())
    assert FleetFailover(store, tiny_export, max_failovers=2, notify=lambda note: None).rejoin() is None
    assert pcs_back(store, tiny_export) is None  # the next run opens the chain on record at once
    assert FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail).rejoin() is None
    _registered(store, B, (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=5)).isoformat())
    assert pcs_back(store, tiny_export) is not None  # it called in again: worth another try


def test_a_deploy_that_does_not_finish_in_time_leaves_the_run_its_first_failover_free(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_failover, "DEPLOY_LOCK_WAIT_S", 0.2)
    monkeypatch.setattr(fleet_failover, "_LOCK_POLL_S", 0.02)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    with contextlib.ExitStack() as other_deploy:
        other_deploy.enter_context(store.deploying())  # a long deploy under way: it may replace what the run opens
        assert failover.rejoin() is None
    assert b_is_back == [] and failover.rejoined[0]["problem"] == "the deploy under way did not finish in 0 s"
    assert notes == [f"agent bbbbbbbbbbbb on desk-b called in since the re-plan at 2026-12-01 08:00:00 UTC that left "
                     f"it out: the run waits for the deploy under way from {store.data_dir} (another run's, or a "
                     f"`fleet deploy`) to finish"]
    assert failover._spent() == -1
    chain = failover(fleet_failover.ChainError("agent aaaaaaaaaaaa: the link closed", A), opening=True)
    assert chain.stages == ADMINS  # re-planned (the fixture's deploy), --max-failovers 0 notwithstanding
    assert failover._spent() == 0 and pcs_back(store, tiny_export) is None  # the credit is spent, nothing is back


def test_the_deploy_lock_is_held_from_the_count_of_runs_to_the_end_of_the_re_plan(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # counted before the lock was taken, a run starting a moment after another's count opened the old chain, which
    # that one's deploy then replaced under it (1 of 12 pairs started together, in a walk)
    held_when: list[bool] = []

    def count(store: FleetStore, model_id: str) -> int:
        with contextlib.suppress(fleet_deploy.FleetStoreError):
            with store.deploying():
                held_when.append(False)
                return 0
        held_when.append(True)
        return 0

    monkeypatch.setattr(fleet_failover, "others_driving", count)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=lambda note: None)
    assert failover.rejoin() is not None
    assert held_when == [True] and len(b_is_back) == 2  # counted under the lock, then surveyed and deployed


def test_a_deploy_lock_that_cannot_be_opened_is_a_note(store: FleetStore, tiny_export: Path,
                                                       b_is_back: list[dict[str, object]]) -> None:
    from deskfleet.controller.fleet_store import DEPLOY_LOCK

    (store.data_dir / DEPLOY_LOCK).unlink(missing_ok=True)
    (store.data_dir / DEPLOY_LOCK).symlink_to(store.data_dir / "elsewhere")  # refused: a link
    notes: list[str] = []
    assert FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append).rejoin() is None
    assert b_is_back == [] and "the run goes on on the deployment on record: the lock file" in notes[0]


def test_a_new_chain_that_does_not_open_is_re_planned_around_without_costing_the_budget(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the record is the new chain by then: "goes on on the deployment on record" waited 30 s for the same chain
    opened: list[tuple[StagePlacement, ...]] = []

    class FailsOnce(_Chain):
        def __init__(self, stages: tuple[StagePlacement, ...], *args: object, **kwargs: object) -> None:
            opened.append(stages)
            if len(opened) == 1:
                raise fleet_failover.ChainError("agent bbbbbbbbbbbb: no answer", B)
            super().__init__(stages)

    monkeypatch.setattr(fleet_failover, "FleetPipeline", FailsOnce)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    chain = failover.rejoin()
    assert chain is not None and len(opened) == 2  # a failover's re-plan (B answers its survey: kept once)
    assert "the new chain did not open" in str(failover.rejoined[0]["problem"]) and failover._spent() == 0
    assert notes[-1].startswith("the deployed chain could not open (agent bbbbbbbbbbbb: no answer); ")


@pytest.mark.parametrize("failure", [OSError("the deploy lock could not be opened"),
                                     fleet_deploy.FleetStoreError("agents.json is damaged"),
                                     fleet_deploy.ManifestError("layer_002.bin is missing"),
                                     fleet_deploy.pki.PkiError("revoked.json is damaged")])
def test_no_error_of_the_re_plan_for_a_pc_back_ends_the_run(store: FleetStore, tiny_export: Path,
                                                            b_is_back: list[dict[str, object]],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            failure: Exception) -> None:
    async def fails(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(fleet_failover, "survey", fails)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    assert failover.rejoin() is None
    assert notes[0].endswith(f"the run goes on on the deployment on record: {failure}")
    assert failover._spent() == -1 and failover._credit == 1


def test_a_ctrl_c_during_the_re_plan_for_a_pc_back_is_in_the_report(store: FleetStore, tiny_export: Path,
                                                                    b_is_back: list[dict[str, object]],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    async def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fleet_failover, "survey", interrupted)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail)
    with pytest.raises(KeyboardInterrupt):
        failover.rejoin()
    assert failover.rejoined[0]["interrupted"] is True and failover.rejoined[0]["stages"] == []


def test_a_stop_cuts_short_a_take_backs_wait_for_a_deploy_under_way(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a closing serve --fleet waited on its engine's thread for the take-back's wait (and the 30 s close timeout)
    monkeypatch.setattr(fleet_failover, "_LOCK_POLL_S", 0.5)
    stop = StopSignal()
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=lambda text: None, stop=stop)
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with store.deploying(), pytest.raises(Stopped):  # another deploy under way: DEPLOY_LOCK_WAIT_S, 600 s
        failover.rejoin()
    assert time.monotonic() - started < 5 and b_is_back == []


def test_a_stop_during_the_re_plan_for_a_pc_back_is_in_the_report(store: FleetStore, tiny_export: Path,
                                                                  b_is_back: list[dict[str, object]],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    stop = StopSignal()

    async def stalled(*args: object, **kwargs: object) -> None:
        stop.set()  # as the server's close, from its thread
        await asyncio.sleep(30)  # a PC that does not answer its dial

    monkeypatch.setattr(fleet_failover, "survey", stalled)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=pytest.fail, stop=stop)
    started = time.monotonic()
    with pytest.raises(Stopped):
        failover.rejoin()
    assert time.monotonic() - started < 5
    assert failover.rejoined[0]["interrupted"] is True and failover.rejoined[0]["stages"] == []


def test_a_run_does_not_re_plan_under_another_runs_streams(store: FleetStore, tiny_export: Path,
                                                           b_is_back: list[dict[str, object]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # a long run in flight lost its stages to the re-plan of a run that started beside it (and failed over, twice);
    # the starting run's own deploy met the other's steps and failed partway
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: 1)
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    assert failover.rejoin() is None and b_is_back == []  # neither surveyed nor deployed
    assert notes == ["agent bbbbbbbbbbbb on desk-b called in since the re-plan at 2026-12-01 08:00:00 UTC that left "
                     "it out: it is taken back by a run that starts while no other drives the model (1 other run(s) "
                     "do now)"]
    assert pcs_back(store, tiny_export) is not None  # not a try: the next run that starts alone takes it back
    assert failover._spent() == 0  # nobody is deploying: the chain on record opens as it is


def test_a_run_beside_another_runs_start_that_takes_a_pc_back_waits_for_it(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # it stepped on the chain the other run's deploy was replacing: that deploy failed partway, and both runs ended
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: 1)
    monkeypatch.setattr(fleet_failover, "_LOCK_POLL_S", 0.02)
    other_deploy = contextlib.ExitStack()
    other_deploy.enter_context(store.deploying())  # the other run is taking B back right now

    def finish_it() -> None:
        time.sleep(0.3)
        _save(store, tiny_export, ADMINS, replan=True)  # B is placed again
        other_deploy.close()

    finisher = threading.Thread(target=finish_it)
    finisher.start()
    notes: list[str] = []
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=notes.append)
    began = time.monotonic()
    assert failover.rejoin() is None  # the run opens what the other saved
    finisher.join()
    assert time.monotonic() - began >= 0.25 and b_is_back == [] and failover.rejoined == []
    assert notes == [f"agent bbbbbbbbbbbb on desk-b called in since the re-plan at 2026-12-01 08:00:00 UTC that left "
                     f"it out: the run waits for the deploy under way from {store.data_dir} (another run's, or a "
                     f"`fleet deploy`) to finish"]
    assert failover._spent() == 0 and load_deployment(store, tiny_export) == ADMINS


def test_a_deploy_waited_for_that_ends_right_after_the_last_look_is_not_done_again(
        store: FleetStore, tiny_export: Path, b_is_back: list[dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the other run's deploy saved and let go of the lock between this run's look (B still wanted) and its next try
    # of the lock: it took the lock and went on as if nobody had taken B back (a loaded CI machine hit it)
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: 1)
    monkeypatch.setattr(fleet_failover, "_LOCK_POLL_S", 0.0)
    other_deploy = contextlib.ExitStack()
    other_deploy.enter_context(store.deploying())  # the other run is taking B back right now
    looks = 0
    real_pcs_back = fleet_failover.pcs_back

    def pcs_back(*args: object) -> object:
        nonlocal looks
        looks += 1
        back = real_pcs_back(*args)  # type: ignore[arg-type]
        if looks == 2:  # rejoin's own look, then the first look after waiting: B is still wanted, and right after
            _save(store, tiny_export, ADMINS, replan=True)  # B is placed again
            other_deploy.close()
        return back

    monkeypatch.setattr(fleet_failover, "pcs_back", pcs_back)
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=lambda note: None)
    assert failover.rejoin() is None
    assert looks == 3 and b_is_back == [] and failover.rejoined == []
    assert failover._spent() == 0 and load_deployment(store, tiny_export) == ADMINS


def test_fleet_ls_names_the_pcs_a_re_plan_moved_stages_to(store: FleetStore, tiny_export: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # a 1-PC deployment re-planned onto another PC read "runs on 0 of the 1 PCs its `fleet deploy` placed", as if
    # the model ran nowhere
    from deskfleet.controller import fleet_survey
    from deskfleet.controller.cli import main

    _save(store, tiny_export, (StagePlacement(A, "127.0.0.1:7431", 0, 4),), replan=False)
    _save(store, tiny_export, (StagePlacement(C, "127.0.0.1:7433", 0, 4),), replan=True)
    _registered(store, C, EARLY)

    async def survey(*args: object) -> Survey:
        found = _fleet_of((C, AgentState.SERVING))
        found.agents[0] = replace(found.agents[0], report=replace(
            found.agents[0].report, stages=(StageRef(model_id_of(tiny_export), 0, 4),)))  # C hosts its stage
        return found

    monkeypatch.setattr(fleet_survey, "survey", survey)
    assert main(["fleet", "ls", "--data-dir", str(store.data_dir), "--discover-seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert (f"note: {model_id_of(tiny_export)} runs on 0 of the 1 PCs its `fleet deploy` placed, and on agent "
            "cccccccccccc on desk-c, which it did not: a run's re-plan at ") in out, out
    assert "went on without agent aaaaaaaaaaaa (not found)" in out, out


def test_a_run_holding_its_chain_opens_it_again_once_for_each_call_in_of_a_pc_back(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the take-back look of `serve --fleet` and `chat --fleet` (TakeBackLook): where a reopening did not take the PC
    # back (a re-plan that left it out again noted; a deploy lock that could not be opened did not), the look said
    # "open again" every 10 s for ever, each time closing the chain and surveying the fleet
    driving = [0]
    monkeypatch.setattr(fleet_failover, "others_driving", lambda store, model_id: driving[0])
    look = fleet_failover.TakeBackLook(store, tiny_export)
    _left_out_b_at(store, tiny_export, EARLY)
    assert not look()  # B has not called in
    _registered(store, B, LATE)
    driving[0] = 1
    assert not look()  # another run drives the model: a re-plan would replace the stages under its streams
    driving[0] = 0
    with store.deploying():
        assert not look()  # a deploy under way: the opening would wait for it while requests queue
    assert look()
    assert not look()  # acted on: the next look waits for B's next call-in
    _registered(store, B, "2026-12-01T09:45:00+00:00")
    assert look()
