"""Day 29 review: fleets of 5+ PCs called infeasible although a chain fits.

Beyond EVERY_ORDER_UP_TO agents, the orders tried when the order by speed does not fit were every choice of
first and last agent with the rest by speed: a middle PC whose memory suits one layer only (a larger layer, or
room for the embed's neighbours) was never put where that layer is. A random search (3 x 3,000 fleets of 5-8
PCs, tight memory, both policies, hop 0 / 0.5 / default, with and without broken links) found 21 / 3000 fleets
with a chain called infeasible; the chains that fit are now found by a search over subsets (up to
EVERY_CHAIN_UP_TO agents), and the brute force below agrees on every one."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import AgentCandidate, ModelFootprint, PlanOptions, PlanPolicy, plan, usable_bytes

EXACT = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)


def _stage_bytes(model: ModelFootprint, options: PlanOptions, start: int, stop: int) -> int:
    """A stage's memory, counted here afresh: weights held, KV, prefill scratch, runtime, embed first, head last."""
    weights = sum(model.layer_bytes[start:stop]) + (model.embed_bytes if start == 0 else 0) \
        + (model.head_bytes if stop == model.num_layers else 0)
    return (math.ceil(weights * model.resident_factor) + (stop - start) * model.kv_bytes_per_layer(options.streams)
            + options.stage_overhead_bytes + model.prefill_scratch_bytes(options.streams, start == 0))


def _a_chain_fits(model: ModelFootprint, agents: list[AgentCandidate], options: PlanOptions) -> bool:
    """Brute force: some agents in some order, each a non-empty contiguous range within its usable memory, no
    agent before one it cannot dial."""
    layers = model.num_layers

    @functools.cache
    def reaches(start: int, last: int, used: int) -> bool:
        if start == layers:
            return True
        for index, agent in enumerate(agents):
            if used >> index & 1 or (last >= 0 and (agents[last].agent_id, agent.agent_id) in options.broken_links):
                continue
            for stop in range(start + 1, layers + 1):
                if (_stage_bytes(model, options, start, stop) <= usable_bytes(agent, options)
                        and reaches(stop, index, used | 1 << index)):
                    return True
        return False

    return reaches(0, -1, 0)


def _layout(result_stages: object) -> list[tuple[str, int, int]]:
    return [(stage.agent_id, stage.first_layer, stage.stop_layer) for stage in result_stages]  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", list(PlanPolicy))
@pytest.mark.parametrize("hop_cost", [0.0, PlanOptions().hop_cost])
def test_a_pc_with_room_for_the_large_layer_only_is_put_where_that_layer_is(policy: PlanPolicy,
                                                                            hop_cost: float) -> None:
    # Five 1-byte layers but the fourth, of 2 bytes; four PCs with 1 byte and a faster one with 2. Each PC holds one
    # layer, and the 2-byte PC must be fourth. By speed it is first; with another first or last agent, the rest by
    # speed, it is second: "no split into contiguous layer ranges fits" before.
    model = ModelFootprint("big-fourth", (1, 1, 1, 2, 1), 0, 0, 0, 1)
    agents = [AgentCandidate("big", AgentState.AVAILABLE, 2, 2.0),
              *(AgentCandidate(f"pc{index}", AgentState.AVAILABLE, 1, 1.0) for index in range(1, 5))]
    options = dataclasses.replace(EXACT, policy=policy, hop_cost=hop_cost)
    result = plan(model, agents, options)
    assert result.feasible, result.problems
    layout = _layout(result.stages)
    assert [(first, stop) for _, first, stop in layout] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert layout[3][0] == "big"


def test_a_chain_through_a_pc_that_bridges_a_broken_link_is_found() -> None:
    # The fit needs a4 -> a0 -> a5 (a4 cannot dial a5): a0 takes one small layer so that a5, after it, holds the
    # head. a4 could reach further alone, but then only a5 has room for the rest, and a4 cannot dial it.
    model = ModelFootprint("bridge", (2, 4, 2, 5, 2, 6), 2, 6, 1, 1)
    agents = [AgentCandidate(agent_id, AgentState.AVAILABLE, free, speed) for agent_id, free, speed in
              [("a0", 4, 6.0), ("a1", 5, 1.0), ("a2", 5, 3.0), ("a3", 4, 2.0), ("a4", 12, 5.0), ("a5", 14, 4.0)]]
    links = frozenset({("a0", "a2"), ("a0", "a4"), ("a2", "a1"), ("a2", "a3"), ("a2", "a5"), ("a4", "a5")})
    for policy in PlanPolicy:
        options = dataclasses.replace(EXACT, policy=policy, hop_cost=0.0, broken_links=links)
        result = plan(model, agents, options)
        assert result.feasible, result.problems
        chain = [stage.agent_id for stage in result.stages]
        assert not any(pair in links for pair in itertools.pairwise(chain))


def test_a_fleet_of_5_or_6_pcs_is_called_infeasible_only_when_no_chain_fits() -> None:
    # Seeded fleets, tight memory, layers of unequal sizes, both policies, free and default hops, some broken links:
    # the planner's verdict against the brute force, and every stage it plans within its PC's memory.
    rng = random.Random(29)
    fits = 0
    for _ in range(700):
        count = rng.randint(5, 6)
        model = ModelFootprint("r", tuple(rng.randint(1, 6) for _ in range(rng.randint(3, 6))), rng.randint(0, 5),
                               rng.randint(0, 5), rng.choice([0, 1]), 1, resident_factor=rng.choice([1.0, 1.3]))
        agents = [AgentCandidate(f"a{index}", AgentState.AVAILABLE, rng.randint(1, 14), float(rng.randint(1, 6)))
                  for index in range(count)]
        links = frozenset(link for link in ((f"a{rng.randrange(count)}", f"a{rng.randrange(count)}")
                                            for _ in range(rng.choice([0, 0, 3, 8]))) if link[0] != link[1])
        options = dataclasses.replace(EXACT, policy=rng.choice(list(PlanPolicy)),
                                      hop_cost=rng.choice([0.0, PlanOptions().hop_cost]), broken_links=links)
        expected = _a_chain_fits(model, agents, options)
        result = plan(model, agents, options)
        assert result.feasible == expected, (model, agents, options, result.problems)
        fits += expected
        free = {agent.agent_id: usable_bytes(agent, options) for agent in agents}
        for stage in result.stages:
            assert _stage_bytes(model, options, stage.first_layer, stage.stop_layer) <= free[stage.agent_id]
    assert fits > 300  # the search is about fleets near the edge, most of which fit
