"""Two PCs of one agent identity (a disk image cloned after the join) took turns at the controller's one link per
agent, the roster's address flipping between them, and nothing said so: now `fleet serve` logs a warning naming
both addresses and what to do, once a window; a PC that restarts or moves to another network once says nothing."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from deskfleet.agent.link import open_link, utc_now
from deskfleet.common.wire import Register, RevocationUpdate
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.shared_identity import SharedIdentityWatch
from tests.controller.test_fleet_ca import with_server
from tests.fake_clock import FakeClock
from tests.fleet_pki import make_member

DESK_A, DESK_B = ("10.0.0.5:7341",), ("10.0.0.9:7341",)


def test_two_pcs_taking_turns_are_named_once_a_window() -> None:
    clock = FakeClock(1000.0)
    watch = SharedIdentityWatch(window_s=600.0, clock=clock)
    assert watch.takeover("a" * 64, DESK_A, DESK_B) is None  # one move: a laptop on another network
    clock.now += 5
    said = watch.takeover("a" * 64, DESK_B, DESK_A)  # and back, while B's link was live: two PCs
    assert said is not None and said.startswith(f"agent {'a' * 12} registered at 10.0.0.5:7341 while its link "
                                                "from 10.0.0.9:7341 was live, and the other way round: 2 takeovers")
    assert "Two PCs hold one agent identity" in said and "join it again with a new token" in said
    clock.now += 5
    assert watch.takeover("a" * 64, DESK_A, DESK_B) is None  # said once a window, not at every flip
    clock.now += 601
    assert watch.takeover("a" * 64, DESK_B, DESK_A) is None  # the window's old takeovers are forgotten ...
    clock.now += 5
    assert watch.takeover("a" * 64, DESK_A, DESK_B) is not None  # ... and a flip back within the new one is said


def test_a_pc_calling_in_again_or_moving_away_and_back_slowly_is_not_a_clash() -> None:
    clock = FakeClock(1000.0)
    watch = SharedIdentityWatch(window_s=600.0, clock=clock)
    for _ in range(5):  # its old link not yet found dead: the same addresses
        assert watch.takeover("b" * 64, DESK_A, DESK_A) is None
    assert watch.takeover("b" * 64, DESK_A, DESK_B) is None
    clock.now += 3600  # office to home and back, an hour apart
    assert watch.takeover("b" * 64, DESK_B, DESK_A) is None
    assert watch.takeover("c" * 64, DESK_B, DESK_A) is None  # another agent's takeovers are its own


def test_fleet_serve_warns_when_one_identity_registers_from_two_pcs_in_turn(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    files = make_member(load_ca(store), tmp_path / "agent", "agent")  # the one identity both "PCs" hold
    agent_id = files.own_identity().agent_id

    async def scenario(server: FleetServer, address: str) -> None:
        links = []
        for desk in (DESK_A, DESK_B, DESK_A):
            link = await open_link(address, files, expected_agent_id=None)
            await link.send(Register(agent_id, desk))
            assert isinstance(await asyncio.wait_for(link.receive(), 10), RevocationUpdate)
            links.append(link)
        assert server.live[agent_id] is not None
        for link in links:
            await link.close()

    with caplog.at_level(logging.WARNING, logger="deskfleet.controller.fleet_server"):
        with_server(store, scenario)
    warnings = [record.getMessage() for record in caplog.records if "Two PCs hold one agent identity" in
                record.getMessage()]
    assert len(warnings) == 1 and "registered at 10.0.0.5:7341 while its link from 10.0.0.9:7341" in warnings[0]
