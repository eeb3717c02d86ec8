"""PlanOptions.broken_links: a link known broken (agent A cannot dial agent B, e.g. a firewall between two desks)
never joins two neighbouring stages of a plan.

Before, the planner had no way to be told: a failover whose stage could not reach its next hop, while the
controller reached both, left the reporter out of the re-plan (a healthy PC lost to the fleet) so that the two
were not neighbours. Now it keeps both and plans them apart, and where no chain over both does as well, it leaves
one out and says so (ExclusionReason.BROKEN_LINK).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.common.agent_state import AgentState, UnavailableReason
from deskfleet.common.planner import (
    GB,
    AgentCandidate,
    ExclusionReason,
    ModelFootprint,
    Plan,
    PlanOptions,
    PlanPolicy,
    plan,
    usable_bytes,
)
from deskfleet.controller.plan_text import render_plan
from tests.common.test_planner import ALL, NO_MARGIN, check_well_formed

MODEL = ModelFootprint.uniform("m", 40, 250_000_000, 500_000_000, 500_000_000, 1024, 1024)  # 11 GB of weights
FEWEST = PlanOptions()  # 10% / 512 MiB margin, 96 MiB runtime a stage, 1 stream
FASTEST = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED)
POLICIES = pytest.mark.parametrize("options", [FEWEST, FASTEST], ids=["fewest", "all-by-speed"])


def pc(agent_id: str, free_gb: float, speed: float, hosted: tuple[tuple[int, int], ...] = ()) -> AgentCandidate:
    return AgentCandidate(agent_id, AgentState.SERVING if hosted else AgentState.AVAILABLE, int(free_gb * GB), speed,
                          hosted=hosted, hostname=f"desk-{agent_id}")


def chain(result: Plan) -> list[str]:
    assert result.feasible, result.problems
    return [stage.agent_id for stage in result.stages]


def apart(options: PlanOptions, *links: tuple[str, str]) -> PlanOptions:
    return dataclasses.replace(options, broken_links=frozenset(links))


def joined(result: Plan, links: frozenset[tuple[str, str]]) -> list[tuple[str, str]]:
    """The broken links between neighbouring stages of `result` (none, in a plan that respects them)."""
    return [(before.agent_id, after.agent_id) for before, after in itertools.pairwise(result.stages)
            if (before.agent_id, after.agent_id) in links]


@POLICIES
def test_two_pcs_that_both_are_needed_swap_places_when_the_first_cannot_dial_the_second(options: PlanOptions) -> None:
    agents = [pc("a", 9, 2.0), pc("b", 9, 1.0)]  # neither holds the 11 GB model alone
    assert chain(plan(MODEL, agents, options)) == ["a", "b"]
    result = plan(MODEL, agents, apart(options, ("a", "b")))
    assert chain(result) == ["b", "a"]  # was ["a", "b"]: the chain's one link was the broken one
    assert result.exclusions == ()
    check_well_formed(result, agents, options)


@POLICIES
def test_a_link_broken_one_way_leaves_the_other_order_as_it_was(options: PlanOptions) -> None:
    agents = [pc("a", 9, 2.0), pc("b", 9, 1.0)]
    assert plan(MODEL, agents, apart(options, ("b", "a"))) == plan(MODEL, agents, options)


@POLICIES
def test_two_pcs_that_cannot_dial_each_other_make_a_one_pc_plan_and_say_why(options: PlanOptions) -> None:
    agents = [pc("a", 13, 2.0), pc("b", 9, 1.0)]  # a holds the model alone, b does not
    assert chain(plan(MODEL, agents, FASTEST)) == ["a", "b"]  # both, where the links work
    result = plan(MODEL, agents, apart(options, ("a", "b"), ("b", "a")))
    assert chain(result) == ["a"]
    (left_out,) = result.exclusions
    if options.policy is PlanPolicy.FEWEST_AGENTS:
        assert left_out.reason is ExclusionReason.NOT_NEEDED  # one PC holds it anyway: the links cost nothing
        return
    assert left_out.agent_id == "b" and left_out.reason is ExclusionReason.BROKEN_LINK
    assert "agent a (desk-a) cannot dial agent b (desk-b), agent b (desk-b) cannot dial agent a (desk-a)" in \
        left_out.message
    text = render_plan(result)
    assert "Left out:" in text and "desk-b  broken link: agent a (desk-a) cannot dial agent b" in text


def test_of_two_equal_pcs_that_cannot_dial_each_other_the_faster_is_kept() -> None:
    for speeds in ((2.0, 1.0), (1.0, 2.0)):
        agents = [pc("a", 13, speeds[0]), pc("b", 13, speeds[1])]
        result = plan(MODEL, agents, apart(FASTEST, ("a", "b"), ("b", "a")))
        faster = "a" if speeds[0] > speeds[1] else "b"
        assert chain(result) == [faster]
        assert [e.reason for e in result.exclusions] == [ExclusionReason.BROKEN_LINK]


@POLICIES
def test_two_pcs_that_hold_the_model_only_together_and_cannot_dial_each_other_are_infeasible_and_told(
        options: PlanOptions) -> None:
    agents = [pc("a", 9, 2.0), pc("b", 9, 1.0)]
    result = plan(MODEL, agents, apart(options, ("a", "b"), ("b", "a")))
    assert not result.feasible and not result.stages
    (problem,) = result.problems
    assert problem.startswith("the 2 usable agent(s) hold the model only in chains where a PC dials one it cannot "
                              "reach (broken links: a (desk-a) -> b (desk-b), b (desk-b) -> a (desk-a))")
    assert "mend the network between those PCs (or give them addresses of one IP family), or join more PCs" in \
        render_plan(result)


@POLICIES
def test_three_pcs_keep_all_three_with_the_broken_link_apart(options: PlanOptions) -> None:
    agents = [pc("a", 5, 3.0), pc("b", 5, 2.0), pc("c", 5, 1.0)]  # all three needed: 11 GB over 3 x 4 GB usable
    # by speed, where the fewest are taken; all_by_speed weighs every order of a small fleet (the head on the fastest)
    assert chain(plan(MODEL, agents, options)) == (["a", "b", "c"] if options is FEWEST else ["c", "a", "b"])
    for links in ([("a", "b")], [("b", "c")], [("a", "b"), ("b", "a")], [("a", "b"), ("b", "c")],
                  [("a", "b"), ("b", "a"), ("c", "b")], [("a", "b"), ("b", "c"), ("c", "a")]):
        result = plan(MODEL, agents, apart(options, *links))
        assert sorted(chain(result)) == ["a", "b", "c"], links
        assert joined(result, frozenset(links)) == []
        check_well_formed(result, agents, options)
    # b can dial nobody and nobody can dial b: no chain of three, and none of two holds the model
    cut = [(x, y) for x, y in itertools.permutations("abc", 2) if "b" in (x, y)]
    assert not plan(MODEL, agents, apart(options, *cut)).feasible


def test_four_pcs_keep_all_four_with_every_broken_link_apart() -> None:
    agents = [pc("a", 4, 4.0), pc("b", 4, 3.0), pc("c", 4, 2.0), pc("d", 4, 1.5)]  # all four needed
    links = frozenset({("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")})
    for options in (FEWEST, FASTEST):
        result = plan(MODEL, agents, dataclasses.replace(options, broken_links=links))
        assert sorted(chain(result)) == ["a", "b", "c", "d"] and joined(result, links) == []
        check_well_formed(result, agents, options)


def test_a_long_chain_keeps_every_pc_with_the_broken_link_apart() -> None:
    # more PCs than every order is tried for: the link's ends are moved round each other
    agents = [pc(name, 2.5, 8.0 - index) for index, name in enumerate("abcdefg")]  # all seven needed
    assert chain(plan(MODEL, agents, FEWEST)) == list("abcdefg")
    for links, expected in [
            ([("c", "d")], "abdcefg"),  # the target moved before its source
            ([("c", "d"), ("d", "c")], "adbcefg"),
            ([("a", "b"), ("f", "g")], "bacdegf"),  # each PC the one before cannot dial moved back
            ([("a", "g"), ("c", "d")], "abdcefg"),
            ([("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")], None)]:
        for options in (FEWEST, FASTEST):
            result = plan(MODEL, agents, apart(options, *links))
            assert sorted(chain(result)) == list("abcdefg"), links
            assert joined(result, frozenset(links)) == []
            if expected is not None and options is FEWEST:  # all_by_speed weighs other orders too (ten PCs at most)
                assert "".join(chain(result)) == expected, links


def ranges(result: Plan) -> list[tuple[str, int, int]]:
    assert result.feasible, result.problems
    return [(stage.agent_id, stage.first_layer, stage.stop_layer) for stage in result.stages]


def deployed(before: list[tuple[str, int, int]], free_gb: float, speeds: dict[str, float]) -> list[AgentCandidate]:
    """The PCs of `before` once it is deployed: their free memory lacks what their stage took (its weights and
    runtime; the KV cache still empty)."""
    def held(first: int, stop: int) -> int:
        return (250_000_000 * (stop - first) + (500_000_000 if first == 0 else 0)
                + (500_000_000 if stop == 40 else 0) + FEWEST.stage_overhead_bytes)
    return [pc(agent_id, free_gb - held(first, stop) / GB, speeds[agent_id], ((first, stop),))
            for agent_id, first, stop in before]


@POLICIES
def test_a_deployed_chain_with_no_broken_link_is_kept(options: PlanOptions) -> None:
    speeds = {"a": 2.0, "b": 1.0}
    before = ranges(plan(MODEL, [pc("a", 9, 2.0), pc("b", 9, 1.0)], options))
    assert before == [("a", 0, 28), ("b", 28, 40)]
    hosted = deployed(before, 9, speeds)
    for links in ((), (("b", "a"),), (("a", "c"),), (("c", "b"),)):  # none joins a to b
        assert ranges(plan(MODEL, hosted, apart(options, *links))) == before, links


def test_a_deployed_chain_whose_link_broke_is_planned_again_the_other_way() -> None:
    speeds = {"a": 2.0, "b": 1.0}
    before = ranges(plan(MODEL, [pc("a", 13, 2.0), pc("b", 13, 1.0)], FASTEST))
    assert [agent_id for agent_id, _, _ in before] == ["a", "b"]
    hosted = deployed(before, 13, speeds)
    assert ranges(plan(MODEL, hosted, FASTEST)) == before
    moved = plan(MODEL, hosted, apart(FASTEST, ("a", "b")))  # was kept as deployed, a dialling b
    assert chain(moved) == ["b", "a"] and moved.exclusions == ()


@POLICIES
def test_links_of_pcs_not_planned_on_change_nothing(options: PlanOptions) -> None:
    paused = AgentCandidate("p", AgentState.PAUSED, 16 * GB, 5.0)
    hot = AgentCandidate("h", AgentState.UNAVAILABLE, 16 * GB, 5.0, UnavailableReason.TOO_HOT)
    agents = [pc("a", 9, 2.0), pc("b", 9, 1.0), paused, hot]
    links = apart(options, ("a", "p"), ("p", "b"), ("h", "a"), ("b", "gone"), ("gone", "a"))
    assert plan(MODEL, agents, links) == plan(MODEL, agents, options)


@pytest.mark.parametrize("link", [("a", "a"), ("a",), ("a", "b", "c"), ("a", 1), "ab"])
def test_a_broken_link_is_two_agent_ids(link: object) -> None:
    with pytest.raises(ValueError, match="a broken link is"):
        plan(MODEL, [pc("a", 13, 1.0)], dataclasses.replace(FEWEST, broken_links=frozenset({link})))  # type: ignore[arg-type]


def _brute_force_pace(model: ModelFootprint, agents: list[AgentCandidate], links: frozenset[tuple[str, str]],
                      any_order: bool = True) -> float | None:
    """The best slowest-stage time (free hops, no margins) over every contiguous split over any agents in any
    order (any_order; else fastest first) whose neighbouring stages join no broken link."""
    ordered = sorted(agents, key=lambda a: (-a.speed, a.agent_id))
    best: float | None = None
    layers = model.num_layers
    for used in range(1, len(ordered) + 1):
        subsets = (itertools.chain.from_iterable(itertools.permutations(subset) for subset in
                                                 itertools.combinations(ordered, used))
                   if any_order else itertools.combinations(ordered, used))
        for subset in subsets:
            if any((x.agent_id, y.agent_id) in links for x, y in itertools.pairwise(subset)):
                continue
            for cuts in itertools.combinations(range(1, layers), used - 1):
                bounds = (0, *cuts, layers)
                times = []
                for agent, (start, stop) in zip(subset, itertools.pairwise(bounds), strict=True):
                    weights = sum(model.layer_bytes[start:stop]) + (model.head_bytes if stop == layers else 0)
                    if weights + (model.embed_bytes if start == 0 else 0) > usable_bytes(agent, NO_MARGIN):
                        break
                    times.append(weights / agent.speed)
                else:
                    best = max(times) if best is None else min(best, max(times))
    return best


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    layer_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    embed=st.integers(0, 4),
    head=st.integers(0, 4),
    fleet=st.lists(st.tuples(st.integers(0, 16), st.integers(1, 4)), min_size=1, max_size=4),
    links=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(lambda link: link[0] != link[1])),
)
def test_every_plan_respects_the_broken_links_and_is_the_fastest_that_does(
        layer_sizes: list[int], embed: int, head: int, fleet: list[tuple[int, int]],
        links: set[tuple[int, int]]) -> None:
    model = ModelFootprint("rand", tuple(layer_sizes), embed, head, 0, 1)
    agents = [AgentCandidate(f"a{i}", AgentState.AVAILABLE, free, float(speed))
              for i, (free, speed) in enumerate(fleet)]
    broken = frozenset((f"a{x}", f"a{y}") for x, y in links)
    fastest = dataclasses.replace(ALL, broken_links=broken)
    result = plan(model, agents, fastest)
    check_well_formed(result, agents, fastest)
    assert joined(result, broken) == []
    # every order is weighed (4 PCs at most), with the links as without
    expected = _brute_force_pace(model, agents, broken)
    if expected is None:
        assert not result.feasible
    else:
        assert result.feasible, result.problems
        assert max(s.relative_time for s in result.stages) == pytest.approx(expected)
    # an agent left out for a broken link is an end of one, and a plan without the links uses it
    free = plan(model, agents, ALL)
    for exclusion in result.exclusions:
        if exclusion.reason is ExclusionReason.BROKEN_LINK:
            assert any(exclusion.agent_id in link for link in broken)
            assert exclusion.agent_id in {stage.agent_id for stage in free.stages}
    fewest = plan(model, agents, dataclasses.replace(NO_MARGIN, broken_links=broken))
    check_well_formed(fewest, agents, NO_MARGIN)
    assert joined(fewest, broken) == []
    assert fewest.feasible == result.feasible
    if fewest.feasible:
        assert len(fewest.stages) <= len(result.stages)
    assert plan(model, agents, dataclasses.replace(ALL, broken_links=frozenset())) == free
