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
    Exclusion,
    ExclusionReason,
    ModelFootprint,
    Plan,
    PlanOptions,
    PlanPolicy,
    left_out_text,
    plan,
    usable_bytes,
)
from deskfleet.controller.plan_text import render_plan

NO_MARGIN = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)
# free hops: these tests check the split of the slowest stage alone (test_review_planner_hops.py adds the hops)
ALL = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, margin_fraction=0.0, margin_min_bytes=0,
                  stage_overhead_bytes=0, hop_cost=0.0)


def available(agent_id: str, free_gb: float, speed: float = 1.0) -> AgentCandidate:
    return AgentCandidate(agent_id, AgentState.AVAILABLE, int(free_gb * GB), speed)


def toy(layers: int = 40, layer_gb: float = 0.1, embed_gb: float = 0.0,
        head_gb: float = 0.0) -> ModelFootprint:
    return ModelFootprint.uniform("toy", layers, int(layer_gb * GB), int(embed_gb * GB), int(head_gb * GB),
                                  kv_bytes_per_token_per_layer=0, context=1024)


def check_well_formed(result: Plan, agents: list[AgentCandidate], options: PlanOptions) -> None:
    named = [s.agent_id for s in result.stages] + [e.agent_id for e in result.exclusions]
    if not result.feasible:
        assert result.problems and not result.stages
        named += [agent_id for agent_id, _ in result.usable]
    assert sorted(named) == sorted(a.agent_id for a in agents)  # each candidate: used or explained, once
    if not result.feasible:
        return
    by_id = {a.agent_id: a for a in agents}
    assert result.stages[0].first_layer == 0 and result.stages[-1].stop_layer == result.model.num_layers
    for before, after in itertools.pairwise(result.stages):
        assert before.stop_layer == after.first_layer
    for stage in result.stages:
        assert stage.num_layers >= 1
        assert stage.has_embed == (stage.first_layer == 0)
        assert stage.has_head == (stage.stop_layer == result.model.num_layers)
        assert stage.memory_bytes <= usable_bytes(by_id[stage.agent_id], options)


def test_fewest_agents_puts_a_model_that_fits_on_the_fastest_single_pc() -> None:
    agents = [available("slow", 32, 1.0), available("fast", 32, 3.0), available("mid", 32, 2.0)]
    result = plan(toy(embed_gb=0.5, head_gb=0.5), agents, NO_MARGIN)
    assert [(s.agent_id, s.first_layer, s.stop_layer, s.has_embed, s.has_head) for s in result.stages] == [
        ("fast", 0, 40, True, True)]
    assert {e.agent_id: e.reason for e in result.exclusions} == {
        "slow": ExclusionReason.NOT_NEEDED, "mid": ExclusionReason.NOT_NEEDED}
    check_well_formed(result, agents, NO_MARGIN)


def test_all_by_speed_splits_layers_in_proportion_to_speed() -> None:
    agents = [available("a", 32, 1.0), available("b", 32, 2.0), available("c", 32, 1.0)]
    result = plan(toy(), agents, ALL)
    assert {s.agent_id: s.num_layers for s in result.stages} == {"a": 10, "b": 20, "c": 10}
    assert result.stages[0].agent_id == "b"  # chain order: fastest first
    check_well_formed(result, agents, ALL)


def test_memory_caps_a_fast_agent_and_the_rest_goes_to_the_others() -> None:
    agents = [available("fast-small", 1.0, 10.0), available("slow-big", 32, 1.0)]
    result = plan(toy(), agents, ALL)
    assert {s.agent_id: s.num_layers for s in result.stages} == {"fast-small": 10, "slow-big": 30}
    check_well_formed(result, agents, ALL)


def test_the_head_counts_as_work_and_the_embed_lookup_does_not() -> None:
    agents = [available("a", 32), available("b", 32)]
    result = plan(toy(layers=20, layer_gb=0.1, embed_gb=1.0, head_gb=1.0), agents, ALL)
    first, last = result.stages
    assert (first.num_layers, last.num_layers) == (15, 5)  # 1.5 GB of layers vs 0.5 + 1.0 head
    assert first.relative_time == pytest.approx(last.relative_time)


