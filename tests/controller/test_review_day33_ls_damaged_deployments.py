"""Review day 33: `fleet ls` is meant to list the agents even when deployments.json cannot be read
("the list stands without the deployments"), but only DeployError is caught: a deployments.json that is not
JSON (or not a controller file) raises FleetStoreError, and `fleet ls` -- which did not read that file before
today -- now fails as a whole."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.wire import StageRef
from deskfleet.controller import fleet_survey
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_store import FleetStore

AGENT = "a" * 52


def _fake_survey(monkeypatch: pytest.MonkeyPatch) -> None:
    report = SimpleNamespace(state=AgentState.SERVING, free_memory_bytes=8 << 30,
                             shard_room_bytes=None, clock_s=None, reasons=(), detail="",
                             stages=(StageRef("m@1", 0, 4),), weight_gb_per_s=None, cpu_load=0.0, igpu_busy=None,
                             temperature_c=None, battery_percent=None, on_ac_power=None)
    agent = SimpleNamespace(agent_id=AGENT, hostname="pc-bob", address="10.0.0.2:7431", sources=("registration",),
                            report=report, problem=None, certificate_expires=None, version="1")

    class Found:
        def __init__(self) -> None:
            self.agents = [agent]

        async def close(self) -> None:
            return None

    async def survey(store: Any, options: Any) -> Found:
        return Found()

    monkeypatch.setattr(fleet_survey, "survey", survey)


@pytest.mark.parametrize("content", ["{not json", '{"format": 999, "body": {}}'])
def test_fleet_ls_lists_the_agents_when_deployments_json_is_damaged(store: FleetStore, content: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _fake_survey(monkeypatch)
    (store.data_dir / "deployments.json").write_text(content, "utf-8")
    code = main(["fleet", "ls", "--data-dir", str(store.data_dir), "--discover-seconds", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "pc-bob" in captured.out
    assert "deployments.json" in captured.out  # the warning names the file
