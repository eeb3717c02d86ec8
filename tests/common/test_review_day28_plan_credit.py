"""A stage that has served holds the scratch of its largest prefill (the CPU plugin keeps the buffers), so the
free memory its PC reports lacks it. The re-plan of a failover and a second deploy count a hosted stage's memory
back for its range (`_credit`): since the scratch was reserved per stage, it must be counted back too, or the
scratch is reserved twice and a PC is called too small for the stage it serves.

Llama-3-8B-shaped INT4 (32 layers of 115.6 MB, INT8 embed and head of 525 MB, u8 KV 2176 bytes a token and
layer x2.5, context 8192): the first stage's scratch is 5.13 GB, the others' 6.64 GB. Two PCs with 12 GB free
hold [0:18) and [18:32) (9.42 and 10.16 GB of 10.80 usable); after a full-context prompt, each reports 12 GB
less its stage's weights x1.3, runtime and scratch (3.3 GB and 2.3 GB). Before, only the weights and the
runtime were counted back: neither PC could keep its own stage (the plan was infeasible)."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import AgentCandidate, ModelFootprint, PlanOptions, PlanPolicy, plan
from deskfleet.controller.plan_text import render_plan

LAYER, EMBED = 115_595_018, 128_256 * 4096
MODEL = ModelFootprint("l8b", (LAYER,) * 32, EMBED, EMBED, 2 * 8 * (128 + 8), 8192, resident_factor=1.3,
                       kv_growth=2.5, prefill_bytes_per_token=44 * (4096 + 14336),
                       first_prefill_bytes_per_token=34 * (4096 + 14336))


def _served(agent_id: str, start: int, stop: int, options: PlanOptions) -> AgentCandidate:
    """A 12 GB-free PC that hosts [start, stop) and has run a full-context prefill on it (its KV freed)."""
    weights = LAYER * (stop - start) + (EMBED if start == 0 else 0) + (EMBED if stop == 32 else 0)
    held = MODEL.resident(weights) + options.stage_overhead_bytes + MODEL.prefill_scratch_bytes(1, start == 0)
    return AgentCandidate(agent_id, AgentState.SERVING, 12_000_000_000 - held, 10.0, hosted=((start, stop),))


def test_the_deployed_split_still_fits_the_pcs_that_serve_it_after_a_long_prompt() -> None:
    for policy in PlanPolicy:
        options = PlanOptions(policy=policy)
        fresh = plan(MODEL, [AgentCandidate(name, AgentState.AVAILABLE, 12_000_000_000, 10.0) for name in "ab"],
                     options)
        split = [(s.agent_id, s.first_layer, s.stop_layer) for s in fresh.stages]
        assert [agent for agent, _, _ in split] == ["a", "b"], render_plan(fresh)
        served = [_served(name, start, stop, options) for name, start, stop in split]
        result = plan(MODEL, served, options)
        assert result.feasible, render_plan(result)
        assert [(s.agent_id, s.first_layer, s.stop_layer) for s in result.stages] == split


def test_memory_short_names_the_first_stages_own_scratch() -> None:
    """The need counts the first stage's scratch (5.13 GB); the text named only the others' (6.64 GB), so a single
    PC's parts (6.17 + 1.43 + 6.64 + 0.10 GB) did not add up to the 12.84 GB it said the model needs."""
    result = plan(MODEL, [AgentCandidate("a", AgentState.AVAILABLE, 12_000_000_000, 1.0)], PlanOptions())
    (problem,) = result.problems
    assert "needs 12.84 GB" in problem
    assert "prefill scratch 5.13 GB on the first stage, 6.64 GB on each other" in problem, problem
