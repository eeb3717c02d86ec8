"""An agent left out as BROKEN_LINK is an end of a broken link, and only where the links cost the plan something.

Before, every agent that the plan without the links used and the plan with them did not was labelled BROKEN_LINK:
an agent at neither end of any link was told "broken link:  (a firewall or a network fault between them)" (no
link named), and so was one left out of a plan that the links did not make worse (the search with links weighs
more chain orders than the one without, and found a better chain that does not need it).
"""

from __future__ import annotations

import dataclasses

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import AgentCandidate, ExclusionReason, ModelFootprint, PlanOptions, PlanPolicy, plan

NO_MARGIN = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)


def agents_of(*fleet: tuple[str, int, float]) -> list[AgentCandidate]:
    return [AgentCandidate(agent_id, AgentState.AVAILABLE, free, speed) for agent_id, free, speed in fleet]


@pytest.mark.parametrize(("options", "model", "fleet", "links", "bystander"), [
    # with the link a1 -> a3 the search weighs every order of the four and finds a2, a1 (pace 2.4) better than
    # the order by speed's a1, a2, a0 (pace 3.5): a0 is no end of the link, and the link cost nothing
    (dataclasses.replace(NO_MARGIN, policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.5),
     ModelFootprint("r", (4, 1, 4, 1, 1), 1, 1, 0, 1),
     (("a0", 4, 1.0), ("a1", 7, 5.0), ("a2", 6, 4.0), ("a3", 17, 1.0)), {("a1", "a3")}, "a0"),
    (NO_MARGIN, ModelFootprint("r", (3, 4, 4), 4, 2, 0, 1),
     (("a0", 16, 1.0), ("a1", 10, 3.0), ("a2", 9, 5.0), ("a3", 12, 3.0), ("a4", 5, 1.0)),
     {("a2", "a3"), ("a4", "a2")}, "a1"),
], ids=["all-by-speed", "fewest"])
def test_an_agent_at_neither_end_of_a_broken_link_is_not_left_out_for_one(
        options: PlanOptions, model: ModelFootprint, fleet: tuple[tuple[str, int, float], ...],
        links: set[tuple[str, str]], bystander: str) -> None:
    agents = agents_of(*fleet)
    result = plan(model, agents, dataclasses.replace(options, broken_links=frozenset(links)))
    assert result.feasible, result.problems
    assert bystander not in {stage.agent_id for stage in result.stages}
    reasons = {exclusion.agent_id: exclusion for exclusion in result.exclusions}
    assert reasons[bystander].reason is ExclusionReason.NOT_NEEDED, reasons[bystander].message
    for exclusion in result.exclusions:
        if exclusion.reason is ExclusionReason.BROKEN_LINK:
            assert any(exclusion.agent_id in link for link in links), exclusion
            assert "broken link:  (" not in exclusion.message


def test_an_end_of_a_link_that_costs_the_plan_nothing_is_not_left_out_for_it() -> None:
    # the search weighs every order of the four and finds a1, a2 (pace 1.0 + 2 hops) better than the order by
    # speed's a2, a3 (1.33 + 2 hops), with the link a0 -> a3 as without it: a3 is an end of the link, but the link
    # cost nothing
    options = dataclasses.replace(NO_MARGIN, policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.5)
    model = ModelFootprint("r", (1, 4), 4, 0, 0, 1)
    agents = agents_of(("a0", 3, 5.0), ("a1", 6, 3.0), ("a2", 7, 4.0), ("a3", 8, 3.0))
    free = plan(model, agents, options)
    result = plan(model, agents, dataclasses.replace(options, broken_links=frozenset({("a0", "a3")})))
    assert [stage.agent_id for stage in free.stages] == ["a1", "a2"]
    assert [stage.agent_id for stage in result.stages] == ["a1", "a2"]
    reasons = {exclusion.agent_id: exclusion.reason for exclusion in result.exclusions}
    assert reasons == {"a0": ExclusionReason.NOT_NEEDED, "a3": ExclusionReason.NOT_NEEDED}
