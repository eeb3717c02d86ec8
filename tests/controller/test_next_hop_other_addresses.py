"""A deploy gives each stage every address the survey knows of the PC after it (NextHop.other_addresses), and a
stage whose next hop does not answer at the address the controller reached it at dials the others; a plan never puts
two PCs whose addresses share no IP family next to each other.

From an exploratory test of a mixed IPv4/IPv6 office: a dual-stack PC that answered the controller over IPv6 was given
to the IPv4-only PC before it at that address alone; every run failed over and left the healthy PC out. On one
machine "an address the PC before it cannot reach" is a port nobody listens on; the driver is given the one the survey
reached."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import cast

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import Link, start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.agent_state import AgentState
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.planner import ModelFootprint, PlanOptions, PlanPolicy
from deskfleet.common.wire import NextHop, Precision, StatusReport, ip_families
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_deploy import DeploySettings, StagePlacement, _deploy_all, model_id_of, plan_survey
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import AgentView, Survey, SurveyOptions, links_of_no_shared_family, survey
from tests.agent.test_core import FakeMonitor
from tests.controller.test_fleet_deploy import chain_tokens, local_tokens
from tests.fleet_pki import make_member
from tests.ports import free_port


def test_a_stage_reaches_its_next_hop_at_another_of_its_addresses_and_the_tokens_are_the_local_ones(
        tmp_path: Path, tiny_export: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    manifest = load_manifest(tiny_export)
    model_id = model_id_of(tiny_export)
    ports = [free_port() for _ in range(2)]
    silent = f"127.0.0.1:{free_port()}"  # where the second PC does not listen
    files = [make_member(ca, tmp_path / f"agent{index}", "agent") for index in range(2)]
    ids = [member.own_identity().agent_id for member in files]
    # the second PC registered at two addresses, the silent one first
    store.save_roster({agent_id: RosterEntry(agent_id, f"desk-{index}", utc_now().isoformat(), addresses)
                       for index, (agent_id, addresses) in enumerate(zip(ids, [
                           (f"127.0.0.1:{ports[0]}",), (silent, f"127.0.0.1:{ports[1]}")], strict=True))})

    async def scenario() -> tuple[NextHop | None, list[int]]:
        cores = [AgentCore(files[index], settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor())
                 for index in range(2)]
        servers = [await start_server(cores[index].serve_link, "127.0.0.1", ports[index], files[index])
                   for index in range(2)]
        found = await survey(store, SurveyOptions(discover_seconds=0))
        try:
            second = next(agent for agent in found.agents if agent.agent_id == ids[1])
            assert (second.address, second.other_addresses) == (f"127.0.0.1:{ports[1]}", (silent,))
            # as the controller reached it at an address the first PC cannot: the silent one, the other one kept
            found.agents[found.agents.index(second)] = replace(second, address=silent,
                                                               other_addresses=(f"127.0.0.1:{ports[1]}",))
            half = manifest.spec.num_layers // 2
            placements = (StagePlacement(ids[0], f"127.0.0.1:{ports[0]}", 0, half),
                          StagePlacement(ids[1], silent, half, manifest.spec.num_layers))
            await _deploy_all(tiny_export, manifest, model_id, placements,
                              DeploySettings(precision=Precision.F32, kv_cache="f32"), found, {}, {}, None)
            next_hop = next(iter(cores[0].stages.values())).assignment.next_hop
            # the driver reaches the second PC where the survey did; the first PC is left the silent address first
            return next_hop, await asyncio.to_thread(chain_tokens, store, tiny_export, (placements[0], replace(
                placements[1], address=f"127.0.0.1:{ports[1]}")))
        finally:
            await found.close()
            for core in cores:
                await core.close()
            for server in servers:
                server.close()
                await server.wait_closed()

    next_hop, tokens = asyncio.run(scenario())
    assert next_hop == NextHop(silent, ids[1], (f"127.0.0.1:{ports[1]}",))
    assert tokens == local_tokens(tiny_export)


V4, V6, DUAL = "4" * 52, "6" * 52, "d" * 52


def _pc(agent_id: str, speed: float, *addresses: str, dials_over: tuple[int, ...] | None = None) -> AgentView:
    """A PC that answered the survey at the first of `addresses`; it dials over `dials_over` (its LAN's families),
    by default those of its addresses."""
    families = dials_over if dials_over is not None else tuple(sorted(ip_families(addresses) or ()))
    report = StatusReport(AgentState.AVAILABLE, 8 << 30, 0.1, None, None, None, None, (), None, weight_gb_per_s=speed,
                          ip_families=families)
    return AgentView(agent_id, f"desk-{agent_id[0]}", addresses[0], ("registration",), report, None,
                     other_addresses=addresses[1:])


def _surveyed(agents: list[AgentView]) -> Survey:
    """A survey that found `agents` and holds a link to each (plan_survey plans over those alone)."""
    return Survey(agents, {agent.agent_id: cast(Link, None) for agent in agents if agent.agent_id is not None})


def test_pcs_whose_addresses_share_no_ip_family_are_said_not_to_reach_each_other() -> None:
    agents = [_pc(V4, 1, "10.62.0.10:7431"), _pc(V6, 1, "[fd62::20]:7431", "[fd62::21]:7431"),
              _pc(DUAL, 1, "[fd62::30]:7431", "10.62.0.30:7431")]
    assert links_of_no_shared_family(agents) == {(V4, V6), (V6, V4)}
    # one known at a host name or loopback may be dialled over either family; one that did not answer is no PC to plan
    named = [agents[0], _pc(V6, 1, "[fd62::20]:7431", "desk-6.office.example:7431")]
    assert links_of_no_shared_family(named) == frozenset()
    assert links_of_no_shared_family([agents[0], _pc(V6, 1, "[::1]:7431")]) == frozenset()
    silent = AgentView(V6, "desk-6", "[fd62::20]:7431", ("registration",), None, "cannot reach [fd62::20]:7431")
    assert links_of_no_shared_family([agents[0], silent]) == frozenset()
    # a PC of both families known at one IPv6 address (it listens there alone, or was given as --peer) dials an
    # IPv4-only PC, which cannot dial it back; a PC that reported no families (an older agent) constrains nothing
    one_address = _pc(DUAL, 1, "[fd62::30]:7431", dials_over=(4, 6))
    assert links_of_no_shared_family([agents[0], one_address]) == {(V4, DUAL)}
    assert links_of_no_shared_family([agents[0], _pc(V6, 1, "[fd62::20]:7431", dials_over=())]) == {(V4, V6)}
    # an IPv4-mapped IPv6 address is an IPv4 one
    assert links_of_no_shared_family([agents[0], _pc(V6, 1, "[::ffff:10.62.0.20]:7431")]) == frozenset()


def test_a_plan_puts_the_dual_stack_pc_between_an_ipv4_only_and_an_ipv6_only_one() -> None:
    model = ModelFootprint.uniform("m", 6, 1 << 20, 0, 0, kv_bytes_per_token_per_layer=0, context=64)
    options = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0)
    # by speed alone the IPv4-only PC would pass its output to the IPv6-only one
    by_speed = [_pc(V4, 10, "desk-4.office.example:7431"), _pc(V6, 9, "desk-6.office.example:7431"),
                _pc(DUAL, 8, "desk-d.office.example:7431")]
    assert [stage.agent_id for stage in plan_survey(model, _surveyed(by_speed), options).stages] == [V4, V6, DUAL]
    mixed = [_pc(V4, 10, "10.62.0.10:7431"), _pc(V6, 9, "[fd62::20]:7431"),
             _pc(DUAL, 8, "[fd62::30]:7431", "10.62.0.30:7431")]
    result = plan_survey(model, _surveyed(mixed), options)
    order = [stage.agent_id for stage in result.stages]
    assert sorted(order) == sorted([V4, V6, DUAL]) and order[1] == DUAL, order
    # a model that takes two PCs: an IPv4-only and an IPv6-only PC alone hold it in no chain, and the plan says why
    big = ModelFootprint.uniform("big", 6, 2 << 30, 0, 0, kv_bytes_per_token_per_layer=0, context=64)
    assert [stage.agent_id for stage in plan_survey(big, _surveyed(mixed), options).stages][1] == DUAL
    alone = plan_survey(big, _surveyed(mixed[:2]), options)
    assert not alone.feasible
    assert "(or give them addresses of one IP family)" in " ".join(alone.problems), alone.problems
    # one direction broken is a chain the other way round
    known_at_one = [_pc(V4, 10, "10.62.0.10:7431"), _pc(DUAL, 8, "[fd62::30]:7431", dials_over=(4, 6))]
    assert [stage.agent_id for stage in plan_survey(big, _surveyed(known_at_one), options).stages] == [DUAL, V4]
