"""FleetFailover's limits and the deploy settings it re-plans with (the re-plan itself runs in
test_fleet_deploy.py and, with a PC switched off mid-generation, in the integration fleet)."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from deskfleet.common.planner import PlanPolicy
from deskfleet.common.wire import Precision
from deskfleet.controller import fleet_failover
from deskfleet.controller.chat import add_fleet_option
from deskfleet.controller.fleet_deploy import DeployError, DeploySettings, load_deploy_settings, model_id_of
from deskfleet.controller.fleet_failover import FailoverError, FleetFailover
from deskfleet.controller.fleet_pipeline import ChainError
from deskfleet.controller.fleet_store import FleetStore


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


def test_a_fleet_with_no_agent_left_says_why_no_chain_was_made(store: FleetStore, tiny_export: Path) -> None:
    failover = FleetFailover(store, tiny_export, max_failovers=2)
    failover.survey_options = type(failover.survey_options)(discover_seconds=0)  # nobody registered
    with pytest.raises(FailoverError, match=r"the link closed; no new chain without the lost agent\(s\): "
                                            r"the model does not fit the fleet.* \(what to do: bring the lost PC "
                                            r"back, or join more PCs, then run this again\)$"):
        failover(ChainError("agent abc: the link closed", "abc" * 17))


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
