"""Every stage of a chain adds a hop to every token (the controller -> stage 0 -> ... -> stage n-1 -> controller
daisy chain): 0.6 + 0.75 ms of Python, TLS and websockets in the agents and the controller for an extra PC on a
2-core VM, 0.65-0.85 ms a hop on faster hosts (README, docs/benchmark-runs.md), against steps of 5-40 ms. Under
`all_by_speed` a PC whose share shortens the slowest stage by less than its hop costs must be left out; before,
a PC 20x slower than the others got a layer whenever that shortened the slowest stage at all. Under
`fewest_agents` the hop changes nothing (the fewest PCs are taken first)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import (
    MIB,
    AgentCandidate,
    ExclusionReason,
    ModelFootprint,
    PlanOptions,
    PlanPolicy,
    plan,
)

MB = 1_000_000
ALL = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, margin_fraction=0.0, margin_min_bytes=0)
FREE = dataclasses.replace(ALL, hop_cost=0.0)


def pc(agent_id: str, speed_gb_per_s: float, free: int = 8000 * MB) -> AgentCandidate:
    return AgentCandidate(agent_id, AgentState.AVAILABLE, free, speed_gb_per_s)


def model(layers: int = 81, layer_mb: float = 5.0) -> ModelFootprint:
    return ModelFootprint.uniform("m", layers, int(layer_mb * MB), 0, 0, 0, 16)


def split(footprint: ModelFootprint, agents: list[AgentCandidate], options: PlanOptions) -> list[tuple[str, int]]:
    result = plan(footprint, agents, options)
    assert result.feasible, result.problems
    return [(stage.agent_id, stage.num_layers) for stage in result.stages]


def token_time(footprint: ModelFootprint, agents: list[AgentCandidate], options: PlanOptions,
               hop: float) -> float:
    stages = plan(footprint, agents, options).stages
    return max(stage.relative_time for stage in stages) + hop * len(stages)


def test_the_default_hop_is_a_millisecond_in_the_planners_unit() -> None:
    # a deploy plans with speeds in weight GB/s: a stage's time, bytes / speed, is in nanoseconds
    assert PlanOptions().hop_cost == 1_000_000.0
    (stage,) = plan(model(1), [pc("a", 5.0)], ALL).stages
    assert stage.relative_time == pytest.approx(1_000_000.0)  # 5 MB at 5 GB/s: 1 ms


def test_a_pc_20x_slower_gets_no_layer_that_saves_less_than_its_hop() -> None:
    # 81 layers of 5 MB: 0.5 ms a layer on the fast PCs, 10 ms on the slow one. Its one layer would cut the
    # slowest stage from 41 layers to 40: 0.5 ms saved for a 1 ms hop.
    agents = [pc("fast1", 10.0), pc("fast2", 10.0), pc("slow", 0.5)]
    assert [agent for agent, _ in split(model(), agents, FREE)] == ["fast1", "fast2", "slow"]  # as before
    assert sorted(split(model(), agents, ALL)) == [("fast1", 40), ("fast2", 41)]
    (left_out,) = plan(model(), agents, ALL).exclusions
    assert left_out.agent_id == "slow" and left_out.reason is ExclusionReason.NOT_NEEDED
    assert "by more than a hop costs (0.05 of the slowest stage; --hop-ms 0 counts hops as free)" in left_out.message
    assert token_time(model(), agents, ALL, 1e6) < token_time(model(), agents, FREE, 1e6)


def test_a_pc_that_saves_more_than_its_hop_is_still_added() -> None:
    agents = [pc("fast1", 10.0), pc("fast2", 10.0), pc("half", 5.0)]
    assert [agent for agent, _ in split(model(), agents, ALL)] == ["fast1", "fast2", "half"]
    # the same fleet with hops dearer than what the third PC saves (20.5 -> 16.5 ms): two PCs
    dear = dataclasses.replace(ALL, hop_cost=5e6)
    assert [agent for agent, _ in split(model(), agents, dear)] == ["fast1", "fast2"]


def test_a_model_whose_token_costs_less_than_a_hop_stays_on_one_pc() -> None:
    # the demo target (16M, a token in ~1.4 ms on one PC) priced its fleet rows' hops: 2 PCs made 0.73x of one
    agents = [pc("a", 10.0), pc("b", 10.0), pc("c", 10.0), pc("d", 10.0)]
    assert split(model(8, 1.5), agents, FREE) == [("a", 2), ("b", 2), ("c", 2), ("d", 2)]
    assert split(model(8, 1.5), agents, ALL) == [("a", 8)]


def test_the_hop_weighs_every_leading_part_of_the_chain() -> None:
    # equal PCs: each one added saves less as the split grows; it stops where the saving falls under a hop
    agents = [pc(f"pc{index}", 10.0) for index in range(8)]
    counts = {hop: len(split(model(48, 10.0), agents, dataclasses.replace(ALL, hop_cost=hop)))
              for hop in (0.0, 1e6, 3e6, 10e6)}
    # 48 ms on 1 PC, 24 on 2, 16 on 3, 12 on 4, ...: a hop of 1 ms stops at 6 (8 ms + 6), of 3 ms at 4
    assert counts == {0.0: 8, 1e6: 6, 3e6: 4, 10e6: 2}


def test_fewest_agents_plans_as_before_whatever_the_hop() -> None:
    generator = random.Random(7)
    for _ in range(60):
        footprint = ModelFootprint.uniform("m", generator.randint(1, 30), generator.randint(1, 400) * MB,
                                           generator.randint(0, 300) * MB, generator.randint(0, 300) * MB, 0, 16)
        agents = [pc(f"pc{index}", generator.uniform(0.2, 20.0), generator.randint(200, 6000) * MB)
                  for index in range(generator.randint(1, 6))]
        fewest = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=64 * MIB)
        plans = [plan(footprint, agents, dataclasses.replace(fewest, hop_cost=hop)) for hop in (0.0, 1e6, 1e9)]
        assert plans[0] == plans[1] == plans[2]


def test_all_by_speed_is_never_slower_a_token_than_its_split_with_free_hops() -> None:
    generator = random.Random(11)
    for _ in range(80):
        footprint = ModelFootprint.uniform("m", generator.randint(1, 24), generator.randint(1, 40) * MB, 0,
                                           generator.randint(0, 40) * MB, 0, 16)
        agents = [pc(f"pc{index}", generator.choice((0.5, 1.0, 5.0, 10.0, 20.0)),
                     generator.randint(20, 2000) * MB) for index in range(generator.randint(1, 6))]
        if not plan(footprint, agents, FREE).feasible:
            assert not plan(footprint, agents, ALL).feasible
            continue
        priced = token_time(footprint, agents, ALL, ALL.hop_cost)
        assert priced <= token_time(footprint, agents, FREE, ALL.hop_cost) * (1 + 1e-9)
        # nor slower than any leading part of the speed order that holds the model in that order (where none
        # does, other orders are searched only when the whole fleet has no split in speed order)
        ordered = sorted(agents, key=lambda a: (-a.speed, a.agent_id))
        for size in range(1, len(ordered) + 1):
            part = plan(footprint, ordered[:size], FREE)
            used = [stage.agent_id for stage in part.stages]
            if part.feasible and used == [agent.agent_id for agent in ordered if agent.agent_id in used]:
                assert priced <= token_time(footprint, ordered[:size], FREE, ALL.hop_cost) * (1 + 1e-9)


def test_the_hop_cost_is_checked() -> None:
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="hop_cost must be 0 or more"):
            plan(model(), [pc("a", 1.0)], dataclasses.replace(ALL, hop_cost=bad))