def test_head_work_when_known_replaces_its_bytes_for_time_but_not_for_memory() -> None:
    agents = [available("a", 32), available("b", 32)]
    by_bytes = toy(layers=20, layer_gb=0.1, head_gb=1.0)
    assert [s.num_layers for s in plan(by_bytes, agents, ALL).stages] == [15, 5]  # 1.5 vs 0.5 + 1.0
    light = ModelFootprint(by_bytes.name, by_bytes.layer_bytes, 0, by_bytes.head_bytes, 0, 1024,
                           head_work=0.2 * GB)
    first, last = plan(light, agents, ALL).stages
    assert (first.num_layers, last.num_layers) == (11, 9)  # 1.1 vs 0.9 + 0.2
    assert last.weight_bytes == int(0.9 * GB) + int(1.0 * GB)  # memory: the head's real bytes
    assert first.relative_time == pytest.approx(last.relative_time)
    with pytest.raises(ValueError, match="head_work"):
        ModelFootprint("bad", (1,), 0, 0, 0, 1, head_work=-1.0)


def test_every_agent_left_out_is_explained_with_numbers() -> None:
    agents = [
        AgentCandidate("paused", AgentState.PAUSED, 64 * GB, 5.0),
        AgentCandidate("opted-out", AgentState.PAUSED, 64 * GB, 5.0, None, "paused by its user"),  # its report says
        AgentCandidate("laptop", AgentState.UNAVAILABLE, 64 * GB, 5.0, UnavailableReason.ON_BATTERY,
                       "battery 41%, unplugged"),
        AgentCandidate("hot", AgentState.UNAVAILABLE, 64 * GB, 5.0, UnavailableReason.TOO_HOT, "CPU 97 °C"),
        AgentCandidate("busy", AgentState.SERVING, 64 * GB, 5.0),
        AgentCandidate("new", AgentState.AVAILABLE, 64 * GB, 0.0),
        available("tiny", 0.6, 9.0),
        available("worker", 16),
    ]
    options = PlanOptions(use_serving=False)
    result = plan(toy(), agents, options)
    assert [s.agent_id for s in result.stages] == ["worker"]
    messages = {e.agent_id: (e.reason, e.message) for e in result.exclusions}
    assert messages["paused"] == (ExclusionReason.PAUSED, "paused (by its user or in its settings)")
    assert messages["opted-out"] == (ExclusionReason.PAUSED, "paused by its user")
    assert messages["laptop"] == (ExclusionReason.UNAVAILABLE,
                                  "unavailable: on battery (battery 41%, unplugged)")
    assert messages["hot"] == (ExclusionReason.UNAVAILABLE, "unavailable: too hot (CPU 97 °C)")
    assert messages["busy"][0] is ExclusionReason.SERVING
    assert messages["new"] == (ExclusionReason.SPEED_UNKNOWN, "speed not measured yet")
    reason, message = messages["tiny"]
    assert reason is ExclusionReason.TOO_LITTLE_MEMORY
    assert "0.60 GB free" in message and "0.06 GB usable" in message and "needs 0.20 GB" in message
    check_well_formed(result, agents, options)
    # none left: what keeps each out, counted ("the model does not fit" alone read as a matter of size)
    nobody = plan(toy(), agents[:6], options)
    assert nobody.problems == ("none of the 6 agent(s) that answered can take work (2 paused, 1 serving, 1 speed "
                               "unknown, 2 unavailable) (`deskfleet-agent resume` on a PC its user paused) (see the "
                               "agents left out)",)


def test_an_agent_without_the_device_is_left_out_saying_what_it_has() -> None:
    # `fleet deploy --device GPU` over a PC with no GPU was refused by that PC only once every shard was sent
    fast = dataclasses.replace(available("no-gpu", 16, 9.0), devices=("CPU",))
    gpu = dataclasses.replace(available("gpu", 16), devices=("CPU", "GPU.0", "NPU"))
    older = available("older", 16, 5.0)  # an agent that reports no devices: not known, so not left out
    agents = [fast, gpu, older]
    result = plan(toy(), agents, dataclasses.replace(ALL, device="GPU"))
    assert sorted(s.agent_id for s in result.stages) == ["gpu", "older"]
    messages = {e.agent_id: (e.reason, e.message) for e in result.exclusions}
    assert messages == {"no-gpu": (ExclusionReason.NO_DEVICE, "no GPU: OpenVINO finds CPU on it")}
    check_well_formed(result, agents, dataclasses.replace(ALL, device="GPU"))
    assert {s.agent_id for s in plan(toy(), agents, ALL).stages} == {"no-gpu", "gpu", "older"}  # none asked
    assert {s.agent_id for s in plan(toy(), agents, dataclasses.replace(ALL, device="AUTO")).stages} == \
        {"no-gpu", "gpu", "older"}  # AUTO takes what there is
    alone = plan(toy(), [fast], dataclasses.replace(NO_MARGIN, device="NPU"))
    assert not alone.feasible and "none of the 1 agent(s) that answered can take work (1 no device)" in \
        alone.problems[0]
    assert "no NPU: OpenVINO finds CPU on it" in render_plan(alone)


