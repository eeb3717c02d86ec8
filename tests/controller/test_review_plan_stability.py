"""The controller tells the planner which stages of the model being planned each agent hosts."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState
from deskfleet.common.wire import StageRef, StatusReport
from deskfleet.controller.fleet_deploy import candidates_of


def view(agent_id: str, stages: tuple[StageRef, ...]) -> object:
    report = StatusReport(AgentState.SERVING, 4 << 30, 0.1, None, None, None, None, stages, None, 10.0)
    return type("View", (), {"agent_id": agent_id, "hostname": "pc", "report": report})()


def test_an_agent_hosting_a_stage_of_the_planned_model_says_which_layers() -> None:
    model, other = "demo@0123456789ab", "other@ba9876543210"
    agents = [view("a" * 52, (StageRef(model, 0, 5), StageRef(other, 0, 8))), view("b" * 52, ())]
    hosting, idle = candidates_of(agents, model)  # type: ignore[arg-type]
    assert hosting.hosted == ((0, 5),) and idle.hosted == ()
    assert candidates_of(agents)[0].hosted == ()  # type: ignore[arg-type]  # no model named: nothing counted back
