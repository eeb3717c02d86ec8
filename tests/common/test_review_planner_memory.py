"""A plan must reserve the memory a stage really comes to hold, or a PC planned too optimistically runs out of
memory on its user's desk. Measured on the CPU plugin (OpenVINO 2026.4, 170M INT4, 12 layers, context 2048;
controller/fleet_deploy.py has every figure): a KV cache grows by doubling, so at the full context an f32 cache
held 1.97x its tokens' bytes and a u8 one 2.49x (with its per-token scales); and a prefill of 2048 tokens left
242-335 MB of scratch held, which the plan did not count at all. The planner reserves the cache times the
model's kv_growth and, per stage, the scratch of a prefill of `streams` prompts of the whole context."""

from __future__ import annotations

import dataclasses

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import AgentCandidate, ExclusionReason, ModelFootprint, PlanOptions, plan
from deskfleet.controller.plan_text import render_plan

MB = 1_000_000
BARE = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)


def agent(name: str, free: int, speed: float = 1.0) -> AgentCandidate:
    return AgentCandidate(name, AgentState.AVAILABLE, free, speed)


def model(growth: float = 1.0, scratch: int = 0, first: int | None = None, layers: int = 4) -> ModelFootprint:
    """10 MB layers, 1000 bytes of KV per token and layer, context 1000: 1 MB of KV tokens per layer."""
    return ModelFootprint("m", (10 * MB,) * layers, 0, 0, 1000, 1000, kv_growth=growth,
                          prefill_bytes_per_token=scratch, first_prefill_bytes_per_token=first)


def test_the_kv_cache_is_reserved_as_it_grows_not_as_its_tokens() -> None:
    whole = plan(model(growth=2.0), [agent("a", 100 * MB)], BARE).stages[0]
    assert whole.kv_bytes == 4 * 2 * MB  # 4 layers x 1 MB of tokens x 2
    assert whole.memory_bytes == 40 * MB + 8 * MB
    # room for the tokens' bytes (44 MB) but not for the cache as it grows (48 MB)
    tight = plan(model(growth=2.0), [agent("a", 46 * MB)], BARE)
    assert not tight.feasible
    assert plan(model(), [agent("a", 46 * MB)], BARE).feasible
    streams = dataclasses.replace(BARE, streams=3)
    assert plan(model(growth=2.5), [agent("a", 100 * MB)], streams).stages[0].kv_bytes == 4 * 3 * 2_500_000


def test_every_stage_reserves_the_scratch_of_its_largest_prefill() -> None:
    # 5000 bytes a token, the first stage 3000: a prompt of the whole context (1000 tokens) x streams
    footprint = model(scratch=5000, first=3000)
    two = plan(footprint, [agent("a", 30 * MB, 2.0), agent("b", 30 * MB)], BARE)
    assert two.feasible and len(two.stages) == 2
    first, second = two.stages
    assert (first.prefill_bytes, second.prefill_bytes) == (3 * MB, 5 * MB)
    assert first.memory_bytes == first.weight_bytes + first.kv_bytes + 3 * MB
    assert second.memory_bytes == second.weight_bytes + second.kv_bytes + 5 * MB
    streams = plan(footprint, [agent("a", 100 * MB)], dataclasses.replace(BARE, streams=2)).stages[0]
    assert streams.prefill_bytes == 6 * MB  # two prompts of the whole context prefilled in one call
    # 44 MB of weights and KV fit 47 MB; with the first stage's 3 MB of scratch they do not
    assert plan(model(), [agent("a", 46 * MB)], BARE).feasible
    assert not plan(footprint, [agent("a", 46 * MB)], BARE).feasible


def test_a_pc_without_room_for_the_scratch_is_left_out_saying_so() -> None:
    footprint = model(scratch=20_000, layers=1)  # 20 MB of scratch beside an 11 MB stage
    result = plan(footprint, [agent("a", 25 * MB)], BARE)
    assert not result.feasible
    (left_out,) = result.exclusions
    assert left_out.reason is ExclusionReason.TOO_LITTLE_MEMORY
    assert "prefill scratch" in left_out.message
    short = plan(model(scratch=20_000, layers=4), [agent("a", 50 * MB)], BARE)
    assert "prefill scratch 0.02 GB" in short.problems[0]


def test_the_plan_text_says_how_the_kv_and_the_scratch_are_counted() -> None:
    footprint = dataclasses.replace(model(growth=2.5, scratch=5000, first=3000), kv_precision="u8")
    text = render_plan(plan(footprint, [agent("a", 30 * MB, 2.0), agent("b", 30 * MB)], BARE))
    assert "KV (u8, x2.5 as the cache grows)" in text
    assert "prefill scratch 0.00 GB / 0.01 GB (1000 tokens x 1 stream(s))" in text


def test_growth_and_scratch_are_checked() -> None:
    with pytest.raises(ValueError, match="kv_growth must be 1 or more"):
        model(growth=0.5)
    with pytest.raises(ValueError, match="prefill bytes per token must be 0 or more"):
        model(scratch=-1)
    with pytest.raises(ValueError, match="prefill bytes per token must be 0 or more"):
        model(first=-1)
