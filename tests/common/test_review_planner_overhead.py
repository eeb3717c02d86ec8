"""A stage's runtime reserve must be what a stage holds beyond the terms the plan counts on their own (weights as
held, KV cache, prefill scratch), or every stage of a plan reserves memory nobody uses and a PC that holds a stage
is called too small. The 256 MiB it was also stood for a prefill's activations, which the footprint's
prefill_bytes_per_token now reserves (common/prefill_scratch.py, PREFILL_SCRATCH).

Measured (CPU plugin, 2-core EPYC, fresh process per stage, default `fast` settings): resident anonymous memory
after compiling, the warm-up call and 16 decode tokens, less the stage's weight files, 19.7 / 47.6 / 29.3 MB for
the whole 170M / 330M / 1.1B INT4 models, 38.3 MB for the 330M's layers [12:24) and 47.4 MB for the 1.1B's [4:12)
(both fed hidden states)."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import AgentCandidate, ExclusionReason, ModelFootprint, PlanOptions, plan

MB = 1_000_000
MEASURED_RUNTIME = (19.7 * MB, 47.6 * MB, 29.3 * MB, 38.3 * MB, 47.4 * MB)


def test_the_runtime_reserve_covers_the_measured_stages_with_a_margin_and_no_more() -> None:
    reserve = PlanOptions().stage_overhead_bytes
    assert 1.5 * max(MEASURED_RUNTIME) <= reserve <= 2.5 * max(MEASURED_RUNTIME)


def test_a_stage_is_planned_at_its_terms_plus_the_runtime_reserve_once() -> None:
    # 1.1B INT4 layers [4:12) as measured: 252.9 MB of files; scratch and KV as the footprint says
    model = ModelFootprint("m1b", (31_612_500,) * 8, 0, 0, 1000, 1000, resident_factor=1.3,
                           prefill_bytes_per_token=5000)
    options = PlanOptions(margin_fraction=0.0, margin_min_bytes=0)
    (stage,) = plan(model, [AgentCandidate("pc", AgentState.AVAILABLE, 8000 * MB, 1.0)], options).stages
    beyond = stage.memory_bytes - model.resident(stage.weight_bytes) - stage.kv_bytes - stage.prefill_bytes
    assert beyond == options.stage_overhead_bytes
    measured = 252.9 * MB + 47.4 * MB + stage.kv_bytes + stage.prefill_bytes  # what it held, at most
    assert measured <= stage.memory_bytes <= measured + 200 * MB  # 256 MiB besides the x1.3 reserved 346 MB more


def test_a_pc_with_room_for_a_stage_as_held_is_not_left_out_for_a_reserve_it_would_not_use() -> None:
    # a 330M-sized model (174 MB of files, x1.3 as held: 227 MB) on a PC with 450 MB usable: 328 MB planned now,
    # 495 MB before (infeasible); a PC with 150 MB, room for a layer (9 MB) and the runtime, was too small for any
    model = ModelFootprint("m330", (7_266_667,) * 24, 0, 0, 0, 2048, resident_factor=1.3)
    options = PlanOptions(margin_fraction=0.0, margin_min_bytes=0)
    small = AgentCandidate("small", AgentState.AVAILABLE, 150 * MB, 2.0)
    result = plan(model, [AgentCandidate("pc", AgentState.AVAILABLE, 450 * MB, 1.0), small], options)
    assert result.feasible, result.problems
    assert [stage.agent_id for stage in result.stages] == ["pc"]
    assert not any(e.reason is ExclusionReason.TOO_LITTLE_MEMORY for e in result.exclusions)
