"""The driver accepts an Error's blame only where it fits the chain position of the stage it arrived from, and
the chains fleet deploy makes (1 to 4 PCs, each stage fed only by the agent before it) still give the local
tokens, also while another enrolled PC sends a stage steps and errors as if it were the previous one.

Before, an Error's agent_id reached the failover as sent: any stage (or, relayed by the agents, any enrolled PC
at all) could have a healthy PC left out of the next plan.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import Link, LinkError, open_link, start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.kv_ledger import AppendSlots
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Error, ErrorCode, Forward, Precision, Role
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_deploy import DeploySettings, StagePlacement, _deploy_all, model_id_of
from deskfleet.controller.fleet_pipeline import ChainError, FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import SurveyOptions, survey
from tests.agent.test_core import FakeMonitor
from tests.controller.test_fleet_deploy import chain_tokens, local_tokens
from tests.controller.test_fleet_pipeline import one_step
from tests.fleet_pki import make_ca, make_member
from tests.ports import free_port

BYSTANDER = "x" * 52  # an enrolled PC in no stage of the chain

# what stage 0's agent does when the driver's step reaches it: (the chain's agent ids, links to the driver)
OnStep = Callable[[list[str], list[Link]], Awaitable[None]]


@pytest.fixture
def scripted_chain(tmp_path: Path) -> Iterator[Callable[[int, OnStep], FleetPipeline]]:
    """A chain of `stages` scripted agents on one event loop thread; the first runs `on_step` at each Forward."""
    ca = make_ca(tmp_path / "ca")
    driver_files = make_member(ca, tmp_path / "driver", "driver", Role.CONTROLLER)
    chains: list[FleetPipeline] = []
    stop = threading.Event()

    def open_chain(stages: int, on_step: OnStep) -> FleetPipeline:
        files = [make_member(ca, tmp_path / f"agent{index}", "agent") for index in range(stages)]
        agent_ids = [member.own_identity().agent_id for member in files]
        driver_links: list[Link] = [None] * stages  # type: ignore[list-item]
        started = threading.Event()
        ports: list[int] = []

        def handler(index: int) -> Callable[[Link], Awaitable[None]]:
            async def serve(link: Link) -> None:
                driver_links[index] = link
                try:
                    while True:
                        if isinstance(await link.receive(), Forward):
                            await on_step(agent_ids, driver_links)
                except LinkError:
                    return
            return serve

        async def serve_all() -> None:
            servers = [await start_server(handler(index), "127.0.0.1", 0, files[index]) for index in range(stages)]
            ports.extend(server.sockets[0].getsockname()[1] for server in servers)
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            for server in servers:
                server.close()

        threading.Thread(target=asyncio.run, args=(serve_all(),), daemon=True).start()
        assert started.wait(10)
        placements = [StagePlacement(agent_ids[index], f"127.0.0.1:{ports[index]}", index, index + 1)
                      for index in range(stages)]
        chain = FleetPipeline(placements, driver_files, step_timeout_s=5)
        chains.append(chain)
        return chain

    yield open_chain
    for chain in chains:
        chain.close()
    stop.set()


# (stage reporting, stage blamed or BYSTANDER, whether the blame stands) in a chain of 3
@pytest.mark.parametrize(("reporter", "blamed", "stands"), [
    (0, 0, True),  # it gave its stages up
    (0, 1, True),  # its next hop is unreachable
    (1, 2, True),
    (2, 0, True),  # relayed from an earlier stage: nothing here can disprove it
    (2, 2, True),
    (0, 2, False),  # past its next hop: stage 0 knows nothing of stage 2
    (2, BYSTANDER, False),  # in no stage of this chain
    (0, BYSTANDER, False),
])
def test_a_blame_stands_only_where_the_reporting_stage_can_know_it(
        scripted_chain: Callable[[int, OnStep], FleetPipeline], reporter: int, blamed: int | str,
        stands: bool) -> None:
    async def on_step(agent_ids: list[str], driver_links: list[Link]) -> None:
        named = agent_ids[blamed] if isinstance(blamed, int) else blamed
        await driver_links[reporter].send(Error(ErrorCode.INTERNAL, "a stage failed", agent_id=named))

    chain = scripted_chain(3, on_step)
    chain.submit(one_step(micro_batch_id=3))
    with pytest.raises(ChainError, match="a stage failed") as caught:
        chain.collect()
    named = chain.stages[blamed].agent_id if isinstance(blamed, int) else blamed
    if stands:
        assert caught.value.agent_id == named and "ignored" not in str(caught.value)
    else:
        assert caught.value.agent_id is None  # the failover leaves no one out for it
        assert f"its blame of agent {named[:12]} was ignored" in str(caught.value)
        assert f"agent {chain.stages[reporter].agent_id[:12]} (stage {reporter}) cannot know" in str(caught.value)


@pytest.mark.slow
def test_chains_of_1_to_4_pcs_give_the_local_tokens_while_a_stranger_poses_as_a_previous_hop(
        tmp_path: Path, tiny_export: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    manifest = load_manifest(tiny_export)
    model_id = model_id_of(tiny_export)
    stranger_files = make_member(ca, tmp_path / "stranger", "agent")  # enrolled, in no chain
    stranger = stranger_files.own_identity().agent_id
    ports = [free_port() for _ in range(4)]

    async def pose_as_previous_hop(placements: tuple[StagePlacement, ...]) -> list[str]:
        """The stranger sends stage 1 a step, then an Error blaming stage 0, each on a link of its own; what it
        is answered on each."""
        target = placements[1]
        step = Forward(5, 0, (0,), (AppendSlots(1, (1,), (0,)),), np.zeros(1, np.int64), np.zeros((1, 1), np.int64),
                       None, np.ones((1, 1, manifest.spec.hidden_size), np.float32), None,
                       layer_start=target.layer_start, model_id=model_id)
        answers = []
        for message in (step, Error(ErrorCode.INTERNAL, "stage 0 is gone", agent_id=placements[0].agent_id)):
            link = await open_link(target.address, stranger_files, target.agent_id)
            await link.send(message)
            try:
                answer = await asyncio.wait_for(link.receive(), 10)
            except TimeoutError:
                answers.append("no answer")  # taken as the previous hop's (the gap this fixes)
                continue
            finally:
                await link.close()
            assert isinstance(answer, Error)
            answers.append(f"{answer.code.value}: {answer.message}")
        return answers

    async def scenario() -> dict[int, list[int]]:
        cores = []
        servers = []
        for index, port in enumerate(ports):
            files = make_member(ca, tmp_path / f"agent{index}", "agent")
            cores.append(AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor()))
            servers.append(await start_server(cores[-1].serve_link, "127.0.0.1", port, files))
        found = await survey(store, SurveyOptions(peers=tuple(f"127.0.0.1:{port}" for port in ports),
                                                  discover_seconds=0))
        ids = [core.agent_id for core in cores]
        tokens = {}
        try:
            for count in range(1, 5):  # the 4 layers over 1, 2, 3 and 4 PCs
                bounds = [round(index * manifest.spec.num_layers / count) for index in range(count + 1)]
                placements = tuple(StagePlacement(ids[index], f"127.0.0.1:{ports[index]}", bounds[index],
                                                  bounds[index + 1]) for index in range(count))
                await _deploy_all(tiny_export, manifest, model_id, placements,
                                  DeploySettings(precision=Precision.F32, kv_cache="f32"), found, {}, {}, None)
                for index, placement in enumerate(placements):
                    hosted = next(iter(cores[index].stages.values())).assignment
                    assert hosted.previous_agent_id == (placements[index - 1].agent_id if index else None)
                    assert (hosted.stage.layer_start, hosted.stage.layer_end) == (placement.layer_start,
                                                                                  placement.layer_end)
                if count >= 2:
                    answers = await pose_as_previous_hop(placements)
                    for answer in answers:
                        assert answer.startswith("unauthorized: "), answers
                        assert f"agent {stranger[:12]}" in answer and f"from agent {ids[0][:12]}" in answer
                tokens[count] = await asyncio.to_thread(chain_tokens, store, tiny_export, placements)
        finally:
            await found.close()
            for server in servers:
                server.close()
                await server.wait_closed()
        return tokens

    tokens = asyncio.run(scenario())
    local = local_tokens(tiny_export)
    assert tokens == {count: local for count in range(1, 5)}
