"""A damaged deployments.json is named, with the fix, by every command that reads it: no traceback, and
a deploy does not push a single byte before it finds out."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.model_spec import ManifestError
from deskfleet.common.wire import StageRef
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_cli import _print_agents
from deskfleet.controller.fleet_deploy import (
    DeployError,
    StagePlacement,
    load_deployment,
    model_id_of,
    undeployed_stages,
)
from deskfleet.controller.fleet_listing import agent_json
from deskfleet.controller.fleet_store import FleetStore

AGENT = "a" * 52
GOOD_STAGE = {"agent_id": AGENT, "address": "127.0.0.1:7431", "layer_start": 0, "layer_end": 4}


def write_deployments(store: FleetStore, body: object) -> None:
    (store.data_dir / "deployments.json").write_text(json.dumps({"format": 1, "body": body}), "utf-8")


@pytest.mark.parametrize(("stages", "named"), [
    (None, "stages must be a non-empty list"),
    ([], "stages must be a non-empty list"),
    ([{**GOOD_STAGE, "addr": 1}], "stage 0 must be an object with exactly"),
    (["x"], "stage 0 must be an object with exactly"),
    ([{**GOOD_STAGE, "agent_id": "nobody"}], "agent_id 'nobody' is not an agent id"),
    ([{**GOOD_STAGE, "address": "zz"}], "address 'zz' is not host:port"),
    ([{**GOOD_STAGE, "layer_start": "0"}], "layers \\['0':4\\] are not a range"),
    ([{**GOOD_STAGE, "layer_end": 0}], "layers \\[0:0\\] are not a range"),
    ([GOOD_STAGE, {**GOOD_STAGE, "layer_start": 5, "layer_end": 6}], "stage 1 starts at layer 5, not 4"),
])
def test_a_damaged_record_is_named_with_the_fix(store: FleetStore, tiny_export: Path, stages: object,
                                                 named: str) -> None:
    record = {"model_dir": str(tiny_export)} if stages is None else {"model_dir": str(tiny_export), "stages": stages}
    write_deployments(store, {model_id_of(tiny_export): record})
    with pytest.raises(DeployError, match=f"deployments.json: the deployment of .* is damaged \\(.*{named}.*\\): "
                                          "run `deskfleet fleet deploy"):
        load_deployment(store, tiny_export)


def test_a_good_record_loads(store: FleetStore, tiny_export: Path) -> None:
    write_deployments(store, {model_id_of(tiny_export): {"stages": [GOOD_STAGE]}})
    assert load_deployment(store, tiny_export) == (StagePlacement(AGENT, "127.0.0.1:7431", 0, 4),)


def test_the_cli_names_the_damaged_file_and_exits_2(store: FleetStore, tiny_export: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    write_deployments(store, {model_id_of(tiny_export): {"stages": [{"agent_id": AGENT}]}})
    argv = ["fleet", "generate", "--data-dir", str(store.data_dir), "--model", str(tiny_export),
            "--prompt-ids", "1,2", "--discover-seconds", "0"]
    assert main(argv) == 2
    assert "deployments.json: the deployment of" in capsys.readouterr().err
    write_deployments(store, ["not", "an", "object"])
    assert main(argv) == 2
    assert "deployments.json must hold an object of deployments by model id" in capsys.readouterr().err
    assert main(["fleet", "deploy", "--data-dir", str(store.data_dir), "--model", str(tiny_export),
                 "--discover-seconds", "0"]) == 2
    assert "deployments.json must hold an object" in capsys.readouterr().err


def test_the_fix_names_the_data_dir_where_a_command_would_not_find_it(store: FleetStore, tiny_export: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Run as printed, the fix must act on this fleet: `--data-dir` where the command, given none, would use another.
    monkeypatch.delenv("DESKFLEET_CONTROLLER_DIR", raising=False)
    fix = f"--model {tiny_export} --data-dir {store.data_dir}`"
    with pytest.raises(DeployError, match=re.escape(f"run `deskfleet fleet deploy {fix}") + "$"):
        load_deployment(store, tiny_export)
    write_deployments(store, {model_id_of(tiny_export): {"stages": []}})
    with pytest.raises(DeployError, match=re.escape(f"{fix} again") + "$"):
        load_deployment(store, tiny_export)
    monkeypatch.setenv("DESKFLEET_CONTROLLER_DIR", str(store.data_dir))  # found by itself: nothing to add
    with pytest.raises(DeployError, match=re.escape(f"--model {tiny_export}` again") + "$"):
        load_deployment(store, tiny_export)


def test_a_model_folder_that_is_no_export_is_named_before_any_file_is_read(store: FleetStore, tmp_path: Path) -> None:
    # `generate --fleet --model` of a missing folder said "[Errno 2] No such file or directory: .../manifest.json".
    with pytest.raises(ManifestError, match="nowhere does not exist"):
        load_deployment(store, tmp_path / "nowhere")
    checkpoint = tmp_path / "checkpoint"  # a Hugging Face checkpoint, not exported
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(ManifestError, match=r"checkpoint has no manifest\.json: it is not a deskfleet export"):
        model_id_of(checkpoint)


def test_stages_no_deployment_places_on_their_pc_are_found(store: FleetStore) -> None:
    # A failover re-planned without a PC it could not reach; back, the PC still hosted its old stage and `fleet ls`
    # listed it as serving it, with nothing to say that no chain runs through it.
    other = "b" * 52
    write_deployments(store, {
        "m@1": {"stages": [{**GOOD_STAGE, "layer_end": 8}]},  # re-planned: AGENT holds every layer now
        "broken@2": {"stages": "?"},  # damaged: nothing is known of its stages, none is called stale
    })
    hosted = {AGENT: [StageRef("m@1", 0, 8)],
              other: [StageRef("m@1", 6, 8), StageRef("broken@2", 0, 2), StageRef("gone@3", 0, 4)]}
    assert undeployed_stages(store, hosted) == {other: [StageRef("m@1", 6, 8), StageRef("gone@3", 0, 4)]}
    (store.data_dir / "deployments.json").unlink()
    assert undeployed_stages(store, {AGENT: [StageRef("m@1", 0, 8)]}) == {AGENT: [StageRef("m@1", 0, 8)]}
    assert undeployed_stages(store, {AGENT: []}) == {}


def test_fleet_ls_marks_them(capsys: pytest.CaptureFixture[str]) -> None:
    report = SimpleNamespace(state=AgentState.SERVING, free_memory_bytes=8 << 30, cpu_load=0.0, igpu_busy=None,
                             temperature_c=None, battery_percent=None, on_ac_power=None, weight_gb_per_s=None,
                             shard_room_bytes=None, clock_s=None, reasons=(), detail="", ip_families=(4,),
                             devices=("CPU",), last_error=None, stages=(StageRef("m@1", 0, 6), StageRef("m@1", 6, 8)))
    agent = SimpleNamespace(agent_id=AGENT, hostname="pc-bob", address="10.0.0.2:7431", sources=("registration",),
                            report=report, problem=None, certificate_expires=None)
    _print_agents([agent], {AGENT: [StageRef("m@1", 6, 8)]})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("m@1[0:6], m@1[6:8] (not deployed)")
    assert lines[-1] == "1 agent(s): 1 serving"  # one of its stages runs
    # every stage of the PC marked: it runs nothing, and the count says so instead of calling it a PC at work
    _print_agents([agent], {AGENT: [StageRef("m@1", 0, 6), StageRef("m@1", 6, 8)]})
    assert capsys.readouterr().out.splitlines()[-1] == \
        "1 agent(s): 1 serving (1 of them holding only stages not deployed)"
    assert agent_json(agent, {AGENT: [StageRef("m@1", 6, 8)]})["stages_not_deployed"] == [["m@1", 6, 8]]
    assert agent_json(agent)["devices"] == ["CPU"]


def test_a_folders_earlier_exports_are_released_where_the_next_deploys_reach_them(store: FleetStore,
                                                                                   tmp_path: Path) -> None:
    # A PC off during the deploy that replaced its export keeps the old stage: a later deploy of the folder (its
    # record's `replaces`) releases it when it reaches the PC; another folder's model of the same name is kept.
    import asyncio

    from deskfleet.common.planner import PlanPolicy
    from deskfleet.common.wire import Precision
    from deskfleet.controller import fleet_deploy

    settings = fleet_deploy.DeploySettings(PlanPolicy.FEWEST_AGENTS, 1, Precision.F32, "CPU")
    folder = tmp_path / "target"
    other = "b" * 52
    placed = (StagePlacement(AGENT, "127.0.0.1:7431", 0, 4),)
    write_deployments(store, {"target@2": {"model_dir": "/elsewhere/target", "stages": [GOOD_STAGE]}})
    for model_id in ("target@old", "target@mid", "target@new"):  # exported again twice, the PC off all along
        fleet_deploy._save_deployment(store, folder, fleet_deploy.DeployReport(model_id, placed, {}, {}), settings)
    records = json.loads((store.data_dir / "deployments.json").read_text())["body"]
    assert sorted(records) == ["target@2", "target@new"] and records["target@new"]["replaces"] == ["target@mid",
                                                                                                   "target@old"]
    sent: list[object] = []

    class Recording:
        async def send(self, message: object) -> None:
            sent.append(message)

    hosted = (StageRef("target@old", 0, 4), StageRef("target@2", 0, 4), StageRef("target@2", 4, 8),
              StageRef("target@new", 0, 4))
    found = SimpleNamespace(reachable=lambda: [SimpleNamespace(agent_id=other, report=SimpleNamespace(stages=hosted))],
                            links={other: Recording()})
    asyncio.run(fleet_deploy._release_left_out(store, found, "target@new"))  # type: ignore[arg-type]
    # the old export's and the new one's unplaced stages go; the other folder's, placed or not, are its own
    assert [message.stage for message in sent] == [StageRef("target@old", 0, 4),  # type: ignore[attr-defined]
                                                   StageRef("target@new", 0, 4)]
