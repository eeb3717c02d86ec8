"""`fleet serve` releases, at a PC's registration, the stages it holds that no deployment places on it.

A run that lost a PC (asleep, off its network) re-planned without it and could not tell it; the PC woke holding the
stage's memory and cache pins, driven by nothing, until the next deploy of that model or the agent's restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from deskfleet.agent.core import HostedStage
from deskfleet.agent.enroll import join
from deskfleet.agent.link import Link, LinkError
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentService
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.agent_state import AgentState
from deskfleet.common.wire import AssignStage, Message, Precision, StageRef, StatusReport
from deskfleet.controller import fleet_server, fleet_store
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import token_for
from tests.controller.test_fleet_restored_removals import registering, serving, stopped, wait_until
from tests.log_records import records_of
from tests.ports import free_address

DEPLOYED, LEFT_BEHIND, OF_NO_DEPLOYMENT = StageRef("m@1", 0, 2), StageRef("m@1", 2, 4), StageRef("gone@3", 0, 4)


def _deploy_on_record(store: FleetStore, agent_id: str) -> None:
    """deployments.json as a run's re-plan left it: m@1 on this PC's layers 0-2 and another PC's 2-4."""
    stages = [{"agent_id": agent_id, "address": "127.0.0.1:7431", "layer_start": 0, "layer_end": 2},
              {"agent_id": "b" * 52, "address": "127.0.0.1:7432", "layer_start": 2, "layer_end": 4}]
    (store.data_dir / "deployments.json").write_text(json.dumps({"format": 1, "body": {"m@1": {"stages": stages}}}))


def _hold(agent: AgentService, ref: StageRef) -> None:
    """A stage the agent hosts (entered by hand: never run, its memory nothing to free)."""
    first = ref.layer_start == 0
    assignment = AssignStage(ref, first, False, "CPU", Precision.F32, None, (), None, None if first else "c" * 52)
    agent.core.stages[ref] = HostedStage(assignment, cast(StageExecutor, None), asyncio.Lock(),
                                         f"{ref.model_id}-{ref.layer_start}")


def registering_with(agent_dir: Path, stages: list[StageRef]) -> AbstractAsyncContextManager[AgentService]:
    """The agent of `agent_dir`, holding `stages`, registering with its controller while the block runs."""
    def hold_them(agent: AgentService) -> None:
        for ref in stages:
            _hold(agent, ref)

    return registering(agent_dir, hold_them)


@pytest.mark.usefixtures("no_controller_search")
def test_a_pc_back_holding_stages_no_deployment_places_is_told_to_release_them(
        store: FleetStore, tmp_path: Path) -> None:
    address = free_address()

    async def scenario() -> set[StageRef]:
        server, running = await serving(store, address)
        membership = await join(token_for(store, address), AgentPaths.resolve(tmp_path / "pc").state_dir, "pc")
        _deploy_on_record(store, membership.agent_id)
        async with registering_with(tmp_path / "pc", [DEPLOYED, LEFT_BEHIND, OF_NO_DEPLOYMENT]) as agent:
            await wait_until("the stages no deployment places released", lambda: len(agent.core.stages) == 1)
            await asyncio.sleep(0.3)  # nothing more goes
            kept = set(agent.core.stages)
        await stopped(server, running)
        return kept

    with records_of(fleet_server.log.name, logging.INFO) as said:
        assert asyncio.run(scenario()) == {DEPLOYED}
    released = sorted(message for message in said.messages() if "told to release" in message)
    assert len(released) == 2 and "told to release gone@3[0:4]: no deployment places it there" in released[0], released
    assert "told to release m@1[2:4]" in released[1], released


