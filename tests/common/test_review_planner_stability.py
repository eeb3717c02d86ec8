"""Plans of a model that is deployed: an agent's reported free memory already lacks the stage it hosts, and a
redeploy moves shards, so a plan made again over nearly the same reports must not move layers needlessly."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import GB, MIB, AgentCandidate, ModelFootprint, PlanOptions, PlanPolicy, plan

MODEL = ModelFootprint.uniform("m", 40, 250_000_000, 500_000_000, 500_000_000, 1024, 1024)  # 11 GB of weights
OPTIONS = PlanOptions()  # 10% / 512 MiB margin, 96 MiB runtime a stage, 1 stream
ALL = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED)


def pc(agent_id: str, free: float, speed: float, hosted: tuple[tuple[int, int], ...] = ()) -> AgentCandidate:
    return AgentCandidate(agent_id, AgentState.SERVING if hosted else AgentState.AVAILABLE, int(free), speed,
                          hosted=hosted)


def split(agents: list[AgentCandidate], options: PlanOptions = OPTIONS) -> list[tuple[str, int, int]]:
    result = plan(MODEL, agents, options)
    assert result.feasible, result.problems
    return [(s.agent_id, s.first_layer, s.stop_layer) for s in result.stages]


def held(first: int, stop: int) -> int:
    """What a stage took from the PC's free memory once loaded (its weights, runtime; KV still empty)."""
    weights = 250_000_000 * (stop - first) + (500_000_000 if first == 0 else 0) + (500_000_000 if stop == 40 else 0)
    return weights + OPTIONS.stage_overhead_bytes


def test_a_pc_that_hosts_the_whole_model_keeps_it_when_the_plan_is_made_again() -> None:
    before = split([pc("fast", 16 * GB, 2.0), pc("slow", 16 * GB, 1.0)])
    assert before == [("fast", 0, 40)]
    # deployed: the fast PC's free memory now lacks the stage; planned again (a second deploy, a failover)
    after = split([pc("fast", 16 * GB - held(0, 40), 2.0, ((0, 40),)), pc("slow", 16 * GB, 1.0)])
    assert after == before  # was [("slow", 0, 40)]: the model moved to the slower PC, and back at the next plan


def test_a_split_over_two_pcs_is_kept_as_deployed() -> None:
    agents = [pc("a", 9 * GB, 2.0), pc("b", 9 * GB, 1.0)]
    before = split(agents, ALL)
    assert [stop - first for _, first, stop in before] == [28, 12]  # 7 GB of layers vs 3 + the 0.5 GB head
    hosted = [pc(agent_id, 9 * GB - held(first, stop), speed, ((first, stop),))
              for (agent_id, first, stop), speed in zip(before, (2.0, 1.0), strict=True)]
    assert split(hosted, ALL) == before


def test_between_equally_fast_pcs_the_one_that_hosts_the_model_keeps_it_whatever_the_memory_wobble() -> None:
    first = split([pc("a", 16 * GB + 3 * MIB, 1.0), pc("b", 16 * GB, 1.0)])
    (agent_id, _, _), = first
    other = "b" if agent_id == "a" else "a"
    for wobble in (-3, 0, 3):  # the other PC has a few MB more or less free than the host had before
        again = split([pc(agent_id, 16 * GB - held(0, 40) + wobble * MIB, 1.0, ((0, 40),)),
                       pc(other, 16 * GB + wobble * MIB, 1.0)])
        assert again == first


def test_a_strictly_faster_plan_still_moves_the_layers() -> None:
    # the slow PC hosts the model; a faster PC joined: the fewest-agents plan moves it there
    agents = [pc("slow", 16 * GB - held(0, 40), 1.0, ((0, 40),)), pc("new-fast", 16 * GB, 3.0)]
    assert split(agents) == [("new-fast", 0, 40)]


def test_a_hosted_range_still_needs_room_for_its_kv_cache() -> None:
    kv_model = ModelFootprint.uniform("kv", 40, 250_000_000, 0, 0, 200_000, 4096)  # 0.82 GB of KV a layer a stream
    host = AgentCandidate("host", AgentState.SERVING, 1 * GB, 1.0, hosted=((0, 40),))  # 1 GB left: no KV fits
    result = plan(kv_model, [host], OPTIONS)
    assert not result.feasible


def test_a_pc_whose_stage_left_it_little_free_memory_keeps_its_stage() -> None:
    # two 8 GB PCs hold a split; each has about 2.3 GB left, less than a fresh stage would need on either
    agents = [pc("a", 8 * GB, 1.0), pc("b", 8 * GB, 1.0)]
    before = split(agents, ALL)
    hosted = [pc(agent_id, 8 * GB - held(first, stop), 1.0, ((first, stop),)) for agent_id, first, stop in before]
    assert min(agent.free_memory_bytes for agent in hosted) < 3 * GB
    assert split(hosted, ALL) == before
    assert split(hosted, OPTIONS) == before  # no single PC holds it: the fewest agents are these two
