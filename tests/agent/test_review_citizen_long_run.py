"""An agent over weeks: what it keeps must not outgrow what it hosts.

A stage that sent its hidden states to a next hop kept that link open after the stage was released or
re-planned onto another next hop: one open TLS socket (and its pings every 5 s, on both PCs) for every agent
this PC ever fed, for as long as both run.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from deskfleet.agent import core as core_module
from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import Link
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import AssignStage, Message, NextHop, ReleaseStage, Role, StageReady
from deskfleet.controller.batch_track import BatchTrack
from tests.agent.test_core import FakeLink, FakeMonitor, _host_tiny_stage, handle
from tests.fleet_pki import make_ca, make_member

NEXT = "c" * 52
OTHER = "d" * 52


class HopLink(FakeLink):
    """A next-hop link that takes what is sent and records whether it was closed."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(Role.AGENT)
        self.agent_id = agent_id
        self.sent: list[Message] = []
        self.closed = False

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def core(tmp_path: Path) -> AgentCore:
    files = make_member(make_ca(tmp_path / "ca"), tmp_path / "agent", "agent")
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    return AgentCore(files, settings, ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor())


@pytest.fixture
def dialled(monkeypatch: pytest.MonkeyPatch) -> list[HopLink]:
    links: list[HopLink] = []

    async def open_link(address: str, files: object, expected_agent_id: str, **kwargs: object) -> HopLink:
        links.append(HopLink(expected_agent_id))
        return links[-1]

    monkeypatch.setattr(core_module, "open_link", open_link)
    return links


def _step(core: AgentCore, tiny_export: Path, model_id: str) -> None:
    track = BatchTrack(1, load_manifest(tiny_export).spec.max_context)
    track.add_row(0)
    handle(core, Role.CONTROLLER, replace(track.step([[1, 5, 9]]), model_id=model_id))


def test_a_released_stage_closes_its_link_to_the_next_hop(core: AgentCore, tiny_export: Path,
                                                          dialled: list[HopLink]) -> None:
    assignment = _host_tiny_stage(core, tiny_export, layers=2, next_hop=NextHop("127.0.0.1:9", NEXT))
    _step(core, tiny_export, assignment.stage.model_id)
    assert [link.agent_id for link in dialled] == [NEXT] and len(dialled[0].sent) == 1
    handle(core, Role.CONTROLLER, ReleaseStage(assignment.stage))
    assert dialled[0].closed, "the link to the released stage's next hop is still open"


def test_a_stage_re_planned_onto_another_next_hop_closes_the_old_link(core: AgentCore,
                                                                      tiny_export: Path,
                                                                      dialled: list[HopLink]) -> None:
    assignment = _host_tiny_stage(core, tiny_export, layers=2, next_hop=NextHop("127.0.0.1:9", NEXT))
    _step(core, tiny_export, assignment.stage.model_id)
    moved: AssignStage = replace(assignment, next_hop=NextHop("127.0.0.1:10", OTHER))
    assert isinstance(handle(core, Role.CONTROLLER, moved), StageReady)
    assert dialled[0].closed, "the link to the old next hop is still open"


def test_a_stage_given_up_closes_its_link_and_a_kept_one_stays_open(core: AgentCore, tiny_export: Path,
                                                                    dialled: list[HopLink]) -> None:
    assignment = _host_tiny_stage(core, tiny_export, layers=2, next_hop=NextHop("127.0.0.1:9", NEXT))
    _step(core, tiny_export, assignment.stage.model_id)
    _step(core, tiny_export, assignment.stage.model_id)  # the open link is used again, not dialled again
    assert len(dialled) == 1 and not dialled[0].closed
    asyncio.run(core.give_up_stages("battery 41%, unplugged for 30 s"))
    assert dialled[0].closed
    assert cast(Link, dialled[0]) not in core._next_hops.values()