def test_left_out_text_lists_who_and_why_but_not_the_unreachable_the_problem_names() -> None:
    paused = [AgentCandidate(f"p{index}", AgentState.PAUSED, GB, 1.0) for index in range(4)]
    gone = Exclusion("g", ExclusionReason.UNREACHABLE, "unreachable at 10.0.0.9:7443: timed out")
    result = plan(toy(), paused, NO_MARGIN, (gone,))
    assert left_out_text(result, shown=2) == ("left out: p0 paused (by its user or in its settings); "
                                              "p1 paused (by its user or in its settings); and 2 more")
    assert left_out_text(plan(toy(), [], NO_MARGIN, (gone,))) == ""


def test_pcs_of_another_protocol_are_told_to_upgrade_not_to_start_their_agent() -> None:
    # an old release's agent, running, closes our Hello: the plan said "start `deskfleet-agent --headless` on them"
    old = Exclusion("o", ExclusionReason.OTHER_PROTOCOL, "agent o at 10.0.0.8:7431 speaks fleet protocol 7 ...: "
                                                         "upgrade deskfleet on agent o")
    gone = Exclusion("g", ExclusionReason.UNREACHABLE, "unreachable at 10.0.0.9:7443: timed out")
    (alone,) = plan(toy(), [], NO_MARGIN, (old,)).problems
    assert alone.startswith("no reachable agents: 1 found but unreachable (o agent o at 10.0.0.8:7431 speaks fleet "
                            "protocol 7")
    assert alone.endswith("): upgrade deskfleet where one speaks another fleet protocol, as its message says")
    (both,) = plan(toy(), [], NO_MARGIN, (old, gone)).problems
    assert both.endswith("): start `deskfleet-agent --headless` on them; upgrade deskfleet where one speaks another "
                         "fleet protocol, as its message says")
    paused = [AgentCandidate("p", AgentState.PAUSED, GB, 1.0)]
    (silent,) = plan(toy(), paused, NO_MARGIN, (old,)).problems
    assert "1 more found did not answer (upgrade deskfleet where one speaks another" in silent
    assert left_out_text(plan(toy(), paused, NO_MARGIN, (old,))).startswith("left out: p paused")  # o: the problem's


def test_safety_margin_is_configurable() -> None:
    agent = available("a", 10)
    assert usable_bytes(agent, PlanOptions(margin_fraction=0.5, margin_min_bytes=0)) == 5 * GB
    assert usable_bytes(agent, PlanOptions(margin_fraction=0.0, margin_min_bytes=3 * GB)) == 7 * GB
    assert usable_bytes(available("b", 1), PlanOptions(margin_fraction=0.0, margin_min_bytes=3 * GB)) == 0
    model = toy(layers=10, layer_gb=0.9)  # 9 GB
    assert plan(model, [agent], PlanOptions(margin_fraction=0.05, margin_min_bytes=0,
                                            stage_overhead_bytes=0)).feasible
    assert not plan(model, [agent], PlanOptions(margin_fraction=0.2, margin_min_bytes=0,
                                                stage_overhead_bytes=0)).feasible


def test_kv_for_every_stream_at_full_context_is_reserved() -> None:
    model = ModelFootprint.uniform("kv", 4, GB, 0, 0, kv_bytes_per_token_per_layer=1000, context=250_000)
    one = plan(model, [available("a", 6)], NO_MARGIN)
    assert one.feasible and one.stages[0].kv_bytes == GB
    options = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0, streams=4)
    four = plan(model, [available("a", 6)], options)
    assert not four.feasible and "memory short by 2.00 GB" in four.problems[0]


def test_infeasible_when_total_memory_is_short_says_by_how_much() -> None:
    agents = [available("a", 4), available("b", 4), AgentCandidate("p", AgentState.PAUSED, 64 * GB, 1.0)]
    result = plan(toy(layers=10, layer_gb=1.0), agents, NO_MARGIN)
    assert not result.feasible
    assert result.problems == ("memory short by 2.00 GB: the model needs 10.00 GB (10.00 GB weights + "
                               "0.00 GB KV for 1 stream(s) at context 1024 + runtime 0.00 GB per stage) "
                               "and the 2 usable agent(s) have 8.00 GB after safety margins",)
    text = render_plan(result)
    assert "Infeasible" in text and "short by 2.00 GB" in text and "paused (by its user or in its settings)" in text
    assert "Usable: a 4.00 GB, b 4.00 GB" in text


