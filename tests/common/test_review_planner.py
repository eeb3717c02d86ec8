"""Review findings on the planner: each test failed before its fix."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import GB, AgentCandidate, ModelFootprint, PlanOptions, plan, render_plan

NO_MARGIN = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)


def available(agent_id: str, free_bytes: int, speed: float = 1.0) -> AgentCandidate:
    return AgentCandidate(agent_id, AgentState.AVAILABLE, free_bytes, speed)


def test_a_plan_whose_stages_take_no_time_renders() -> None:
    # a model of zero bytes on paper is feasible, and render_plan divided by its slowest stage's time (0)
    paper = ModelFootprint.uniform("paper", 3, 0, 0, 0, 0, 1)
    result = plan(paper, [available("a", GB)], NO_MARGIN)
    assert result.feasible and result.stages[0].relative_time == 0.0
    assert "a                    0-2       embed+head" in render_plan(result)
    assert render_plan(result).splitlines()[-1].endswith("1.00")
