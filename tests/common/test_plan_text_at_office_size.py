"""`fleet plan`'s text at an office's size: agents left out in a crowd for one reason (300 idle PCs a plan does
not need, a model whose layer fits none of them) show their first few and a count, not a row each (300 PCs
printed ~300 such rows); an infeasible plan's Usable line names a dozen and sums the rest; a reason shared by
few agents still lists them by name."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import (
    RENDER_CROWD,
    RENDER_CROWD_SHOWN,
    RENDER_USABLE,
    AgentCandidate,
    ExclusionReason,
    ModelFootprint,
    plan,
    render_plan,
)

GB = 10**9


def office(count: int, memory: int = 16 * GB) -> list[AgentCandidate]:
    agents = [AgentCandidate(f"{index:04d}".translate(str.maketrans("0123456789", "abcdefghij")) + "a" * 48,
                             AgentState.AVAILABLE, memory, 10.0, hostname=f"pc-{index}")
              for index in range(count)]
    agents.append(AgentCandidate("p" * 52, AgentState.PAUSED, memory, 10.0, hostname="pc-paused"))
    return agents


def test_agents_a_plan_does_not_need_are_counted_not_listed() -> None:
    result = plan(ModelFootprint.uniform("small", 8, GB, GB, GB, 0, 1024), office(300))
    unused = [e for e in result.exclusions if e.reason is ExclusionReason.NOT_NEEDED]
    assert result.feasible and len(unused) > RENDER_CROWD
    text = render_plan(result)
    assert f"and {len(unused) - RENDER_CROWD_SHOWN} more agents left out as not needed" in text
    assert "pc-paused" in text  # another reason: still named
    assert len(text.splitlines()) < 20


def test_a_few_unneeded_agents_are_still_listed_by_name() -> None:
    result = plan(ModelFootprint.uniform("small", 8, GB, GB, GB, 0, 1024), office(4))
    text = render_plan(result)
    assert "more agents left out" not in text
    assert sum("pc-" in line for line in text.splitlines()) >= 4


def test_a_layer_that_fits_no_pc_is_one_count_not_300_rows() -> None:
    result = plan(ModelFootprint.uniform("huge", 80, 20 * GB, GB, GB, 0, 1024), office(300))
    text = render_plan(result)
    assert not result.feasible and "more agents left out as too little memory" in text
    assert len(text.splitlines()) < 20


def test_an_infeasible_plans_usable_line_names_a_dozen_and_sums_the_rest() -> None:
    result = plan(ModelFootprint.uniform("70b", 80, GB, GB, GB, 0, 1024), office(20, memory=4 * GB))
    assert not result.feasible and len(result.usable) > RENDER_USABLE
    usable = next(line for line in render_plan(result).splitlines() if line.startswith("Usable: "))
    assert f"and {len(result.usable) - RENDER_USABLE} more (" in usable and usable.count(" GB") == RENDER_USABLE + 1
