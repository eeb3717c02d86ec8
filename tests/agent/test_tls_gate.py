"""A fleet port's TLS done per connection (agent/tls_gate.py), on asyncio's loop and on uvloop (the agent's): a
refusal names its peer, one host's connections that are not open yet are capped, a silent one is dropped, and no
byte is lost or reordered on the way from TCP through TLS to websockets."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path

import pytest
from websockets.frames import Frame, Opcode

from deskfleet.agent import link as link_module
from deskfleet.agent import tls_gate
from deskfleet.agent.link import Link, TlsFiles, open_link, start_server
from deskfleet.common.log_limit import LogEvery
from deskfleet.common.wire import Error, ErrorCode, Role, StatusRequest
from tests.fake_clock import FakeClock
from tests.fleet_pki import make_ca, make_member
from tests.log_records import records_of

LOOPS: list[Callable[[], asyncio.AbstractEventLoop] | None] = [None]
try:
    import uvloop
    LOOPS.append(uvloop.new_event_loop)
except ImportError:  # Windows: the agent runs on asyncio's loop there
    pass


@pytest.fixture(params=LOOPS, ids=lambda factory: "asyncio" if factory is None else "uvloop")
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[object, object, None]], None]:
    def on_the_loop(coroutine: Coroutine[object, object, None]) -> None:
        with asyncio.Runner(loop_factory=request.param) as runner:
            runner.run(coroutine)
    return on_the_loop


class Members:
    def __init__(self, tmp_path: Path) -> None:
        ca = make_ca(tmp_path / "ca")
        self.agent = make_member(ca, tmp_path / "agent", "agent")
        self.controller = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
        self.handled: list[Link] = []

    async def serve(self) -> tuple[link_module.Server, int]:
        async def handler(link: Link) -> None:
            self.handled.append(link)
            message = await link.receive()
            await link.send(Error(ErrorCode.INTERNAL, f"echo {type(message).__name__}"))

        server = await start_server(handler, "127.0.0.1", 0, self.agent)
        return server, server.sockets[0].getsockname()[1]


async def _talk(files: TlsFiles, port: int) -> None:
    """A member's link opened, used and closed."""
    link = await open_link(f"127.0.0.1:{port}", files, open_timeout=5)
    await link.send(StatusRequest())
    reply = await link.receive()
    assert isinstance(reply, Error) and reply.message == "echo StatusRequest"
    await link.close()


async def _silent(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _closed_by_the_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within_s) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _gate_lines(records: list[logging.LogRecord]) -> list[tuple[int, str]]:
    return [(record.levelno, record.getMessage()) for record in records]


def test_a_refused_handshake_is_logged_naming_the_peer_and_why_once_a_minute_a_kind(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(1000.0)
    monkeypatch.setattr(tls_gate, "LogEvery", lambda: LogEvery(clock))
    members = Members(tmp_path)
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cafile=str(members.agent.ca_path))
    bare.check_hostname = False

    async def scenario() -> None:
        server, port = await members.serve()
        async with server:
            with records_of("deskfleet.agent.tls_gate", logging.DEBUG) as records:
                sources = []
                for _ in range(2):  # a TLS client without a certificate, twice
                    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=bare,
                                                                   server_hostname="x")
                    sources.append(writer.get_extra_info("sockname")[1])
                    assert await _closed_by_the_server(reader, 5)
                    writer.close()
                reader, writer = await _silent(port)  # plain HTTP
                sources.append(writer.get_extra_info("sockname")[1])
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert await _closed_by_the_server(reader, 5)
                await _talk(members.controller, port)  # a member: nothing said
                await asyncio.sleep(0.2)
            assert _gate_lines(records.records) == [
                (logging.WARNING, f"refused a connection from 127.0.0.1:{sources[0]}: a TLS client without a "
                                  "certificate (only this fleet's members connect)"),
                (logging.DEBUG, f"refused a connection from 127.0.0.1:{sources[1]}: a TLS client without a "
                                "certificate (only this fleet's members connect)"),
                (logging.WARNING, f"refused a connection from 127.0.0.1:{sources[2]}: plain HTTP, not TLS (only "
                                  "this fleet's members connect)")]
            clock.now += tls_gate.REFUSAL_LOG_EVERY_S + 1
            with records_of("deskfleet.agent.tls_gate", logging.DEBUG) as records:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=bare, server_hostname="x")
                assert await _closed_by_the_server(reader, 5)
                writer.close()
                await asyncio.sleep(0.1)
            assert [level for level, _ in _gate_lines(records.records)] == [logging.WARNING]  # a minute later

    run(scenario())