def test_infeasible_when_layers_do_not_pack_into_contiguous_ranges() -> None:
    agents = [available("a", 6), available("b", 6)]
    result = plan(toy(layers=3, layer_gb=4.0), agents, NO_MARGIN)  # 12 GB in 12 GB, but 4 GB pieces
    assert not result.feasible and "no split into contiguous layer ranges" in result.problems[0]


def test_no_agent_can_work() -> None:
    assert plan(toy(), [], NO_MARGIN).problems == ("no agents in the fleet",)
    paused = [AgentCandidate("p", AgentState.PAUSED, GB, 1.0)]
    assert "none of the 1 agent(s)" in plan(toy(), paused, NO_MARGIN).problems[0]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no decoder layers"):
        plan(toy(layers=0), [available("a", 1)])
    # a negative size or context made a "feasible" plan that overcommitted the PC (negative KV bytes)
    for field, value, message in (("kv_bytes_per_token_per_layer", -10**6, "KV bytes per token must be 0 or more"),
                                  ("head_bytes", -3 * 10**9, "head bytes must be 0 or more"),
                                  ("context", 0, "at least 1 token")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(toy(), **{field: value})
    with pytest.raises(ValueError, match="layer bytes must be 0 or more"):
        dataclasses.replace(toy(), layer_bytes=(GB, -GB))
    with pytest.raises(ValueError, match="streams"):
        plan(toy(), [available("a", 1)], PlanOptions(streams=0))


def test_a_70b_int4_on_paper_over_office_pcs() -> None:
    # Llama-3-70B, INT4 group-wise: ~0.45 GB per layer, 128256 x 8192 embed and head, 8 KV heads x 128, f16 KV
    model = ModelFootprint.uniform("llama-3-70b-int4", 80, int(0.45 * GB), int(1.05 * GB), int(1.05 * GB),
                                   kv_bytes_per_token_per_layer=2 * 8 * 128 * 2, context=8192)
    office = [available(f"pc-{n}", free, speed) for n, (free, speed) in
              enumerate([(14, 1.0), (14, 1.0), (12, 0.8), (20, 1.4), (6, 0.6)])]
    result = plan(model, office)
    check_well_formed(result, office, PlanOptions())
    assert result.feasible and len(result.stages) == 3
    assert sorted(s.agent_id for s in result.stages) == ["pc-0", "pc-1", "pc-3"]
    spread = plan(model, office, PlanOptions(policy=PlanPolicy.ALL_BY_SPEED))
    check_well_formed(spread, office, PlanOptions(policy=PlanPolicy.ALL_BY_SPEED))
    assert len(spread.stages) == 5
    text = render_plan(result)
    assert "llama-3-70b-int4: 80 layers" in text and "embed" in text and "head" in text
    assert "not needed" in text
    assert not plan(model, office[:2]).feasible


def test_when_memory_is_tight_another_chain_order_fits() -> None:
    # In speed order the fast PC would hold the embed and cannot (1 byte free); the slow one cannot hold
    # everything (5 bytes in 4). The slow PC first, with the embed and a layer, and the fast one after fits.
    model = ModelFootprint("tight", (1, 1), 3, 0, 0, 1)
    fast = AgentCandidate("fast", AgentState.AVAILABLE, 1, 2.0)
    slow = AgentCandidate("slow", AgentState.AVAILABLE, 4, 1.0)
    for options in (NO_MARGIN, ALL):
        result = plan(model, [fast, slow], options)
        check_well_formed(result, [fast, slow], options)
        assert result.feasible, result.problems
        assert [(s.agent_id, s.first_layer, s.stop_layer) for s in result.stages] == [("slow", 0, 1), ("fast", 1, 2)]
    budget = dataclasses.replace(ALL, max_reordered_splits=0)  # no search beyond speed order: infeasible
    assert "no split into contiguous layer ranges" in plan(model, [fast, slow], budget).problems[0]


def brute_force_pace(model: ModelFootprint, agents: list[AgentCandidate], any_order: bool = False) -> float | None:
    """The best slowest-stage time over every contiguous split, agents in the planner's chain order (fastest
    first) or, any_order, in every order, each stage within its PC's free memory and shard-cache room."""
    ordered = sorted(agents, key=lambda a: (-a.speed, a.agent_id))
    best: float | None = None
    layers = model.num_layers
    for used in range(1, len(ordered) + 1):
        subsets = (itertools.chain.from_iterable(itertools.permutations(subset) for subset in
                                                 itertools.combinations(ordered, used))
                   if any_order else itertools.combinations(ordered, used))
        for subset in subsets:
            for cuts in itertools.combinations(range(1, layers), used - 1):
                bounds = (0, *cuts, layers)
                times = []
                for agent, (start, stop) in zip(subset, itertools.pairwise(bounds), strict=True):
                    weights = sum(model.layer_bytes[start:stop]) + (model.head_bytes if stop == layers else 0)
                    memory = weights + (model.embed_bytes if start == 0 else 0)  # the files too, as weights stand
                    if memory > usable_bytes(agent, NO_MARGIN) or \
                            (agent.disk_room_bytes is not None and memory > agent.disk_room_bytes):
                        break
                    times.append(weights / agent.speed)
                else:
                    pace = max(times)
                    best = pace if best is None else min(best, pace)
    return best


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    layer_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    embed=st.integers(0, 4),
    head=st.integers(0, 4),
    fleet=st.lists(st.tuples(st.integers(0, 16), st.integers(1, 4)), min_size=1, max_size=4),
)
def test_split_is_valid_and_as_fast_as_brute_force(layer_sizes: list[int], embed: int, head: int,
                                                   fleet: list[tuple[int, int]]) -> None:
    model = ModelFootprint("rand", tuple(layer_sizes), embed, head, 0, 1)
    agents = [AgentCandidate(f"a{i}", AgentState.AVAILABLE, free, float(speed))
              for i, (free, speed) in enumerate(fleet)]
    result = plan(model, agents, ALL)
    check_well_formed(result, agents, ALL)
    # The fastest split in any order: a small fleet's every order is tried, also where the order by speed fits (a
    # chain that ends on the fastest PC, which takes the head, can be faster)
    expected = brute_force_pace(model, agents, any_order=True)
    if expected is None:
        assert not result.feasible
    else:
        assert result.feasible
        assert max(s.relative_time for s in result.stages) == pytest.approx(expected)
    fewest = plan(model, agents, NO_MARGIN)
    check_well_formed(fewest, agents, NO_MARGIN)
    assert fewest.feasible == result.feasible
    if fewest.feasible:
        assert len(fewest.stages) <= len(result.stages)


