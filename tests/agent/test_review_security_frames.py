"""Security review: how many bytes a client can make the controller's port (the one that takes enrollment) and an
agent's port hold. Loopback only."""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
import struct
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
from websockets.asyncio.server import Server, ServerConnection
from websockets.exceptions import ConnectionClosed

from deskfleet.agent.core import AgentCore, HostedStage
from deskfleet.agent.link import ENROLLMENT_MAX_FRAME_BYTES, SMALL_FRAME_BYTES, Link, open_link, start_server
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common import pki
from deskfleet.common.kv_ledger import AppendSlots
from deskfleet.common.wire import (
    AssignStage,
    Error,
    ErrorCode,
    Forward,
    Message,
    NextHop,
    Precision,
    Role,
    StageRef,
    StatusRequest,
    encode,
)
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_ca, make_member

MB = 1 << 20
CLAIMED_FRAME_BYTES = 64 * MB


async def _controller_port(tmp_path: Path) -> tuple[Server, int, pki.FleetCa]:
    """A port like `fleet serve`'s: enrollment for clients without a certificate, members that never read
    after Hello (the controller reads only Register)."""
    ca = make_ca(tmp_path / "ca")
    files = make_member(ca, tmp_path / "controller", "controller")

    async def member(link: Link) -> None:
        await link.connection.wait_closed()

    async def enrollment(connection: ServerConnection) -> None:
        try:
            await connection.recv()
        except ConnectionClosed:
            pass

    server = await start_server(member, "127.0.0.1", 0, files, enrollment=enrollment)
    return server, server.sockets[0].getsockname()[1], ca


def _upgrade_request() -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()


def _binary_frame_header(length: int) -> bytes:
    return bytes([0x82, 0x80 | 127]) + struct.pack(">Q", length) + b"\0\0\0\0"  # masked, with a zero mask


async def _bytes_accepted(writer: asyncio.StreamWriter, total: int) -> int:
    """Send `total` zero bytes in 1 MB writes; how many went out before the server dropped the connection."""
    chunk, sent = b"\0" * MB, 0
    try:
        while sent < total:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 5)
            sent += MB
    except (ConnectionError, TimeoutError):
        pass
    return sent


