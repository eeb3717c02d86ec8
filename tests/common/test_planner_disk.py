"""The planner and each PC's shard-cache room (AgentCandidate.disk_room_bytes, from StatusReport.shard_room_bytes).

A plan sent a PC whose disk had no room for its stage's files a stage all the same: the deploy failed whole at its
start on that PC's refusal ("the stage's N files need ... which the cache cannot hold"), and a run's re-plan ended
the run. Now a stage's files, less those of the units its PC's hosted stages hold, fit its PC's room.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import (
    GB,
    AgentCandidate,
    ExclusionReason,
    ModelFootprint,
    PlanOptions,
    PlanPolicy,
    plan,
)
from tests.common.test_planner import brute_force_pace

NO_MARGIN = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)
ALL = replace(NO_MARGIN, policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.0)


def toy(layers: int = 8, layer: int = GB, embed: int = 0, head: int = 0) -> ModelFootprint:
    return ModelFootprint.uniform("toy", layers, layer, embed, head, kv_bytes_per_token_per_layer=0, context=16)


def pc(agent_id: str, free: float, speed: float = 1.0, disk: float | None = None,
       hosted: tuple[tuple[int, int], ...] = ()) -> AgentCandidate:
    return AgentCandidate(agent_id, AgentState.SERVING if hosted else AgentState.AVAILABLE, int(free * GB), speed,
                          hosted=hosted, disk_room_bytes=None if disk is None else int(disk * GB))


def test_a_pc_without_room_for_one_layers_files_is_left_out_saying_so() -> None:
    result = plan(toy(), [pc("roomy", 64, disk=100), pc("full", 64, speed=5.0, disk=0.5)], ALL)
    assert [stage.agent_id for stage in result.stages] == ["roomy"]
    left = next(exclusion for exclusion in result.exclusions if exclusion.agent_id == "full")
    assert left.reason is ExclusionReason.TOO_LITTLE_DISK
    assert "its shard cache can take 0.50 GB more" in left.message and "files (one layer) are 1.00 GB" in left.message


def test_the_split_gives_each_pc_no_more_files_than_its_room() -> None:
    # memory alone would split 8 layers 4 / 4 (same speed); the second PC's disk takes 3 layers' files
    result = plan(toy(), [pc("a", 64, disk=100), pc("b", 64, disk=3.5)], ALL)
    assert [(s.agent_id, s.first_layer, s.stop_layer) for s in result.stages] == [("a", 0, 5), ("b", 5, 8)]


def test_a_fleet_whose_memory_holds_the_model_but_whose_disks_do_not_is_told_so() -> None:
    result = plan(toy(), [pc("a", 64, disk=3), pc("b", 64, disk=2)], ALL)
    assert not result.feasible
    (problem,) = result.problems
    assert problem.startswith("the 2 usable agent(s) hold the model in memory, but no split's files (8.00 GB in all) "
                              "fit their shard caches, which can take a 3.00 GB, b 2.00 GB more")
    assert "free disk space on them, raise cache_limit_bytes where it bounds the room, or join more PCs" in problem
    # where memory is short too, memory is what it says
    short = plan(toy(), [pc("a", 3, disk=3), pc("b", 2, disk=2)], ALL)
    assert short.problems[0].startswith("memory short by")


def test_the_files_of_units_a_pc_hosts_need_no_room() -> None:
    model = toy(embed=GB // 2, head=GB // 2)
    # "a" hosts [0:4) (its embed too), "b" [4:8) with its head; neither disk has room for anything more
    hosts = [pc("a", 64, disk=0, hosted=((0, 4),)), pc("b", 64, disk=0, hosted=((4, 8),))]
    kept = plan(model, hosts, ALL)
    assert [(s.agent_id, s.first_layer, s.stop_layer) for s in kept.stages] == [("a", 0, 4), ("b", 4, 8)]
    # with a layer's room on "a", a faster "a" takes layer 4, whose file alone it must receive
    faster = [pc("a", 64, speed=1.5, disk=1, hosted=((0, 4),)), pc("b", 64, disk=0, hosted=((4, 8),))]
    grown = plan(model, faster, ALL)
    assert [(s.agent_id, s.first_layer, s.stop_layer) for s in grown.stages] == [("a", 0, 5), ("b", 5, 8)]
    # a PC hosting a stage is never left out for its disk (its stage's files are there)
    assert not any(e.reason is ExclusionReason.TOO_LITTLE_DISK for e in grown.exclusions)


def test_a_pc_that_reports_no_room_is_not_checked() -> None:
    # a PC typed in for `fleet plan --assume-agent`: None, planned on memory alone
    result = plan(toy(), [pc("old", 64)], ALL)
    assert result.feasible and result.stages[0].agent_id == "old"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    layer_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    embed=st.integers(0, 4),
    head=st.integers(0, 4),
    fleet=st.lists(st.tuples(st.integers(0, 16), st.integers(1, 4), st.none() | st.integers(0, 16)),
                   min_size=1, max_size=4),
)
def test_every_stage_fits_its_pcs_room_and_the_split_is_the_fastest_that_does(
        layer_sizes: list[int], embed: int, head: int, fleet: list[tuple[int, int, int | None]]) -> None:
    model = ModelFootprint("rand", tuple(layer_sizes), embed, head, 0, 1)
    agents = [AgentCandidate(f"a{i}", AgentState.AVAILABLE, free, float(speed), disk_room_bytes=disk)
              for i, (free, speed, disk) in enumerate(fleet)]
    result = plan(model, agents, ALL)
    by_id = {agent.agent_id: agent for agent in agents}
    for stage in result.stages:
        room = by_id[stage.agent_id].disk_room_bytes
        assert room is None or stage.weight_bytes <= room
    named = [s.agent_id for s in result.stages] + [e.agent_id for e in result.exclusions] + \
        ([agent_id for agent_id, _ in result.usable] if not result.feasible else [])
    assert sorted(named) == sorted(by_id)  # each PC: used or explained, once
    expected = brute_force_pace(model, agents, any_order=True)
    assert result.feasible == (expected is not None)
    if expected is not None:
        assert max(s.relative_time for s in result.stages) == expected


def test_a_deploys_files_are_what_the_plan_counts_for_each_stage(tiny_export: Path) -> None:
    # the disk a stage needs is the files a deploy sends it (controller/fleet_deploy.py _stage_entries): its units'
    # .xml and .bin, the RoPE table's IR and the manifest, not its weights alone
    from deskfleet.common.model_spec import MANIFEST_NAME, load_manifest
    from deskfleet.common.planner import _new_files
    from deskfleet.controller.fleet_deploy import StagePlacement, _stage_entries, footprint_of

    manifest = load_manifest(tiny_export)
    footprint = footprint_of(manifest, "CPU", manifest_file_bytes=(tiny_export / MANIFEST_NAME).stat().st_size)
    fresh = pc("fresh", 64)
    for start, stop in itertools.combinations(range(footprint.num_layers + 1), 2):
        sent = sum(entry.size for entry in _stage_entries(tiny_export, manifest, StagePlacement("a" * 52, "h:1", start,
                                                                                                   stop)))
        assert _new_files(footprint, fresh, start, stop) == sent
    # a PC hosting [0:2) receives only the files of layer 2 for [0:3)
    hosting = pc("host", 64, hosted=((0, 2),))
    layer_2 = sum(manifest.files[name].size for name in manifest.ir_files(manifest.layer_ir(2)))
    assert _new_files(footprint, hosting, 0, 3) == layer_2
