"""FleetFailover's limits and the deploy settings it re-plans with (the re-plan itself runs in
test_fleet_deploy.py and, with a PC switched off mid-generation, in the integration fleet)."""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.common import event_loop
from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import SEE_LEFT_OUT, ExclusionReason, PlanPolicy
from deskfleet.common.stop_signal import Stopped, StopSignal
from deskfleet.common.wire import Precision, StatusReport
from deskfleet.controller import fleet_deploy, fleet_failover, fleet_pipeline
from deskfleet.controller.chat import add_fleet_option
from deskfleet.controller.fleet_deploy import (
    DeployError,
    DeployReport,
    DeploySettings,
    StagePlacement,
    load_deploy_settings,
    load_deployment,
    model_id_of,
)
from deskfleet.controller.fleet_failover import FailoverError, FleetFailover
from deskfleet.controller.fleet_pipeline import ChainError
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import AgentView, Survey


class NewChain:
    """Stands for the FleetPipeline a failover opens (no agents behind it)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.num_stages, self.stages = 1, ()

    def describe(self) -> str:
        return "a new chain"

    def close(self) -> None:
        pass

def test_no_failover_allowed_gives_up_at_once_and_remembers_the_agent(store: FleetStore, tiny_export: Path) -> None:
    failover = FleetFailover(store, tiny_export, max_failovers=0)
    with pytest.raises(FailoverError, match=r"agent abc.*gave up: 0 re-plan\(s\) .*--max-failovers 0"):
        failover(ChainError("agent abc (stage 1) at 10.0.0.2:7431: the link closed", "abc" * 17))
    assert failover.lost == {"abc" * 17} and failover.chains == [] and failover.replans == []


def test_a_re_plan_dials_the_pcs_this_run_lost_with_the_short_timeout(store: FleetStore, tiny_export: Path) -> None:
    # a frozen PC: the chain waited out the open timeout, and the re-plan's survey waited it out again
    failover = FleetFailover(store, tiny_export, max_failovers=2)
    failover.lost.update({"abc" * 17, "def" * 17})
    assert failover._survey_options().recheck == {"abc" * 17, "def" * 17}


def test_a_folder_exported_again_mid_run_ends_the_run(store: FleetStore, tiny_export: Path, tmp_path: Path) -> None:
    # the re-plan deployed the folder's new export and carried the run's streams on with another model's weights
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    failover = FleetFailover(store, model, max_failovers=2)
    (model / "manifest.json").write_text((model / "manifest.json").read_text() + "\n")
    with pytest.raises(FailoverError, match=r"model was exported again during this run \(.* is now .*\): the run "
                                            r"cannot go on on another model; `fleet deploy` the new export"):
        failover(ChainError("agent abc: the link closed", "abc" * 17))
    assert failover.chains == []


def test_a_fleet_with_no_agent_left_says_why_no_chain_was_made(store: FleetStore, tiny_export: Path) -> None:
    failover = FleetFailover(store, tiny_export, max_failovers=2)
    failover.survey_options = type(failover.survey_options)(discover_seconds=0)  # nobody registered
    with pytest.raises(FailoverError, match=r"the link closed; no new chain without the lost agent\(s\): "
                                            r"cannot deploy .*: no agents in the fleet \(what to do: bring the lost PC "
                                            r"back, or join more PCs, then run this again\)$"):
        failover(ChainError("agent abc: the link closed", "abc" * 17))


@pytest.mark.parametrize(("state", "remedy"), [
    # a paused PC is not lost: "bring the lost PC back" sent the user after the wrong one
    # the planner's error names the command already (no PC could take work): it is not given twice
    (AgentState.PAUSED, r"resume a paused PC \(as above; one its admin paused, `paused: true` "
                         r"in its settings, only there\), bring the lost PC back"),
    (AgentState.UNAVAILABLE, r"wait until a PC left out as unavailable is free again \(the reason says what it is "
                             r"waiting for\), bring the lost PC back"),
])
def test_a_fleet_whose_other_pcs_cannot_take_work_says_what_would_let_them(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, state: AgentState,
        remedy: str) -> None:
    class Link:
        async def close(self) -> None:
            pass

    async def others(*args: object) -> Survey:  # the lost PC gone, the other two paused or unavailable
        agents = [AgentView(agent_id, f"10.0.0.{index}:7431", f"pc-{index}", ("peer",),
                            StatusReport(state, 8 << 30, 0.1, None, None, None, None, (), None, weight_gb_per_s=5.0),
                            None)
                  for index, agent_id in enumerate(("b" * 52, "c" * 52))]
        return Survey(agents, {agent.agent_id: Link() for agent in agents})  # type: ignore[misc]

    monkeypatch.setattr(fleet_failover, "survey", others)
    failover = FleetFailover(store, tiny_export, max_failovers=2)
    with pytest.raises(FailoverError, match=rf"no new chain without the lost agent\(s\): cannot deploy .* \(what to "
                                            rf"do: {remedy}, or join more PCs, then run this again\)$") as gave_up:
        failover(ChainError("agent abc: the link closed", "a" * 52))
    # the agents left out are listed in the error, not pointed to as in `fleet plan`'s table
    assert "(left out: bbbbbbbbbbbb" in str(gave_up.value) and SEE_LEFT_OUT not in str(gave_up.value)
    assert str(gave_up.value).count("`deskfleet-agent resume`") == (state is AgentState.PAUSED)


def test_a_fleet_whose_only_pc_its_user_paused_says_so_not_no_agents(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a walk's only PC, paused by its user mid-run: "no agents in the fleet", and "bring the lost PC back"
    class Link:
        async def close(self) -> None:
            pass

    async def the_paused_pc(*args: object) -> Survey:
        agent = AgentView("a" * 52, "pc-1", "10.0.0.1:7431", ("peer",),
                          StatusReport(AgentState.PAUSED, 8 << 30, 0.1, None, None, None, None, (), None,
                                       weight_gb_per_s=5.0), None)
        return Survey([agent], {agent.agent_id: Link()})  # type: ignore[dict-item]

    monkeypatch.setattr(fleet_failover, "survey", the_paused_pc)
    failover = FleetFailover(store, tiny_export, max_failovers=2)
    with pytest.raises(FailoverError) as gave_up:
        failover(ChainError("stage 0 [0:4] on agent aaaaaaaaaaaa reported no stage for the step: this agent gave its "
                            "stages up: paused by its user, until `deskfleet-agent resume`", "a" * 52, "a" * 52,
                            (StagePlacement("a" * 52, "10.0.0.1:7431", 0, 4),)))  # its word of itself
    said = str(gave_up.value)
    assert "no agent left: the 1 that answered (agent aaaaaaaaaaaa on pc-1) failed in this run" in said
    assert "no agents in the fleet" not in said
    assert "(what to do: resume a paused PC (as above; " in said


def test_the_remedy_names_the_resume_command_where_the_error_does_not() -> None:
    # a paused PC left out while the others could take work (the model did not fit them): no command above
    paused = frozenset({ExclusionReason.PAUSED})
    assert fleet_failover._remedy(True, paused, "cannot deploy m: memory short by 2 GB").startswith(
        "resume a paused PC (`deskfleet-agent resume` on it; ")
    assert fleet_failover._remedy(True, paused, "none can take work (`deskfleet-agent resume` on a PC its user "
                                               "paused)").startswith("resume a paused PC (as above; ")
    # the lost PC was paused by its user mid-run (it gave its stages up, saying so), the others are gone: a walk
    # was told only to "bring the lost PC back"
    gone = frozenset({ExclusionReason.UNREACHABLE})
    assert fleet_failover._remedy(True, gone, "stage 0 [0:8] on agent a1 reported no stage for the step: this agent "
                                              "gave its stages up: paused by its user (`deskfleet-agent resume` ends "
                                              "that) cannot deploy m: no reachable agents") == (
        "resume a paused PC (as above; one its admin paused, `paused: true` in its settings, only there), bring the "
        "lost PC back, or join more PCs")
    assert fleet_failover._remedy(True, gone, "agent a: the link closed") == "bring the lost PC back, or join more PCs"
    # the re-plan went through, and the controller's full disk refused its record: no PC mends that
    said = f"every stage was sent and assigned, {fleet_failover.UNRECORDED}: cannot write /d/deployments.json"
    assert fleet_failover._remedy(True, gone, said).startswith("make room for the controller's data dir")


def test_deploy_settings_of_an_older_record_are_the_defaults_and_a_bad_one_is_refused(
        store: FleetStore, tiny_export: Path) -> None:
    model_id = model_id_of(tiny_export)
    store.write("deployments", {model_id: {"model_dir": str(tiny_export), "stages": []}})
    assert load_deploy_settings(store, tiny_export) == DeploySettings(PlanPolicy.FEWEST_AGENTS, 1,
                                                                      Precision.DEVICE_DEFAULT, "CPU")
    store.write("deployments", {model_id: {"model_dir": str(tiny_export), "stages": [], "settings": {
        "policy": "fastest", "streams": 1, "precision": "f32", "device": "CPU"}}})
    with pytest.raises(DeployError, match=r"unreadable settings.*deploy it again"):
        load_deploy_settings(store, tiny_export)


def test_max_failovers_must_be_a_count() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_fleet_option(parser)
    assert parser.parse_args(["--max-failovers", "0"]).max_failovers == 0
    for bad in ("-1", "two"):
        with pytest.raises(argparse.ArgumentError, match="max-failovers"):
            parser.parse_args(["--max-failovers", bad])


def test_each_run_of_a_chat_gets_the_whole_budget_and_may_use_a_pc_lost_before(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A chat is one FleetFailover for many replies: it counted every re-plan of the day against --max-failovers
    # and never used again a PC lost in its first reply.
    excluded: list[set[str]] = []

    async def redeploy() -> SimpleNamespace:
        excluded.append(set(failover.lost))
        return SimpleNamespace(stages=(), model_id="m")

    monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
    failover = FleetFailover(store, tiny_export, max_failovers=1, notify=lambda text: None)
    monkeypatch.setattr(failover, "_redeploy", redeploy)
    failover(ChainError("agent a: the link closed", "a" * 52))
    with pytest.raises(FailoverError, match=r"gave up: 1 re-plan\(s\) already in this run"):
        failover(ChainError("agent b: the link closed", "b" * 52))
    failover.start_run()  # the chat's next reply
    failover(ChainError("agent c: the link closed", "c" * 52))
    assert excluded == [{"a" * 52}, {"c" * 52}]
    assert len(failover.chains) == 2


class ClosingChain(NewChain):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_re_plan_closes_the_chains_before_the_one_it_replaces(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a server that ran for months kept every chain its re-plans and take-backs had replaced open, with their links
    async def redeploy() -> SimpleNamespace:
        return SimpleNamespace(stages=(), model_id="m")

    monkeypatch.setattr(fleet_failover, "FleetPipeline", ClosingChain)
    failover = FleetFailover(store, tiny_export, max_failovers=3, notify=lambda text: None)
    failover.opened = ClosingChain()  # type: ignore[assignment]  # the chain opened from the record
    monkeypatch.setattr(failover, "_redeploy", redeploy)
    failover(ChainError("agent a: the link closed", "a" * 52))
    assert not failover.opened.closed  # type: ignore[union-attr]  # the engine releases on it as it moves
    for agent in "bc":
        failover(ChainError(f"agent {agent}: the link closed", agent * 52))
    # the newest runs; the one before it has its micro-batches released by the engine as it moves: both stay open
    assert failover.opened.closed  # type: ignore[union-attr]
    assert [chain.closed for chain in failover.chains] == [True, False, False]  # type: ignore[attr-defined]
    failover.close()
    assert all(chain.closed for chain in failover.chains)  # type: ignore[attr-defined]


class _Redeploys:
    """Stands for FleetFailover._redeploy: each call records whom it left out and raises the next of `failures`
    (None: a chain is made)."""

    def __init__(self, failover: FleetFailover, failures: list[Exception | None]) -> None:
        self.failover, self.failures, self.excluded = failover, failures, []  # type: list[set[str]]

    async def __call__(self) -> SimpleNamespace:
        self.excluded.append(set(self.failover.lost))
        failure = self.failures.pop(0)
        if failure is not None:
            raise failure
        return SimpleNamespace(stages=(), model_id="m")


def test_a_pc_lost_while_re_planning_is_left_out_of_another_re_plan_within_the_budget(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet fuzzer killed a second PC while the failover deployed the new chain: the run ended at once, with a
    # re-plan left in the budget, saying "bring the lost PC back"; the same command run again re-planned fine.
    notes: list[str] = []
    monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append)
    redeploys = _Redeploys(failover, [DeployError("agent bbb at 10.0.0.3:7431: the link closed",
                                                  agents=frozenset({"b" * 52})), None])
    monkeypatch.setattr(failover, "_redeploy", redeploys)
    failover(ChainError("agent a: the link closed", "a" * 52))
    assert redeploys.excluded == [{"a" * 52}, {"a" * 52, "b" * 52}]
    assert len(failover.chains) == 1 and failover.failed_replans == 1
    assert "re-planning without agent bbbbbbbbbbbb too" in notes[0]
    # the cut-short re-plan counted: the budget of 2 is spent
    with pytest.raises(FailoverError, match=r"gave up: 2 re-plan\(s\) already in this run"):
        failover(ChainError("agent c: the link closed", "c" * 52))
    failover.start_run()
    assert failover.failed_replans == 0


def test_the_failovers_notes_name_the_pcs_by_their_hostnames(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[str] = []
    store.save_roster({"b" * 52: RosterEntry("b" * 52, "bob-pc", utc_now().isoformat())})
    monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append)
    redeploys = _Redeploys(failover, [DeployError("the link closed", agents=frozenset({"b" * 52})), None])
    monkeypatch.setattr(failover, "_redeploy", redeploys)
    failover(ChainError("agent a: the link closed", "a" * 52))
    assert "re-planning without agent bbbbbbbbbbbb on bob-pc too" in notes[0]


def test_a_re_plan_reads_the_roster_again_so_a_pc_that_joined_since_the_run_began_is_named(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class SurveyReached(Exception):
        pass

    async def survey(*args: object, **kwargs: object) -> None:
        raise SurveyReached

    monkeypatch.setattr(fleet_failover, "load_deploy_settings", lambda *args: DeploySettings())
    monkeypatch.setattr(fleet_failover, "survey", survey)
    failover = FleetFailover(store, tiny_export, max_failovers=2)
    store.save_roster({"b" * 52: RosterEntry("b" * 52, "bob-pc", utc_now().isoformat())})  # joined mid-run
    with pytest.raises(SurveyReached):
        event_loop.run(failover._redeploy())
    assert failover.hostnames == {"b" * 52: "bob-pc"}


def test_a_pc_that_fails_the_new_chain_as_it_opens_is_left_out_too(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[int] = []

    class FirstOpenFails(NewChain):
        def __init__(self, *args: object, **kwargs: object) -> None:
            opened.append(1)
            if len(opened) == 1:
                raise ChainError("agent ddd (stage 0) at 10.0.0.4:7431: not reached", "d" * 52)
            super().__init__()

    monkeypatch.setattr(fleet_failover, "FleetPipeline", FirstOpenFails)
    failover = FleetFailover(store, tiny_export, max_failovers=3, notify=lambda text: None)
    redeploys = _Redeploys(failover, [None, None])
    monkeypatch.setattr(failover, "_redeploy", redeploys)
    failover(ChainError("agent a: the link closed", "a" * 52))
    assert redeploys.excluded == [{"a" * 52}, {"a" * 52, "d" * 52}] and len(failover.chains) == 1


@pytest.mark.parametrize(("budget", "failure", "message"), [
    # the last re-plan of the budget cut short: the budget is named
    (1, DeployError("agent bbb: the link closed", agents=frozenset({"b" * 52})),
     r"while re-planning, agent bbb: the link closed \(gave up: 1 re-plan\(s\) already in this run"),
    # a fault that is no PC's (a damaged export): no second re-plan, the remedy as before
    (3, DeployError("layer_001.bin is damaged"), r"no new chain without the lost agent\(s\): layer_001.bin is "
                                                  r"damaged \(what to do"),
    # the export's own file: no PC mends it, the remedy says so (it said "bring the lost PC back")
    (3, DeployError("layer_001.bin is damaged: its bytes hash to 8e0f…; export the model again"),
     r"\(what to do: export the model again, and deploy it \(`deskfleet fleet deploy --model` the new export\), "
     r"then run this again\)"),
])
def test_a_re_plan_cut_short_without_budget_or_by_no_pc_ends_the_run(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, budget: int, failure: Exception,
        message: str) -> None:
    monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
    failover = FleetFailover(store, tiny_export, max_failovers=budget, notify=lambda text: None)
    redeploys = _Redeploys(failover, [failure, None])
    monkeypatch.setattr(failover, "_redeploy", redeploys)
    with pytest.raises(FailoverError, match=message):
        failover(ChainError("agent a: the link closed", "a" * 52))
    assert len(redeploys.excluded) == 1


def test_a_deploy_that_a_pc_fails_names_that_pc_for_the_failover() -> None:
    import asyncio

    from deskfleet.agent.link import LinkError
    from deskfleet.common.wire import Error as ErrorMessage
    from deskfleet.common.wire import ErrorCode, ShardHave
    from deskfleet.controller import fleet_deploy

    class FakeLink:
        def __init__(self, agent_id: str, receive: Exception | object) -> None:
            self.peer, self.address, self._receive = SimpleNamespace(agent_id=agent_id), "10.0.0.9:7431", receive
            self.local_host = "10.0.0.1"

        async def send(self, message: object) -> None:
            raise LinkError("the link closed")

        async def receive(self) -> object:
            if isinstance(self._receive, Exception):
                raise self._receive
            return self._receive

    silent = FakeLink("s" * 52, TimeoutError())
    with pytest.raises(DeployError) as no_answer:
        asyncio.run(fleet_deploy._expect(silent, ShardHave, 0.01))  # type: ignore[arg-type]
    refusing = FakeLink("r" * 52, ErrorMessage(ErrorCode.INTERNAL, "disk full"))
    with pytest.raises(DeployError) as refused:
        asyncio.run(fleet_deploy._expect(refusing, ShardHave, 1.0))  # type: ignore[arg-type]
    assignment = SimpleNamespace(manifest=())
    with pytest.raises(DeployError) as lost:
        asyncio.run(fleet_deploy._deploy_stage(FakeLink("l" * 52, None), Path("."), assignment,  # type: ignore
                                               {}, {}, None))
    assert [error.value.agents for error in (no_answer, refused, lost)] == [
        frozenset({"s" * 52}), frozenset({"r" * 52}), frozenset({"l" * 52})]
    # refused as a bad message (an export whose files contradict its manifest): the fault is not the PC's
    export_fault = FakeLink("e" * 52, ErrorMessage(ErrorCode.BAD_MESSAGE, "manifest.json says vocab_size 288"))
    with pytest.raises(DeployError) as refused_export:
        asyncio.run(fleet_deploy._expect(export_fault, ShardHave, 1.0))  # type: ignore[arg-type]
    assert refused_export.value.agents == frozenset()


def test_a_step_error_of_an_old_chain_that_comes_during_a_deploy_is_no_refusal_of_it() -> None:
    # a PC whose next hop froze mid-run reports its lost link on the link that spoke last, the re-plan's: taken for
    # a refusal of the re-plan's assignment, the healthy PC was left out of the new chain too
    import asyncio

    from deskfleet.common.wire import Error as ErrorMessage
    from deskfleet.common.wire import ErrorCode, StageReady, StageRef
    from deskfleet.controller import fleet_deploy

    ready = StageReady(StageRef("m@1", 0, 2))

    class Replies:
        peer, address = SimpleNamespace(agent_id="p" * 52), "10.0.0.9:7431"

        def __init__(self) -> None:
            self.left = [ErrorMessage(ErrorCode.INTERNAL, "agent pppp: next hop agent ffff at 10.0.0.8:7431 is "
                                      "unreachable: the link to it died with steps in flight", micro_batch_id=3,
                                      agent_id="f" * 52), ready]

        async def receive(self) -> object:
            return self.left.pop(0)

    assert asyncio.run(fleet_deploy._expect(Replies(), StageReady, 1.0)) is ready  # type: ignore[arg-type]

    class Endless(Replies):  # stale errors that keep coming: the wait is still bounded by its timeout
        async def receive(self) -> object:
            await asyncio.sleep(0.01)
            return self.left[0]

    with pytest.raises(DeployError, match="sent no StageReady"):
        asyncio.run(fleet_deploy._expect(Endless(), StageReady, 0.2))  # type: ignore[arg-type]


def test_a_re_plan_cut_short_weighs_the_blame_once(store: FleetStore, tiny_export: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A reports its next hop B unreachable, B answers and hosts its stage (kept, once a run), and the first
    # deploy fails on a third PC C: the retry weighed the same blame again, found B "blamed and kept once
    # already", and reported B left out while the new chain held it.
    from deskfleet.controller import fleet_failover
    from tests.controller.test_review_blame import A, B, C, relayed, scripted_failover

    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    real_deploy = fleet_failover.deploy
    calls: list[int] = []

    async def third_pc_fails_first(*args: object, **kwargs: object) -> object:
        calls.append(1)
        report = await real_deploy(*args, **kwargs)  # type: ignore[arg-type]
        if len(calls) == 1:
            raise DeployError("agent ccc at 10.0.0.2:7431: the link closed", agents=frozenset({C}))
        return report

    monkeypatch.setattr(fleet_failover, "deploy", third_pc_fails_first)
    failover(relayed(B, A))
    record = failover.replans[-1]
    assert excluded == [frozenset(), frozenset({C})]  # B in both plans: it answered, and hosts its stage
    assert record["lost_agent"] != B and "left out" not in str(record["blame_check"]).split(";")[0]
    assert record["cut_short"] == ["agent ccc at 10.0.0.2:7431: the link closed"]
    assert C in failover.lost and B not in failover.lost


def _saved(store: FleetStore, model: Path, stages: tuple[StagePlacement, ...],
           settings: DeploySettings | None = None) -> None:
    fleet_deploy._save_deployment(store, model, DeployReport(model_id_of(model), stages, {}, {}),
                                  settings or DeploySettings())


class OpenedChain(NewChain):
    opened: ClassVar[list[tuple[StagePlacement, ...]]] = []

    def __init__(self, stages: tuple[StagePlacement, ...], *args: object, **kwargs: object) -> None:
        super().__init__()
        self.stages = stages
        OpenedChain.opened.append(stages)


A, B, C = "a" * 52, "b" * 52, "c" * 52
BEFORE = (StagePlacement(A, "127.0.0.1:7431", 0, 2), StagePlacement(B, "127.0.0.1:7432", 2, 4))
MEANWHILE = (StagePlacement(A, "127.0.0.1:7431", 0, 3), StagePlacement(C, "127.0.0.1:7433", 3, 4))


def test_a_re_plan_waits_for_another_deploy_and_goes_on_on_what_it_saved(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two runs on one deployment lost a PC: the second run's re-plan was refused at once ("another deploy ... is
    # running") while the first one's deployed, and the second run ended with 0 of its 2 re-plans used. And a
    # re-plan that read the deploy settings before an admin's `fleet deploy` saved its own overwrote that deploy.
    async def no_survey(*args: object, **kwargs: object) -> None:
        raise AssertionError("surveyed: the deployment saved meanwhile was the way on")

    _saved(store, tiny_export, BEFORE)
    notes: list[str] = []
    OpenedChain.opened = []
    monkeypatch.setattr(fleet_failover, "FleetPipeline", OpenedChain)
    monkeypatch.setattr(fleet_failover, "survey", no_survey)
    monkeypatch.setattr(fleet_failover, "_LOCK_POLL_S", 0.02)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append)
    other_deploy = contextlib.ExitStack()
    other_deploy.enter_context(store.deploying())  # another run's re-plan, or an admin's deploy, under way

    def finish_it() -> None:
        time.sleep(0.3)
        _saved(store, tiny_export, MEANWHILE, DeploySettings(policy=PlanPolicy.ALL_BY_SPEED))
        other_deploy.close()

    finisher = threading.Thread(target=finish_it)
    finisher.start()
    failover(ChainError("agent b: the link closed", B))
    finisher.join()
    assert OpenedChain.opened == [MEANWHILE]
    assert failover.replans[-1]["adopted"] is True and failover.replans[-1]["stages"] == [[A, 0, 3], [C, 3, 4]]
    assert notes[0].startswith("the chain broke (agent b: the link closed); its re-plan waits for the deploy under way")
    assert "let it finish, then deploy again" not in notes[0]
    assert "went on in" in notes[1] and "on the deployment saved meanwhile" in notes[1]
    assert notes[1].startswith("the chain broke (as above); went on in ")  # the error is not given twice
    assert load_deployment(store, tiny_export) == MEANWHILE  # the other deploy's stands, with its settings
    assert load_deploy_settings(store, tiny_export).policy is PlanPolicy.ALL_BY_SPEED


@pytest.mark.parametrize(("meanwhile", "told"), [(DeploySettings(kv_cache="u8"), True),
                                                  (DeploySettings(kv_cache="f32"), False)])
def test_a_drafting_run_that_goes_on_on_a_deployment_with_an_inexact_cache_is_told(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: DeploySettings,
        told: bool) -> None:
    # The run began on an f32 deployment (no warning); an admin deployed anew with a u8 cache meanwhile, and the
    # run went on on it without a word, its drafted output no longer token-identical to plain decoding.
    _saved(store, tiny_export, BEFORE, DeploySettings(kv_cache="f32"))
    notes: list[str] = []
    monkeypatch.setattr(fleet_failover, "FleetPipeline", OpenedChain)
    failover = FleetFailover(store, tiny_export, max_failovers=3, notify=notes.append, drafting=True)
    failover.check_cache()
    assert notes == []
    _saved(store, tiny_export, MEANWHILE, meanwhile)
    failover(ChainError("agent b: the link closed", B))
    assert failover.replans[-1]["adopted"] is True
    cache_notes = [note for note in notes if "KV cache" in note]
    assert cache_notes == ([f"the fleet's stages of {tiny_export} keep a u8 KV cache, as it was deployed: drafted "
                            f"output can part from plain decoding, and verification is slower there; `deskfleet fleet "
                            f"deploy --model {tiny_export} --data-dir {store.data_dir} --kv-cache f32` for "
                            "token-identical output"] if told else [])
    _saved(store, tiny_export, (StagePlacement(A, "127.0.0.1:7431", 0, 4),), meanwhile)  # the same cache again
    failover(ChainError("agent c: the link closed", C))
    assert [note for note in notes if "KV cache" in note] == cache_notes


def test_a_re_plan_that_waits_too_long_for_another_deploy_says_so(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_failover, "DEPLOY_LOCK_WAIT_S", 0.2)
    monkeypatch.setattr(fleet_failover, "_LOCK_POLL_S", 0.02)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=lambda text: None)
    with store.deploying(), pytest.raises(FailoverError) as gave_up:
        failover(ChainError("agent b: the link closed", B))
    assert str(gave_up.value) == (f"agent b: the link closed; its re-plan waited 0 s for the deploy under way from "
                                  f"{store.data_dir} (another run's re-plan, or a `fleet deploy`) to finish: run this "
                                  "again once it has")


def test_a_re_plan_stopped_by_ctrl_c_is_still_in_the_runs_report(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the report of a run stopped mid-re-plan had "replans": [], the PC it lost and the break unrecorded
    async def ctrl_c() -> None:
        raise KeyboardInterrupt

    failover = FleetFailover(store, tiny_export, max_failovers=2)
    monkeypatch.setattr(failover, "_redeploy", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        failover(ChainError("agent a: the link closed", A))
    (record,) = failover.replans
    assert record["interrupted"] is True and record["lost_agent"] == A and record["stages"] == []
    assert record["error"] == "agent a: the link closed"


def test_a_stop_cuts_short_a_re_plan_waiting_for_another_deploy_and_the_report_says_so(
        store: FleetStore, tiny_export: Path) -> None:
    # a closing serve --fleet waited for its engine's re-plan (here DEPLOY_LOCK_WAIT_S, 600 s) for the 30 s close
    # timeout, twice, then left with the re-plan running
    stop = StopSignal()
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=lambda text: None, stop=stop)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with store.deploying(), pytest.raises(Stopped):
        failover(ChainError("agent a: the link closed", A))
    assert time.monotonic() - started < 5
    (record,) = failover.replans
    assert record["interrupted"] is True and record["lost_agent"] == A


def test_a_chain_that_could_not_open_is_not_said_to_have_broken(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes: list[str] = []
    monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
    failover = FleetFailover(store, tiny_export, max_failovers=2, notify=notes.append)
    monkeypatch.setattr(failover, "_redeploy", _Redeploys(failover, [None, None]))
    failover(ChainError("cannot reach agent a (stage 0, layers [0:4])", A), opening=True)
    failover(ChainError("agent a: the link closed", A))  # a later break mid-run is one
    assert notes[0].startswith("the deployed chain could not open (cannot reach agent a ")
    assert notes[1].startswith("the chain broke (agent a: the link closed)")


def test_a_blame_is_still_weighed_when_the_deployment_taken_first_could_not_open(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first attempt took a deployment saved meanwhile and skipped the survey; its chain did not open (C gone),
    # and the retry weighed no blame at all (the blamed PC stayed lost) and showed an earlier break's verdict.
    weighed: list[ChainError | None] = []
    check_blame = FleetFailover._check_blame

    def recording_check(self: FleetFailover, found: Survey) -> None:
        weighed.append(self._blame)
        check_blame(self, found)

    class CannotReachC(OpenedChain):
        def __init__(self, stages: tuple[StagePlacement, ...], *args: object, **kwargs: object) -> None:
            if any(stage.agent_id == C for stage in stages):
                raise ChainError("cannot reach agent c", C)
            super().__init__(stages)

    async def nobody(*args: object, **kwargs: object) -> Survey:
        return Survey([], {})

    async def deployed(store: FleetStore, model: Path, *args: object, **kwargs: object) -> tuple[object, DeployReport]:
        return SimpleNamespace(exclusions=()), DeployReport(model_id_of(model), (StagePlacement(A, "a:1", 0, 4),), {},
                                                            {})

    _saved(store, tiny_export, BEFORE)
    notes: list[str] = []
    monkeypatch.setattr(FleetFailover, "_check_blame", recording_check)
    monkeypatch.setattr(fleet_failover, "FleetPipeline", CannotReachC)
    monkeypatch.setattr(fleet_failover, "survey", nobody)
    monkeypatch.setattr(fleet_failover, "deploy", deployed)
    failover = FleetFailover(store, tiny_export, max_failovers=3, notify=notes.append)
    failover._blame_verdict = "the verdict of an earlier break"
    _saved(store, tiny_export, MEANWHILE)  # A -> C, saved by another run
    blame = ChainError("stage 0 reported a failure: next hop agent b is unreachable", B, A, BEFORE)
    failover(blame)
    assert weighed == [blame]  # weighed once, by the attempt that surveyed
    assert "earlier break" not in " ".join(notes) and failover.replans[-1]["blame_check"] != \
        "the verdict of an earlier break"


@pytest.mark.parametrize(("saved", "broken_links"), [
    ((StagePlacement(B, "127.0.0.1:7432", 0, 4),), set()),  # B again, which this run lost
    (MEANWHILE, {(A, C)}),  # A right before C, a link an earlier break of this run found broken
])
def test_a_deployment_saved_meanwhile_is_not_taken_over_a_lost_pc_or_a_broken_link(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, saved: tuple[StagePlacement, ...],
        broken_links: set[tuple[str, str]]) -> None:
    class Surveyed(Exception):
        pass

    async def survey(*args: object, **kwargs: object) -> None:
        raise Surveyed

    _saved(store, tiny_export, BEFORE)
    monkeypatch.setattr(fleet_failover, "survey", survey)
    monkeypatch.setattr(fleet_failover, "FleetPipeline", OpenedChain)  # taken, it would open
    failover = FleetFailover(store, tiny_export, max_failovers=2)
    failover.broken_links |= broken_links
    _saved(store, tiny_export, saved)
    with pytest.raises(Surveyed):  # re-planned instead
        failover(ChainError("agent b: the link closed", B))
    assert failover.replans == []


def test_a_pc_lost_in_a_run_that_calls_in_again_may_be_placed_by_the_runs_next_re_plan(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A loopback walk: pc1 paused under `serve --fleet` was re-planned around, resumed, and called in; then pc3 paused,
    # and the re-plan went on on 1 PC with pc1 available, left out as lost within the server's 10-minute window
    a, b = "a" * 52, "b" * 52
    monkeypatch.setattr(fleet_failover, "FleetPipeline", NewChain)
    failover = FleetFailover(store, tiny_export, max_failovers=5, notify=lambda text: None)
    redeploys = _Redeploys(failover, [None] * 5)
    monkeypatch.setattr(failover, "_redeploy", redeploys)
    long_ago = "2000-01-01T08:00:00+00:00"
    store.save_roster({agent_id: RosterEntry(agent_id, f"desk-{agent_id[0]}", long_ago, (), long_ago)
                       for agent_id in (a, b)})

    def called_in(agent_id: str) -> None:
        roster = store.roster()
        roster[agent_id] = RosterEntry(agent_id, f"desk-{agent_id[0]}", long_ago, (), utc_now().isoformat())
        store.save_roster(roster)

    failover(ChainError("agent a: paused by its user", a))
    failover(ChainError("agent b: the link closed", b))  # A has not called in: still left out
    called_in(a)  # resumed
    failover(ChainError("agent b: the link closed again", b))
    assert redeploys.excluded == [{a}, {a, b}, {b}]
    # lost again, and registered again at once (a link that flaps): forgiven once a run, not at every break
    failover(ChainError("agent a: the link closed", a))
    called_in(a)
    failover(ChainError("agent b: the link closed once more", b))
    assert redeploys.excluded[3:] == [{a, b}, {a, b}]


def test_a_deployment_replaced_under_the_chain_is_gone_on_on_spending_no_failover(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an admin's `fleet deploy` under a running run (the chain's DeploymentWatch saw it): with --max-failovers 0 the
    # run ended, though no PC had failed
    _saved(store, tiny_export, BEFORE)
    monkeypatch.setattr(fleet_failover, "FleetPipeline", OpenedChain)
    failover = FleetFailover(store, tiny_export, max_failovers=0, notify=lambda text: None)
    _saved(store, tiny_export, MEANWHILE)
    replaced = fleet_pipeline.DeploymentReplaced("the deployment on record was replaced under the chain",
                                                 stages=BEFORE)
    assert failover(replaced).stages == MEANWHILE
    assert failover._spent() == 0  # the budget is whole: a PC that fails next is still re-planned around (or not)
    with pytest.raises(FailoverError, match="--max-failovers 0"):
        failover(ChainError("agent a: the link closed", A))  # a real failure spends it