@pytest.mark.usefixtures("no_controller_search")
def test_stages_are_left_alone_while_a_deploy_is_under_way_and_looked_at_once_it_is_done(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a deploy or a run's re-plan may be assigning the very stage: what it saves decides
    monkeypatch.setattr(fleet_server, "DEPLOY_UNDER_WAY_RECHECK_S", 0.1)
    address = free_address()

    async def scenario() -> tuple[set[StageRef], set[StageRef]]:
        server, running = await serving(store, address)
        membership = await join(token_for(store, address), AgentPaths.resolve(tmp_path / "pc").state_dir, "pc")
        _deploy_on_record(store, membership.agent_id)
        async with registering_with(tmp_path / "pc", [DEPLOYED, LEFT_BEHIND, OF_NO_DEPLOYMENT]) as agent:
            with store.deploying(), records_of(fleet_server.log.name, logging.INFO) as said:  # as a deploy holds it
                await wait_until("fleet serve to wait for the deploy", lambda: any(
                    "looked at once the deploy under way" in message for message in said.messages()))
                await asyncio.sleep(0.3)  # a release would have been sent by now
                during = set(agent.core.stages)
                # the deploy placed LEFT_BEHIND on this PC, and saved that before it let go of the lock
                body = json.loads((store.data_dir / "deployments.json").read_text())
                body["body"]["m@1"]["stages"][1]["agent_id"] = membership.agent_id
                (store.data_dir / "deployments.json").write_text(json.dumps(body))
            await wait_until("the stage no deployment places released", lambda: len(agent.core.stages) == 2)
            after = set(agent.core.stages)
        await stopped(server, running)
        return during, after

    during, after = asyncio.run(scenario())
    assert during == {DEPLOYED, LEFT_BEHIND, OF_NO_DEPLOYMENT}
    assert after == {DEPLOYED, LEFT_BEHIND}


class _Replying:
    """A registration link that delivers `messages`, then closes."""

    def __init__(self, messages: list[Message]) -> None:
        self.peer = SimpleNamespace(agent_id="a" * 52)
        self._messages = list(messages)

    async def receive(self) -> Message:
        if not self._messages:
            raise LinkError("closed")
        return self._messages.pop(0)

    async def send(self, message: Message) -> None:
        pass


def test_a_status_report_no_one_asked_for_is_not_acted_on(store: FleetStore) -> None:
    # each would read deployments.json: a member spamming reports on its registration link would cost the server that
    server = FleetServer(store, free_address())
    report = StatusReport(AgentState.AVAILABLE, 1 << 30, 0.1, None, None, None, None, (LEFT_BEHIND,), None)

    async def tidied(ask: bool) -> bool:
        link = cast(Link, _Replying([report]))
        if ask:
            await server._ask_status(link)
        await server._read_registration(link)
        tidying = server._tidying.pop(link, None)
        if tidying is not None:
            await tidying
        return tidying is not None

    assert asyncio.run(tidied(ask=False)) is False
    assert asyncio.run(tidied(ask=True)) is True


@pytest.mark.usefixtures("no_controller_search")
@pytest.mark.parametrize("taken_back", [True, False])
def test_a_stage_the_next_run_is_to_take_the_pc_back_with_is_kept_a_while(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken_back: bool) -> None:
    # `serve --fleet` took the PC back 4 s after `fleet serve` had released its stage, and loaded and compiled the
    # same stage again (from an exploratory test of a mixed IPv4/IPv6 office)
    monkeypatch.setattr(fleet_server, "TAKE_BACK_GRACE_S", 1.0)
    address = free_address()

    async def scenario() -> tuple[set[StageRef], set[StageRef]]:
        server, running = await serving(store, address)
        membership = await join(token_for(store, address), AgentPaths.resolve(tmp_path / "pc").state_dir, "pc")
        other = "b" * 52
        # the admin's deploy placed both PCs; a run re-planned m@1 onto the other PC alone while this one slept
        record = {"replanned_at": "2026-12-07T05:00:00+00:00", "deployed_agents": [membership.agent_id, other],
                  "stages": [{"agent_id": other, "address": "127.0.0.1:7432", "layer_start": 0, "layer_end": 4}]}
        (store.data_dir / "deployments.json").write_text(json.dumps({"format": 1, "body": {"m@1": record}}))
        async with registering_with(tmp_path / "pc", [LEFT_BEHIND, OF_NO_DEPLOYMENT]) as agent:
            await wait_until("the stage of no deployment released", lambda: len(agent.core.stages) == 1)
            during = set(agent.core.stages)
            if taken_back:  # the next run takes the PC back with the stage it holds
                record["stages"] = [{**record["stages"][0], "layer_end": 2},
                                    {"agent_id": membership.agent_id, "address": "127.0.0.1:7431",
                                     "layer_start": 2, "layer_end": 4}]
                del record["replanned_at"]
                (store.data_dir / "deployments.json").write_text(json.dumps({"format": 1, "body": {"m@1": record}}))
            await asyncio.sleep(2.0)
            after = set(agent.core.stages)
        await stopped(server, running)
        return during, after

    during, after = asyncio.run(scenario())
    assert during == {LEFT_BEHIND}
    assert after == ({LEFT_BEHIND} if taken_back else set())


def test_a_deploy_waits_out_a_look_at_its_lock_and_looks_at_once_do_not_see_each_other(store: FleetStore) -> None:
    # fleet serve looks at the deploy lock as each PC registers: a deploy that started in that instant was refused
    # naming fleet serve's pid as another deploy's, and looks from its threads at once read as deploys (from a review:
    # 393 of 800 from 16 threads)
    looking = threading.Event()

    def look_for(seconds: float) -> None:
        with store._held(fleet_store.DEPLOY_LOCK, fleet_store.LOOK_HOLDER, lambda pid, holder: pid):
            looking.set()
            time.sleep(seconds)

    looker = threading.Thread(target=look_for, args=(0.3,))
    looker.start()
    assert looking.wait(5)
    with store.deploying():  # waited out the look: not refused
        assert store.deploy_under_way()  # while a deploy holds it, looks say so
    looker.join()
    assert not store.deploy_under_way()

    server = FleetServer(store, free_address())
    with ThreadPoolExecutor(16) as pool:
        found = list(pool.map(lambda _: server._undeployed_now("a" * 52, (LEFT_BEHIND,), True), range(400)))
    assert None not in found  # no deploy ran: none of the looks saw one
