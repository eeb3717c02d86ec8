"""Review findings on the planner: each test failed before its fix."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import (
    GB,
    MIB,
    AgentCandidate,
    ExclusionReason,
    ModelFootprint,
    PlanOptions,
    PlanPolicy,
    plan,
)
from deskfleet.controller.plan_text import render_plan

NO_MARGIN = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)


def available(agent_id: str, free_bytes: int, speed: float = 1.0) -> AgentCandidate:
    return AgentCandidate(agent_id, AgentState.AVAILABLE, free_bytes, speed)


def test_a_plan_whose_stages_take_no_time_renders() -> None:
    # a model of zero bytes on paper is feasible, and render_plan divided by its slowest stage's time (0)
    paper = ModelFootprint.uniform("paper", 3, 0, 0, 0, 0, 1)
    result = plan(paper, [available("a", GB)], NO_MARGIN)
    assert result.feasible and result.stages[0].relative_time == 0.0
    assert "a      -     [0:3]   embed+head" in render_plan(result)
    assert render_plan(result).splitlines()[-1].endswith("1.00")


def test_an_infinite_speed_is_no_measurement() -> None:
    # it was planned (every stage time 0) and its plan then failed to render
    model = ModelFootprint.uniform("m", 4, GB, GB, GB, 1000, 1024)
    result = plan(model, [available("inf", 100 * GB, math.inf), available("nan", 100 * GB, math.nan),
                          available("ok", 100 * GB, 2.0)])
    assert [stage.agent_id for stage in result.stages] == ["ok"]
    reasons = {exclusion.agent_id: (exclusion.reason, exclusion.message) for exclusion in result.exclusions}
    assert reasons["inf"] == (ExclusionReason.SPEED_UNKNOWN, "speed inf is not a measurement")
    assert reasons["nan"] == (ExclusionReason.SPEED_UNKNOWN, "speed not measured yet")
    render_plan(result)


def test_a_stage_time_that_overflows_still_plans_and_renders() -> None:
    # 1e9 bytes / 5e-324 is inf: the split compared (inf, 1) with (inf, 0) for "nothing yet" and said that
    # no contiguous split fits 6 GB into 90 GB
    model = ModelFootprint.uniform("m", 4, GB, GB, GB, 1000, 1024)
    result = plan(model, [available("crawl", 100 * GB, 5e-324)])
    assert result.feasible and result.stages[0].relative_time == math.inf
    assert render_plan(result).splitlines()[-1].endswith("1.00")


def test_an_infinite_head_work_is_refused() -> None:
    with pytest.raises(ValueError, match="head_work must be 0 or more and finite"):
        ModelFootprint("h", (GB, GB), GB, GB, 1000, 1024, math.inf)


_SPEEDS = st.sampled_from([0.0, -1.0, math.nan, math.inf, 5e-324, 1e-300, 1.0, 1.0, 2.0, 1e300])
_FREE = st.sampled_from([0, 1, 2 * MIB, 600 * MIB, GB, 3 * GB, 40 * GB])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(layers=st.integers(1, 6), layer_bytes=st.sampled_from([0, 1, 100 * MIB, GB]),
       extras=st.sampled_from([0, 300 * MIB, 2 * GB]), fleet=st.lists(st.tuples(_FREE, _SPEEDS), max_size=8),
       policy=st.sampled_from(list(PlanPolicy)))
def test_any_fleet_gets_a_valid_plan_or_named_problems(layers: int, layer_bytes: int, extras: int,
                                                       fleet: list[tuple[int, float]], policy: PlanPolicy) -> None:
    model = ModelFootprint.uniform("m", layers, layer_bytes, extras, extras, 1000, 512)
    agents = [available(f"pc-{index}", free, speed) for index, (free, speed) in enumerate(fleet)]
    options = PlanOptions(policy=policy)
    result = plan(model, agents, options)
    text = render_plan(result)
    explained = [stage.agent_id for stage in result.stages] + [e.agent_id for e in result.exclusions]
    if not result.feasible:
        assert result.problems and not result.stages and "Infeasible" in text
        explained += [agent_id for agent_id, _ in result.usable]
    assert sorted(explained) == sorted(agent.agent_id for agent in agents)
    if result.feasible:
        assert result.stages[0].first_layer == 0 and result.stages[-1].stop_layer == layers
        for before, after in itertools.pairwise(result.stages):
            assert before.stop_layer == after.first_layer
        for stage in result.stages:
            assert stage.num_layers >= 1 and stage.memory_bytes <= stage.usable_bytes
            assert 0 < next(a.speed for a in agents if a.agent_id == stage.agent_id) < math.inf