def test_a_speed_left_out_is_said_in_three_figures() -> None:
    # "with speed 4.59524": a measured GB/s printed to the float's last digit.
    agents = [available("fast", 64, 300.0), available("slow", 64, 4.59524)]
    result = plan(toy(), agents, PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, hop_cost=1.0))
    (left_out,) = [e for e in result.exclusions if e.agent_id == "slow"]
    assert left_out.reason is ExclusionReason.NOT_NEEDED and "not used: with speed 4.6 GB/s and " in left_out.message


def test_all_by_speed_with_free_hops_ends_on_the_fastest_pc_where_the_head_is_dear() -> None:
    # A walk's three PCs (22.2 / 6.56 / 5.54 GB/s) and the demo target, `--policy all_by_speed --hop-ms 0`: the order
    # by speed put the head on the last PC given layers, a slow one, so the plan took the fastest alone and said the
    # others "would not shorten the slowest stage"; the slow PCs first and the fastest last, with the head, are faster
    model = ModelFootprint.uniform("demo", 8, 700_000, 3_200_000, 3_200_000, 1024, 1024)
    carol, alice, bob = (AgentCandidate(name, AgentState.AVAILABLE, 8 << 30, speed)
                         for name, speed in (("carol", 22.2), ("alice", 6.56), ("bob", 5.54)))
    free_hops = dataclasses.replace(ALL, hop_cost=0.0)
    result = plan(model, [carol, alice, bob], free_hops)
    alone = plan(model, [carol], free_hops)
    assert result.feasible and result.stages[-1].agent_id == "carol" and len(result.stages) == 3
    assert max(s.relative_time for s in result.stages) < 0.8 * max(s.relative_time for s in alone.stages)
    check_well_formed(result, [carol, alice, bob], free_hops)


def test_all_by_speed_tries_a_few_orders_more_on_a_larger_fleet() -> None:
    # beyond every order of four, the order by speed with one of its three fastest moved to the end: the plan of 10
    # PCs took 4.3 s where every first and last was tried, 0.1 s by speed alone
    model = ModelFootprint.uniform("m", 40, 700_000, 3_200_000, 6_400_000, 1024, 1024)
    agents = [AgentCandidate(f"a{index}", AgentState.AVAILABLE, 8 << 30, 30.0 - index) for index in range(8)]
    result = plan(model, agents, dataclasses.replace(ALL, hop_cost=0.0))
    assert result.feasible and result.stages[-1].agent_id in {"a0", "a1", "a2"}
    by_speed_last = [stage.agent_id for stage in result.stages]
    assert by_speed_last[:-1] == sorted(by_speed_last[:-1], key=lambda name: int(name[1:]))
