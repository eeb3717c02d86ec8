"""Joining a PC whose deskfleet is of another protocol version than the controller's (a rollout in progress, an
installer older than the controller): the agent said only "the controller sent a malformed message: frame
protocol version 6 is not supported (this side speaks 5)". It now says which side to upgrade, and that the token
(not spent: the agent never sent its secret) still serves."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import struct
from pathlib import Path

import pytest
from websockets.asyncio.server import ServerConnection, serve

from deskfleet.agent.enroll import EnrollmentError, join
from deskfleet.agent.link import SOFTWARE_VERSION, utc_now
from deskfleet.common import join_tokens, pki
from deskfleet.common.wire import PROTOCOL_VERSION, JoinOffer, Role, encode
from tests.fleet_pki import make_ca, make_member

LOOPBACK = "127.0.0.1"


@pytest.mark.parametrize("offset, upgrade", [(1, "this PC"), (-1, "the controller")])
def test_a_controller_of_another_version_is_named_with_the_side_to_upgrade(tmp_path: Path, offset: int,
                                                                            upgrade: str) -> None:
    ca = make_ca(tmp_path / "ca")
    controller = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
    version = PROTOCOL_VERSION + offset
    frame = encode(JoinOffer(pki.certificate_pem(ca.certificate).decode("ascii"), pki.fleet_id(ca.certificate)))
    offer = frame[:4] + struct.pack("<H", version) + frame[6:]

    heard: list[str | None] = []

    async def controller_of_another_version(connection: ServerConnection) -> None:
        await connection.send(offer)
        await connection.wait_closed()
        heard.append(connection.close_reason)

    context = controller.server_context()
    context.verify_mode = ssl.CERT_OPTIONAL  # as the controller's port: a joining PC has no certificate yet

    async def scenario() -> EnrollmentError:
        async with serve(controller_of_another_version, LOOPBACK, 0, ssl=context) as server:
            port = server.sockets[0].getsockname()[1]
            token = join_tokens.JoinToken((f"{LOOPBACK}:{port}",), "0" * 64,
                                          join_tokens.new_secret(),
                                          (utc_now() + datetime.timedelta(hours=1)).replace(microsecond=0))
            with pytest.raises(EnrollmentError) as refused:
                await join(join_tokens.encode_join_token(token), tmp_path / "state")
        return refused.value

    error = str(asyncio.run(scenario()))
    assert "malformed" not in error
    assert f"the controller speaks fleet protocol {version} and this agent {PROTOCOL_VERSION}" in error
    assert f"upgrade deskfleet on {upgrade}" in error and "join again with the same token" in error
    # and the controller is told why the join ended, for its log: it said only "join client ... went away"
    assert heard == [f"agent speaks protocol {PROTOCOL_VERSION} (deskfleet {SOFTWARE_VERSION[:16]}), you {version}: "
                     f"upgrade deskfleet on {'your PC' if offset < 0 else 'the joining agent'}"]
