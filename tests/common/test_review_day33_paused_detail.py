"""Review day 33: the planner now uses a PAUSED agent's report detail as its whole "left out" message, assuming the
detail says who paused it. An agent of the same protocol from before today (or any agent whose detail is only
the numbers of a crossed limit) reports PAUSED with detail "battery 41%, unplugged": the plan then says only
that, and no word of it being paused (before today it said "paused (by its user or in its settings)")."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState, UnavailableReason
from deskfleet.common.planner import GB, AgentCandidate, ExclusionReason, ModelFootprint, PlanOptions, plan


def test_an_older_agent_paused_on_battery_is_still_said_to_be_paused() -> None:
    footprint = ModelFootprint.uniform("toy", 4, int(0.1 * GB), 0, 0, kv_bytes_per_token_per_layer=0, context=1024)
    agents = [AgentCandidate("old", AgentState.PAUSED, 64 * GB, 5.0, UnavailableReason.ON_BATTERY,
                             "battery 41%, unplugged"),  # what decide_availability reports when paused + on battery
              AgentCandidate("worker", AgentState.AVAILABLE, 16 * GB, 1.0)]
    result = plan(footprint, agents, PlanOptions(use_serving=False))
    (left_out,) = [e for e in result.exclusions if e.agent_id == "old"]
    assert left_out.reason is ExclusionReason.PAUSED
    assert "paused" in left_out.message, left_out.message