def test_a_client_without_a_certificate_cannot_pipeline_a_big_frame_behind_its_upgrade_request(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, _ = await _controller_port(tmp_path)
        async with server:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            # Sent in one write, the frame header is parsed before the server has looked at the client at all.
            writer.write(_upgrade_request() + _binary_frame_header(CLAIMED_FRAME_BYTES))
            sent = await _bytes_accepted(writer, CLAIMED_FRAME_BYTES)
            writer.close()
        assert sent < CLAIMED_FRAME_BYTES // 4, f"the server read {sent // MB} MB of a frame from a stranger"

    asyncio.run(scenario())


def test_a_member_cannot_make_the_controller_port_hold_frames_it_never_reads(tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, ca = await _controller_port(tmp_path)
        async with server:
            member = make_member(ca, tmp_path / "agent", "agent")
            link = await open_link(f"127.0.0.1:{port}", member)
            junk = encode(StatusRequest()) + b"\0" * (4 * ENROLLMENT_MAX_FRAME_BYTES)
            for _ in range(4):  # the controller reads nothing after Register: each frame used to wait in memory
                try:
                    await asyncio.wait_for(link.connection.send(junk), 5)
                except ConnectionClosed:
                    break
            await asyncio.wait_for(link.connection.wait_closed(), 5)
            assert link.connection.close_code == 1009  # message too big

    asyncio.run(scenario())



# The agent's port: a member's frames are small until its Hello checked out, and stay small but for the controller
# and a hosted stage's previous hop (an exploratory test held ~300 MB of an agent's memory per link with a message
# it never finished, on as many links as it opened).

PREVIOUS_HOP = "p" * 52


async def _agent_port(tmp_path: Path) -> tuple[Server, int, pki.FleetCa, AgentCore]:
    ca = make_ca(tmp_path / "ca")
    files = make_member(ca, tmp_path / "agent", "agent")
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    core = AgentCore(files, settings, ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor())
    server = await start_server(core.serve_link, "127.0.0.1", 0, files, revocations=core.revocations,
                                large_frames=core.takes_large_frames)
    return server, server.sockets[0].getsockname()[1], ca, core


async def _served(core: AgentCore, links: int) -> None:
    """Wait (1 s at most) until the agent serves `links` links: a link's Hello is answered before it is served."""
    for _ in range(50):
        if len(core._links) >= links:
            return
        await asyncio.sleep(0.02)


async def _sends_whole(link: Link, size: int) -> bool:
    """Whether a frame of `size` bytes (a StatusRequest padded with junk) got through: the agent answers it
    (a malformed message, so an Error) where it read it, and closes with 1009 where it was too big."""
    try:
        await link.connection.send(encode(StatusRequest()) + b"\0" * size)
        await asyncio.wait_for(link.connection.recv(), 5)
        return True
    except ConnectionClosed:
        assert link.connection.close_code == 1009  # message too big
        return False


def test_a_member_that_feeds_no_stage_here_sends_only_small_frames_and_the_controller_large_ones(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, ca, _ = await _agent_port(tmp_path)
        async with server:
            address = f"127.0.0.1:{port}"
            other = make_member(ca, tmp_path / "other", "other")
            assert await _sends_whole(await open_link(address, other), SMALL_FRAME_BYTES // 2)
            assert not await _sends_whole(await open_link(address, other), 4 * MB)
            controller = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
            assert await _sends_whole(await open_link(address, controller), 4 * MB)

    asyncio.run(scenario())


def test_the_previous_hops_link_opened_before_its_stage_was_assigned_takes_large_frames_after(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, ca, core = await _agent_port(tmp_path)
        async with server:
            previous = make_member(ca, tmp_path / "previous", "previous")
            early = await open_link(f"127.0.0.1:{port}", previous)
            await _served(core, 1)
            hop = previous.own_identity().agent_id
            # a re-plan makes that PC this one's previous hop: the stage's assignment widens its open link
            assignment = AssignStage(StageRef("m@1", 1, 2), False, True, "CPU", Precision.F32, None, (), None, hop)
            core.stages[assignment.stage] = HostedStage(assignment, cast(StageExecutor, None), asyncio.Lock(), "m-1-2")
            core._widen_links_of(hop)
            kept = await open_link(f"127.0.0.1:{port}", previous)  # a link that stays open; each send closes one
            await _served(core, 2)
            assert await _sends_whole(early, 4 * MB)
            assert await _sends_whole(await open_link(f"127.0.0.1:{port}", previous), 4 * MB)  # and a new one
            # the stage released (a re-plan, a redeploy): that PC sends nothing large here any more, and its open
            # link stayed able to make the agent hold a frame of up to 320 MB
            core._release(assignment.stage)
            assert not await _sends_whole(kept, 4 * MB)

    asyncio.run(scenario())


def test_a_re_plan_that_moves_only_the_hop_before_a_stage_narrows_the_old_hops_links(tmp_path: Path) -> None:
    # the stage stays (the same build, new neighbours): the PC that fed it no longer does, and kept large frames
    async def scenario() -> None:
        server, port, ca, core = await _agent_port(tmp_path)
        async with server:
            previous = make_member(ca, tmp_path / "previous", "previous")
            hop = previous.own_identity().agent_id
            assignment = AssignStage(StageRef("m@1", 1, 2), False, True, "CPU", Precision.F32, None, (), None, hop)
            core.stages[assignment.stage] = HostedStage(assignment, cast(StageExecutor, None), asyncio.Lock(), "m-1-2")
            kept = await open_link(f"127.0.0.1:{port}", previous)
            await _served(core, 1)
            await core._assign(replace(assignment, previous_agent_id="q" * 52))
            assert core.stages[assignment.stage].assignment.previous_agent_id == "q" * 52
            assert not await _sends_whole(kept, 4 * MB)

    asyncio.run(scenario())


def test_a_released_stages_previous_hop_keeps_large_frames_where_it_feeds_another_stage_here(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, ca, core = await _agent_port(tmp_path)
        async with server:
            previous = make_member(ca, tmp_path / "previous", "previous")
            hop = previous.own_identity().agent_id
            stages = [AssignStage(StageRef(model, 1, 2), False, True, "CPU", Precision.F32, None, (), None, hop)
                      for model in ("m@1", "n@1")]
            for assignment in stages:  # two models deployed over the same two PCs
                core.stages[assignment.stage] = HostedStage(assignment, cast(StageExecutor, None), asyncio.Lock(),
                                                            assignment.stage.model_id)
            link = await open_link(f"127.0.0.1:{port}", previous)
            await _served(core, 1)
            core._release(stages[0].stage)
            assert await _sends_whole(link, 4 * MB)

    asyncio.run(scenario())


def test_a_member_cannot_send_the_agent_a_big_frame_before_its_hello(tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, ca, _ = await _agent_port(tmp_path)
        async with server:
            member = make_member(ca, tmp_path / "member", "member")
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=member.client_context(pin_agent_id=False),
                                                      server_hostname="127.0.0.1")
            writer.write(_upgrade_request() + _binary_frame_header(CLAIMED_FRAME_BYTES))
            sent = await _bytes_accepted(writer, CLAIMED_FRAME_BYTES)
            writer.close()
        assert sent < CLAIMED_FRAME_BYTES // 4, f"the agent read {sent // MB} MB of a frame before a Hello"

    asyncio.run(scenario())


class _MicroBatches:
    """A stage executor that holds micro-batch 7, and nothing else (only its ids are asked)."""

    def micro_batch_ids(self) -> list[int]:
        return [7]


def test_a_step_too_large_for_a_next_hop_that_feeds_on_another_pc_is_a_refusal_blaming_no_one(
        tmp_path: Path) -> None:
    # the next hop reads large frames only from its stages' previous hops and closes a link with 1009 at one; the
    # sender read that as the hop lost ("unreachable", blamed), and the driver's re-plan left a healthy PC or link out
    async def scenario() -> list[Error]:
        ca = make_ca(tmp_path / "ca")
        sender_files, hop_files = make_member(ca, tmp_path / "a", "a"), make_member(ca, tmp_path / "b", "b")
        settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
        sender = AgentCore(sender_files, settings, ShardCache(tmp_path / "a-cache", 1 << 30), FakeMonitor())
        next_hop = AgentCore(hop_files, settings, ShardCache(tmp_path / "b-cache", 1 << 30), FakeMonitor())
        server = await start_server(next_hop.serve_link, "127.0.0.1", 0, hop_files, revocations=next_hop.revocations,
                                    large_frames=next_hop.takes_large_frames)
        told: list[Error] = []

        async def tell(message: Message) -> None:
            told.append(cast(Error, message))

        sender._tell_controller = tell  # type: ignore[method-assign]
        hop = NextHop(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", next_hop.agent_id)
        assignment = AssignStage(StageRef("m@1", 0, 1), True, False, "CPU", Precision.F32, hop, (), None, None)
        sender.stages[assignment.stage] = HostedStage(assignment, cast(StageExecutor, _MicroBatches()),
                                                      asyncio.Lock(), "m-0-1")
        step = Forward(7, 0, (0,), (AppendSlots(1, (1,), (0,)),), np.zeros(1, np.int64), np.zeros((1, 400), np.int64),
                       None, np.ones((1, 400, 64), np.float32), None, layer_start=1, model_id="m@1")  # 100 KB
        async with server:
            await sender._send_next(hop, step)
            for _ in range(100):
                if told:
                    break
                await asyncio.sleep(0.02)
            await sender.close()
        return told

    told = asyncio.run(scenario())
    assert [(error.code, error.micro_batch_id, error.agent_id) for error in told] == [(ErrorCode.NOT_ASSIGNED, 7, None)]
    assert "refused this stage's step as too large: it reads large steps only from the previous hop of a stage it " \
           "hosts" in told[0].message
