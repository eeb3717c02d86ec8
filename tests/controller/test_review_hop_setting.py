"""What a hop costs the plan is a setting of `fleet plan` / `deploy` (`--hop-ms`), saved with the deployment so
that a failover's re-plan prices hops as the deploy did: the planner's default (1 ms, a LAN) kept a chain of a
small model on one PC, where an admin over a WAN wants more and a test of a 3-PC chain wants none."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.common.planner import PlanOptions, PlanPolicy
from deskfleet.common.wire import Precision
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_deploy import DeploySettings, load_deploy_settings, model_id_of, policy_options
from deskfleet.controller.fleet_store import FleetStore


def test_hop_ms_is_milliseconds_and_refuses_what_is_no_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert policy_options("all_by_speed", 1, 2.5).hop_cost == 2_500_000.0  # the planner's unit: ns
    assert policy_options("all_by_speed").hop_cost == PlanOptions().hop_cost
    for bad in ("-1", "nan", "inf", "70000", "fast"):
        with pytest.raises(SystemExit):
            main(["fleet", "plan", "--layers", "4", "--layer-bytes", "1e6", "--assume-agent", "8e9",
                  "--discover-seconds", "0", "--data-dir", str(tmp_path), "--hop-ms", bad])
        assert "--hop-ms" in capsys.readouterr().err


def test_fleet_plan_keeps_a_small_model_on_one_pc_unless_hops_are_free(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def stages(*options: str) -> int:
        code = main(["fleet", "plan", "--layers", "8", "--layer-bytes", "1e5", "--assume-agent", "8e9",
                     "--assume-agent", "8e9", "--policy", "all_by_speed", "--discover-seconds", "0", "--data-dir",
                     str(tmp_path), *options])
        assert code == 0
        out = capsys.readouterr().out
        return int(out.split(" stage(s):")[0].rsplit("\n", 1)[-1])

    assert stages() == 1  # 0.8 MB of layers: 0.8 ms a token at the assumed 1 GB/s, less than a hop
    assert stages("--hop-ms", "0") == 2


def test_the_hop_cost_is_saved_with_the_deployment_and_an_older_record_gets_the_default(
        tmp_path: Path, tiny_export: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    model_id = model_id_of(tiny_export)
    record = {"model_dir": str(tiny_export), "stages": [],
              "settings": {"policy": "all_by_speed", "streams": 1, "precision": "f32", "device": "CPU"}}
    store.write("deployments", {model_id: record})
    assert load_deploy_settings(store, tiny_export).hop_cost == PlanOptions().hop_cost  # saved before: default
    record["settings"]["hop_cost"] = 0.0  # type: ignore[index]
    store.write("deployments", {model_id: record})
    settings = load_deploy_settings(store, tiny_export)
    assert settings == DeploySettings(PlanPolicy.ALL_BY_SPEED, 1, Precision.F32, "CPU", None, 0.0)
    assert settings.plan_options() == PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, streams=1, hop_cost=0.0)
    record["settings"]["hop_cost"] = -3  # type: ignore[index]
    store.write("deployments", {model_id: record})
    with pytest.raises(Exception, match="unreadable settings"):
        load_deploy_settings(store, tiny_export)


