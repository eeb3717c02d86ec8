"""A fleet being upgraded PC by PC: links between deskfleet versions that speak other protocol versions.

The peer of another version is played by raw websocket frames whose prefix says its version (the codec's own
`encode` with the version bytes replaced, as an older or newer deskfleet's `encode` writes them). The codec
refuses every frame of another version, so the Hello's version check was never reached: both ends called the
other's Hello "a malformed message: frame protocol version 4 is not supported (this side speaks 5)", said
nothing of which side to upgrade, and the refusal went out as an Error frame the peer's codec refuses too."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import struct
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from deskfleet.agent import link as link_module
from deskfleet.agent.link import Link, LinkError, LinkVersionError, TlsFiles, open_link, start_server
from deskfleet.common.wire import PROTOCOL_VERSION, Error, ErrorCode, Hello, Message, Role, encode, peek_version
from tests.fleet_pki import make_ca, make_member

LOOPBACK = "127.0.0.1"


def as_version(message: Message, version: int) -> bytes:
    """`message` as a deskfleet speaking protocol `version` frames it."""
    frame = encode(message)
    return frame[:4] + struct.pack("<H", version) + frame[6:]


def hello(files: TlsFiles, version: int, software: str) -> bytes:
    own = files.own_identity()
    return as_version(Hello(version, own.agent_id, software, own.role), version)


def test_an_older_controller_is_told_to_upgrade_by_name_and_the_agent_logs_which_side(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    controller_files = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
    handled: list[Link] = []

    async def handler(link: Link) -> None:
        handled.append(link)

    async def scenario() -> str:
        server = await start_server(handler, LOOPBACK, 0, agent_files)
        async with server:
            port = server.sockets[0].getsockname()[1]
            async with connect(f"wss://{LOOPBACK}:{port}/", ssl=controller_files.client_context(pin_agent_id=False),
                               server_hostname=LOOPBACK) as old:
                await old.send(hello(controller_files, PROTOCOL_VERSION - 1, "0.0.9"))
                # our Hello first: an old controller's codec refuses it, but it peeks our protocol and software
                assert peek_version(await old.recv()) == (PROTOCOL_VERSION, link_module.SOFTWARE_VERSION)
                with pytest.raises(ConnectionClosed) as closed:
                    await old.recv()
                assert closed.value.rcvd is not None
                return closed.value.rcvd.reason

    with caplog.at_level(logging.WARNING, logger="deskfleet.agent.link"):
        reason = asyncio.run(scenario())
    assert handled == []
    # the old side reads the close reason whatever its version: who speaks what, and that it is to upgrade
    assert f"protocol {PROTOCOL_VERSION}" in reason and f"you {PROTOCOL_VERSION - 1}" in reason
    assert "upgrade deskfleet on your PC" in reason
    logged = " ".join(record.getMessage() for record in caplog.records)
    controller_id = controller_files.own_identity().agent_id[:12]
    assert f"speaks fleet protocol {PROTOCOL_VERSION - 1} (deskfleet 0.0.9)" in logged
    assert f"upgrade deskfleet on controller {controller_id}" in logged
    assert "malformed" not in logged


async def _old_or_new_agent(files: TlsFiles, answer: bytes, heard: list[str]) -> tuple[Server, int]:
    """A websocket server with the agent's credentials that answers the first frame with `answer` and records the
    close reason it gets."""
    async def handler(connection: ServerConnection) -> None:
        await connection.recv()
        await connection.send(answer)
        try:
            await connection.recv()
        except ConnectionClosed as closed:
            heard.append(closed.rcvd.reason if closed.rcvd is not None else "")

    server = await serve(handler, LOOPBACK, 0, ssl=files.server_context())
    return server, server.sockets[0].getsockname()[1]


def test_a_newer_agent_makes_the_controller_say_to_upgrade_itself(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    controller_files = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
    heard: list[str] = []

    async def scenario() -> LinkVersionError:
        server, port = await _old_or_new_agent(agent_files, hello(agent_files, PROTOCOL_VERSION + 1, "0.2.0"), heard)
        async with server:
            with pytest.raises(LinkVersionError) as refused:
                await open_link(f"{LOOPBACK}:{port}", controller_files,
                                expected_agent_id=agent_files.own_identity().agent_id)
        return refused.value

    error = asyncio.run(scenario())
    agent_id = agent_files.own_identity().agent_id[:12]
    assert error.peer_protocol == PROTOCOL_VERSION + 1 and error.peer_software == "0.2.0"
    assert f"agent {agent_id} at {LOOPBACK}" in str(error)
    assert f"speaks fleet protocol {PROTOCOL_VERSION + 1} (deskfleet 0.2.0)" in str(error)
    assert "upgrade deskfleet on this controller" in str(error)
    assert heard and f"you {PROTOCOL_VERSION + 1}" in heard[0] and "upgrade deskfleet on the controller" in heard[0]


def test_an_older_agent_s_refusal_of_our_hello_names_its_version_and_whom_to_upgrade(tmp_path: Path) -> None:
    # What a released agent of the previous protocol answers to our Hello: an Error in its own frame version.
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    controller_files = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
    text = f"frame protocol version {PROTOCOL_VERSION} is not supported (this side speaks {PROTOCOL_VERSION - 1})"
    refusal = as_version(Error(ErrorCode.BAD_MESSAGE, text), PROTOCOL_VERSION - 1)

    async def scenario() -> LinkVersionError:
        server, port = await _old_or_new_agent(agent_files, refusal, [])
        async with server:
            with pytest.raises(LinkVersionError) as refused:
                await open_link(f"{LOOPBACK}:{port}", controller_files)
        return refused.value

    error = asyncio.run(scenario())
    assert error.peer_protocol == PROTOCOL_VERSION - 1 and error.peer_software is None
    assert f"upgrade deskfleet on agent {agent_files.own_identity().agent_id[:12]}" in str(error)


def test_a_link_of_one_version_keeps_the_peer_s_deskfleet_version(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    controller_files = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
    handled: list[Link] = []

    async def scenario() -> Link:
        finished = asyncio.Event()

        async def handler(link: Link) -> None:
            handled.append(link)
            await finished.wait()

        server = await start_server(handler, LOOPBACK, 0, agent_files)
        async with server:
            link = await open_link(f"{LOOPBACK}:{server.sockets[0].getsockname()[1]}", controller_files)
            await link.close()
            finished.set()
        return link

    link = asyncio.run(scenario())
    installed = importlib.metadata.version("deskfleet")
    assert link_module.SOFTWARE_VERSION == installed  # the version mDNS advertises, not a second constant
    assert link.peer_software == installed and handled[0].peer_software == installed


def test_a_frame_that_is_not_deskfleet_s_is_still_malformed(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    controller_files = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)

    async def scenario() -> LinkError:
        server, port = await _old_or_new_agent(agent_files, b"HTTP/1.1 nonsense", [])
        async with server:
            with pytest.raises(LinkError) as refused:
                await open_link(f"{LOOPBACK}:{port}", controller_files)
        return refused.value

    error = asyncio.run(scenario())
    assert not isinstance(error, LinkVersionError) and "malformed" in str(error)


@pytest.mark.parametrize(("theirs", "software", "upgrade"), [
    (PROTOCOL_VERSION - 1, "0.1.0", "upgrade deskfleet on agent"),
    (PROTOCOL_VERSION + 1, "0.9.2", "upgrade deskfleet on this controller to the agent"),
])
def test_an_agent_that_closes_at_our_hello_is_known_by_the_protocol_its_close_reason_names(
        tmp_path: Path, theirs: int, software: str, upgrade: str) -> None:
    # A released agent of another protocol answers our Hello with a close alone, its reason in words: `fleet ls`
    # listed it "unreachable", with no version, and deploy and generate said to start `deskfleet-agent` on it
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    controller_files = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
    agent_id = agent_files.own_identity().agent_id[:12]
    reason = (f"agent speaks protocol {theirs} (deskfleet {software}), you {PROTOCOL_VERSION}: upgrade deskfleet on "
              f"{'the agent ' + agent_id if theirs < PROTOCOL_VERSION else 'your PC'}")

    async def handler(connection: ServerConnection) -> None:
        await connection.recv()
        await connection.close(1008, reason)

    async def scenario() -> LinkVersionError:
        server = await serve(handler, LOOPBACK, 0, ssl=agent_files.server_context())
        async with server:
            with pytest.raises(LinkVersionError) as refused:
                await open_link(f"{LOOPBACK}:{server.sockets[0].getsockname()[1]}", controller_files)
        return refused.value

    error = asyncio.run(scenario())
    assert (error.peer_protocol, error.peer_software) == (theirs, software)
    assert f"speaks fleet protocol {theirs} (deskfleet {software})" in str(error) and upgrade in str(error)


def test_a_member_of_another_protocol_retrying_is_warned_of_once_a_while_not_at_every_retry(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # `fleet serve` wrote a warning per PC not upgraded yet per retry (every 30 s each: 600 lines a minute for 300)
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    controller_files = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)

    async def handler(link: Link) -> None:
        pass

    async def retries() -> None:
        server = await start_server(handler, LOOPBACK, 0, controller_files)
        async with server:
            port = server.sockets[0].getsockname()[1]
            for attempt in range(4):
                if attempt == 3:  # ten minutes on
                    for _ in range(100):  # the server logs after the close the client saw
                        if len(dropped()) == 3:
                            break
                        await asyncio.sleep(0.02)
                    assert [record.levelno for record in dropped()] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
                    monkeypatch.setattr(link_module, "HELLO_FAILURE_LOG_EVERY_S", 0.0)
                async with connect(f"wss://{LOOPBACK}:{port}/", ssl=agent_files.client_context(pin_agent_id=False),
                                   server_hostname=LOOPBACK) as old:
                    await old.send(hello(agent_files, PROTOCOL_VERSION - 1, "0.1.0"))
                    with pytest.raises(ConnectionClosed):
                        while True:
                            await old.recv()

    def dropped() -> list[logging.LogRecord]:
        return [record for record in caplog.records if "before hello" in record.getMessage()]

    with caplog.at_level(logging.DEBUG, logger="deskfleet.agent.link"):
        asyncio.run(retries())  # the server closes (async with) only once its handlers are done: all four logged
    assert [record.levelno for record in dropped()] == [logging.WARNING] + [logging.DEBUG] * 2 + [logging.WARNING]
    assert dropped()[0].getMessage().endswith("(said again every 10 minutes at most)")