def test_one_host_holds_at_most_its_share_of_connections_not_open_yet(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls_gate, "MAX_OPENING_PER_HOST", 3)
    members = Members(tmp_path)

    async def scenario() -> None:
        server, port = await members.serve()
        async with server:
            silent = [await _silent(port) for _ in range(3)]
            await asyncio.sleep(0.2)  # accepted, each waiting in its handshake
            with records_of("deskfleet.agent.tls_gate") as records:
                reader, writer = await _silent(port)
                assert await _closed_by_the_server(reader, 5)  # dropped at once: 3 of its host are opening
                writer.close()
            [line] = records.messages()
            assert line.startswith("refused a connection from 127.0.0.1:") and \
                line.endswith(": 3 connections of 127.0.0.1 are opening already (said once a minute a host)")
            # another host is not held up by this one's
            link = await asyncio.wait_for(_open_from("127.0.0.2", members.controller, port), 5)
            await link.close()
            for _reader, writer in silent:  # their handshakes given up: their host's share is free again
                writer.close()
            await asyncio.sleep(0.3)
            # links that are open count no more: a fourth opens beside three open ones
            links = [await open_link(f"127.0.0.1:{port}", members.controller, open_timeout=5) for _ in range(4)]
            for link in links:
                await link.close()

    run(scenario())


def test_all_hosts_together_hold_at_most_max_opening_connections_not_open_yet(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a host can take any address of its IPv6 /64: each address within its share, they held TLS state without bound
    monkeypatch.setattr(tls_gate, "MAX_OPENING", 3)
    members = Members(tmp_path)

    async def scenario() -> None:
        server, port = await members.serve()
        async with server:
            silent = [await _silent(port, f"127.0.0.{10 + index}") for index in range(3)]
            await asyncio.sleep(0.2)
            with records_of("deskfleet.agent.tls_gate") as records:
                reader, writer = await _silent(port, "127.0.0.20")
                assert await _closed_by_the_server(reader, 5)
                writer.close()
            [line] = records.messages()
            assert line.startswith("refused a connection from 127.0.0.20:") and \
                line.endswith(": 3 connections are opening already, from 3 hosts (said once a minute)")
            for _reader, writer in silent:
                writer.close()
            await asyncio.sleep(0.3)
            await _talk(members.controller, port)

    run(scenario())


def test_a_host_is_its_address_and_a_joins_host_an_ipv6_ones_64() -> None:
    # on an IPv6 LAN the /64 is every PC of the segment: the opening connections count by address, so that one
    # stranger cannot block every member's links; a join (certificate-less, 4 at a time a host) counts by /64
    assert tls_gate.host_key(("2001:db8:10:20::7", 5, 0, 0)) == "2001:db8:10:20::7"
    assert tls_gate.host_key(("2001:db8:10:20::7", 5, 0, 0), ipv6_prefix=64) == "2001:db8:10:20::/64"
    assert tls_gate.host_key(("fe80::1%eth0", 5, 0, 2)) == "fe80::1"
    assert tls_gate.host_key(("::ffff:10.0.0.5", 5, 0, 0), ipv6_prefix=64) == "10.0.0.5"
    assert tls_gate.host_key(("10.0.0.5", 5)) == "10.0.0.5"
    assert tls_gate.host_key(None) == "?" and tls_gate.address_text(None) == "?"
    assert tls_gate.address_text(("2001:db8::7", 5, 0, 0)) == "[2001:db8::7]:5"


async def _open_from(source: str, files: TlsFiles, port: int) -> Link:
    """A member's link from another loopback address, as another host (open_link dials from the default one)."""
    from websockets.asyncio.client import connect

    connection = await connect(f"wss://127.0.0.1:{port}/", ssl=files.client_context(pin_agent_id=False),
                               server_hostname="agent", local_addr=(source, 0),
                               **link_module.websocket_options())
    peer = link_module.peer_identity(connection, files.ca_certificate(), link_module.no_revocations())
    link = Link(connection, peer, f"127.0.0.1:{port}")
    await link_module._exchange_hello(link, files.own_identity(), expect_first=False)
    return link


def test_a_connection_silent_in_its_handshake_is_dropped_and_frees_its_share(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls_gate, "MAX_OPENING_PER_HOST", 1)
    monkeypatch.setattr(link_module, "OPEN_TIMEOUT_S", 0.5)
    members = Members(tmp_path)

    async def scenario() -> None:
        server, port = await members.serve()
        async with server:
            with records_of("deskfleet.agent.tls_gate", logging.DEBUG) as records:
                reader, writer = await _silent(port)
                source = writer.get_extra_info("sockname")[1]
                assert not await _closed_by_the_server(reader, 0.2)
                assert await _closed_by_the_server(reader, 3)  # its handshake's time ran out
                writer.close()
            assert records.messages() == [
                f"dropped a connection from 127.0.0.1:{source}: no TLS handshake within 0.5 s"]
            await _talk(members.controller, port)  # the host's one share is free again

    run(scenario())


def test_connections_that_close_before_their_handshake_leave_no_tls_state_behind(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None]) -> None:
    # from a review: on uvloop the EOF of a connect-and-close (a port scan) came before TLS began, and start_tls on
    # the closing transport armed its handshake's timer, which kept ~90 KB of TLS state for 10 s, outside the cap
    members = Members(tmp_path)

    def scan(port: int) -> None:
        for _ in range(200):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

    def tls_states() -> int:
        gc.collect()
        return sum(1 for item in gc.get_objects() if isinstance(item, ssl.SSLObject))

    async def scenario() -> None:
        server, port = await members.serve()
        async with server:
            before = tls_states()
            await asyncio.to_thread(scan, port)
            await asyncio.sleep(0.5)
            assert tls_states() - before <= 2  # one or two still closing, not one in three of 200
            await _talk(members.controller, port)

    run(scenario())


