"""With every agent stopped, `fleet plan`, `fleet deploy` and `generate --fleet` say that the agents were
found but none answered, naming them and the fix, instead of "no agents in the fleet" / "does not fit"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import AgentCandidate, Exclusion, ExclusionReason, ModelFootprint, plan
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_deploy import model_id_of
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from tests.ports import free_port

PC1, PC2 = "a" * 52, "b" * 52




@pytest.fixture
def stopped_fleet(tmp_path: Path) -> tuple[Path, list[str]]:
    """A controller whose 2 enrolled agents registered loopback addresses where nothing listens now."""
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    store.save_roster({agent_id: RosterEntry(agent_id, host, utc_now().isoformat(), (address,))
                       for agent_id, host, address in zip((PC1, PC2), ("pc1", "pc2"), addresses, strict=True)})
    return store.data_dir, addresses


def assert_says_unreachable(text: str, addresses: list[str]) -> None:
    assert "no reachable agents: 2 found but unreachable" in text
    assert f"aaaaaaaaaaaa (pc1) unreachable at {addresses[0]}" in text
    assert f"bbbbbbbbbbbb (pc2) unreachable at {addresses[1]}" in text
    assert "start `deskfleet-agent --headless` on them" in text
    assert "no agents in the fleet" not in text and "does not fit" not in text


def test_plan_says_the_agents_found_did_not_answer(stopped_fleet: tuple[Path, list[str]],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data_dir, addresses = stopped_fleet
    paper = ["--layers", "4", "--layer-bytes", "1e6", "--discover-seconds", "0", "--data-dir", str(data_dir)]
    assert main(["fleet", "plan", *paper]) == 1
    assert_says_unreachable(capsys.readouterr().out, addresses)
    assert main(["fleet", "plan", *paper, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert_says_unreachable(report["problems"][0], addresses)
    assert [entry[1] for entry in report["left_out"]] == ["unreachable", "unreachable"]


def test_deploy_says_the_agents_found_did_not_answer(stopped_fleet: tuple[Path, list[str]], tiny_export: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data_dir, addresses = stopped_fleet
    assert main(["fleet", "deploy", "--model", str(tiny_export), "--discover-seconds", "0",
                 "--data-dir", str(data_dir)]) == 1  # a failed run, as plan says (not a usage error's 2)
    error = capsys.readouterr().err
    assert f"cannot deploy {model_id_of(tiny_export)}: " in error
    assert_says_unreachable(error, addresses)


def test_generate_on_the_fleet_says_the_agents_found_did_not_answer(
        stopped_fleet: tuple[Path, list[str]], tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir, addresses = stopped_fleet
    stages = [{"agent_id": PC1, "address": addresses[0], "layer_start": 0, "layer_end": 2},
              {"agent_id": PC2, "address": addresses[1], "layer_start": 2, "layer_end": 4}]
    FleetStore(data_dir).write("deployments", {model_id_of(tiny_export): {"model_dir": str(tiny_export),
                                                                            "stages": stages}})
    assert main(["generate", "--fleet", "--data-dir", str(data_dir), "--model", str(tiny_export),
                 "--prompt", "hi", "--max-new-tokens", "2"]) == 1  # a failed run, not a usage error (2)
    error = capsys.readouterr().err
    assert "no new chain without the lost agent(s)" in error  # the chain's first agent is the one lost
    assert_says_unreachable(error, addresses)


def test_the_planner_counts_the_agents_that_did_not_answer() -> None:
    model = ModelFootprint.uniform("m", 4, 10**9, 0, 0, 0, 16)
    silent = [Exclusion(PC2, ExclusionReason.UNREACHABLE, "unreachable at 127.0.0.1:9: refused", "pc2")]
    small = AgentCandidate(PC1, AgentState.AVAILABLE, 2 * 10**9, 1.0)
    result = plan(model, [small], unreachable=silent)
    assert not result.feasible and result.exclusions[-1] == silent[0]
    assert "memory short" in result.problems[0] and "1 more found did not answer" in result.problems[0]
    assert plan(model, []).problems == ("no agents in the fleet",)


def test_a_pc_that_never_called_in_is_not_said_to_be_at_a_placeholder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "unreachable at -: joined, but its agent never called in": the "-" stood for no address.
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    store.save_roster({PC1: RosterEntry(PC1, "pc1", utc_now().isoformat())})
    main(["fleet", "plan", "--layers", "4", "--layer-bytes", "1e6", "--discover-seconds", "0",
          "--data-dir", str(store.data_dir)])
    out = capsys.readouterr().out
    assert "aaaaaaaaaaaa (pc1) unreachable: joined, but its agent never called in" in out and " at -" not in out


def test_fleet_ls_says_when_no_serve_runs_to_take_the_registrations(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # with `fleet serve` stopped, a running agent was listed as "never called in: start deskfleet-agent"
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    store.save_roster({PC1: RosterEntry(PC1, "pc1", utc_now().isoformat())})
    ls = ["fleet", "ls", "--discover-seconds", "0", "--data-dir", str(store.data_dir)]
    assert main(ls) == 0
    assert f"warning: no `deskfleet fleet serve` runs on {store.data_dir}: agents cannot register" in \
        capsys.readouterr().out
    with store.serving():  # as `fleet serve` holds it
        assert main(ls) == 0
    assert "no `deskfleet fleet serve` runs" not in capsys.readouterr().out
