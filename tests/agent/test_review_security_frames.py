"""Security review: how many bytes a client can make the controller's port (the one that takes enrollment)
hold. Loopback only."""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
import struct
from pathlib import Path

from websockets.asyncio.server import Server, ServerConnection
from websockets.exceptions import ConnectionClosed

from deskfleet.agent.link import ENROLLMENT_MAX_FRAME_BYTES, Link, open_link, start_server
from deskfleet.common import pki
from deskfleet.common.wire import StatusRequest, encode
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