def test_more_bytes_before_tls_than_a_client_hello_holds_drop_the_connection_cleanly(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the cap on what uvloop reads before TLS began aborted the connection, and the hand-over then met a transport
    # with no protocol: an AttributeError traceback in the loop's log
    cap = tls_gate.GatedServerConnection.MAX_RAW_BYTES
    monkeypatch.setattr(tls_gate.GatedServerConnection, "MAX_RAW_BYTES", 100)
    members = Members(tmp_path)
    failures: list[dict[str, object]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: failures.append(context))
        server, port = await members.serve()
        async with server:
            for _ in range(5):
                reader, writer = await _silent(port)
                writer.write(b"\x16\x03\x01" + b"x" * 8192)
                assert await _closed_by_the_server(reader, 5)
                writer.close()
            await asyncio.sleep(0.2)
            monkeypatch.setattr(tls_gate.GatedServerConnection, "MAX_RAW_BYTES", cap)  # a member's hello is 1-2 KB
            await _talk(members.controller, port)
        assert failures == []

    run(scenario())


def test_the_upgrade_request_sent_with_the_last_handshake_message_reaches_websockets(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None]) -> None:
    # TLS 1.3 lets a client send its request right behind its Finished: the TLS layer hands it on in the same call
    # as the handshake's end, before the code awaiting start_tls runs and gives the connection to websockets. A frame
    # pipelined behind the request reached websockets before its connection was made, and broke it.
    members = Members(tmp_path)

    async def scenario() -> None:
        server, port = await members.serve()
        async with server:
            response = await asyncio.to_thread(_upgrade_with_finished, members.controller, port)
            assert response.startswith(b"HTTP/1.1 101 "), response

    run(scenario())


def _upgrade_with_finished(files: TlsFiles, port: int) -> bytes:
    """A TLS client over a memory BIO that writes its Finished, its websocket upgrade request and a frame in one
    send, and returns the start of the server's answer."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls_client = files.client_context(pin_agent_id=False).wrap_bio(incoming, outgoing, server_hostname="agent")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        while True:
            try:
                tls_client.do_handshake()
                break
            except ssl.SSLWantReadError:
                if outgoing.pending:
                    sock.sendall(outgoing.read())
                data = sock.recv(65536)
                assert data, "the server closed during the handshake"
                incoming.write(data)
        tls_client.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n" +
                         Frame(Opcode.BINARY, b"not a Hello").serialize(mask=True, extensions=[]))
        sock.sendall(outgoing.read())  # the Finished, the request and the frame, together
        answer = b""
        while b"\r\n" not in answer:
            try:
                answer += tls_client.read(4096)
            except ssl.SSLWantReadError:
                data = sock.recv(65536)
                if not data:
                    break
                incoming.write(data)
        return answer


def test_a_handshake_that_ends_after_the_server_closed_gets_no_handler(
        tmp_path: Path, run: Callable[[Coroutine[object, object, None]], None]) -> None:
    members = Members(tmp_path)

    async def scenario() -> None:
        server, port = await members.serve()
        reader, writer = await _silent(port)  # accepted, its handshake not begun
        await asyncio.sleep(0.2)
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5)
        # its handshake completes, and the server hangs up at once: no websockets handler waits out its open timeout
        assert await asyncio.wait_for(_closed_after_handshake(reader, writer, members.controller), 3)
        assert members.handled == []

    run(scenario())


async def _closed_after_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                  files: TlsFiles) -> bool:
    """TLS over an open connection, then one read: whether the server closed it."""
    try:
        await writer.start_tls(files.client_context(pin_agent_id=False), server_hostname="agent")
        return await reader.read(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True
