"""Fleet links on loopback: Hello first, identities from certificates, refusals."""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
from collections.abc import Coroutine
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import Server
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close, CloseCode

from deskfleet.agent import link as link_module
from deskfleet.agent.link import Link, LinkError, LinkRefused, open_link, start_server, utc_now, why_closed
from deskfleet.common import event_loop, pki
from deskfleet.common.wire import PROTOCOL_VERSION, Error, ErrorCode, Hello, Role, StatusRequest, decode, encode
from tests.fleet_pki import make_ca, make_member
from tests.log_records import records_of


def run(coroutine: Coroutine[object, object, None]) -> None:
    asyncio.run(coroutine)


async def _serve(tmp_path: Path, revoked: frozenset[str] = frozenset()) -> tuple[Server, int, list[Link], pki.FleetCa]:
    ca = make_ca(tmp_path / "ca")
    server_files = make_member(ca, tmp_path / "server", "server")
    seen: list[Link] = []

    async def handler(link: Link) -> None:
        seen.append(link)
        message = await link.receive()
        await link.send(Error(ErrorCode.INTERNAL, f"echo {type(message).__name__}"))

    server = await start_server(handler, "127.0.0.1", 0, server_files,
                                revocations=lambda: pki.RevocationSet(revoked))
    return server, server.sockets[0].getsockname()[1], seen, ca


def test_hello_exchange_names_both_ends(tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, seen, ca = await _serve(tmp_path)
        async with server:
            client_files = make_member(ca, tmp_path / "client", "client", Role.CONTROLLER)
            link = await open_link(f"127.0.0.1:{port}", client_files)
            assert link.peer.role is Role.AGENT
            await link.send(StatusRequest())
            reply = await link.receive()
            assert isinstance(reply, Error) and reply.message == "echo StatusRequest"
            assert seen[0].peer.agent_id == client_files.own_identity().agent_id
            assert seen[0].peer.role is Role.CONTROLLER
            await link.close()

    run(scenario())


def test_a_pinned_agent_id_must_match_the_certificate(tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, _, ca = await _serve(tmp_path)
        async with server:
            client_files = make_member(ca, tmp_path / "client", "client")
            with pytest.raises(LinkError, match="cannot reach"):
                await open_link(f"127.0.0.1:{port}", client_files, expected_agent_id="a" * 52)

    run(scenario())


def test_a_revoked_client_gets_403_before_any_message(tmp_path: Path) -> None:
    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca")
        client_files = make_member(ca, tmp_path / "client", "client")
        revoked = frozenset({client_files.own_identity().agent_id})
        server_files = make_member(ca, tmp_path / "server", "server")
        seen: list[Link] = []

        async def handler(link: Link) -> None:
            seen.append(link)

        server = await start_server(handler, "127.0.0.1", 0, server_files,
                                    revocations=lambda: pki.RevocationSet(revoked))
        async with server:
            port = server.sockets[0].getsockname()[1]
            with pytest.raises(LinkError, match="403"):
                await open_link(f"127.0.0.1:{port}", client_files)
        assert seen == []

    run(scenario())


def test_a_foreign_certificate_fails_the_handshake(tmp_path: Path) -> None:
    async def scenario() -> None:
        server, port, seen, _ = await _serve(tmp_path)
        async with server:
            other_ca = make_ca(tmp_path / "other")
            stranger = make_member(other_ca, tmp_path / "stranger", "stranger")
            # as an agent of a fleet made anew (`fleet init --force`) saw it: a bare "certificate verify failed"
            with pytest.raises(LinkError, match=r"certificate verify failed.*: its certificate is not signed by this "
                                                r"PC's fleet CA: it belongs to another fleet, or the fleet was made "
                                                r"anew \(`deskfleet fleet init --force`\), after which every PC must "
                                                "join again"):
                await open_link(f"127.0.0.1:{port}", stranger)
        assert seen == []

    run(scenario())


def test_another_member_at_the_address_dialled_is_named_as_such_not_as_another_fleet(tmp_path: Path) -> None:
    # DHCP gave a PC's old address to another member: `fleet ls` said the PC belonged to another fleet
    async def scenario() -> None:
        server, port, _, ca = await _serve(tmp_path)
        async with server:
            client = make_member(ca, tmp_path / "client", "client", Role.CONTROLLER)
            elsewhere = make_member(ca, tmp_path / "elsewhere", "elsewhere").own_identity().agent_id
            with pytest.raises(LinkError, match="the PC listening there is another member of this fleet, not the "
                                                "one dialled") as refused:
                await open_link(f"127.0.0.1:{port}", client, expected_agent_id=elsewhere)
            assert "another fleet" not in str(refused.value)

    run(scenario())


def test_a_link_that_reads_replies_only_refuses_a_frame_past_its_limit(tmp_path: Path) -> None:
    # a member answered a survey's StatusRequest with 300 MB, and `fleet ls` held it (675 MB against 88)
    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca")
        server_files = make_member(ca, tmp_path / "server", "server")

        async def flood(link: Link) -> None:
            await link.receive()
            await link.connection.send(b"\0" * 3_000_000)
            await asyncio.sleep(5)

        server = await start_server(flood, "127.0.0.1", 0, server_files)
        async with server:
            port = server.sockets[0].getsockname()[1]
            client = make_member(ca, tmp_path / "client", "client", Role.CONTROLLER)
            link = await open_link(f"127.0.0.1:{port}", client, max_frame_bytes=1 << 20)
            await link.send(StatusRequest())
            with pytest.raises(LinkError):
                await link.receive()

    run(scenario())


def test_a_listener_that_drops_the_handshake_is_named_not_left_blank(tmp_path: Path) -> None:
    # another service on the port, reading and closing: `fleet ls` said "cannot reach 127.0.0.1:PORT: " and no more
    async def scenario() -> None:
        async def read_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.close()

        server = await asyncio.start_server(read_and_close, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        files = make_member(make_ca(tmp_path / "ca"), tmp_path / "controller", "controller")
        async with server:
            with pytest.raises(LinkError, match=rf"cannot reach 127\.0\.0\.1:{port}: \w+.* closed the connection "
                                                "while the link was opening"):
                await open_link(f"127.0.0.1:{port}", files)

    run(scenario())


def test_a_port_nothing_listens_at_is_told_from_a_pc_that_does_not_answer(tmp_path: Path) -> None:
    # both said only "cannot reach ADDRESS: [Errno 111] Connect call failed" / "timed out during opening handshake"
    async def scenario() -> None:
        files = make_member(make_ca(tmp_path / "ca"), tmp_path / "controller", "controller")
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            free_port = closed.getsockname()[1]
        with pytest.raises(LinkError, match=rf"cannot reach 127\.0\.0\.1:{free_port}: .*the PC is on but nothing "
                                            "listens at that port"):
            await open_link(f"127.0.0.1:{free_port}", files)

        async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # holds the connection until the client gives up

        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            with pytest.raises(LinkError, match=rf"cannot reach 127\.0\.0\.1:{port}: .*no answer \(the PC is off or "
                                                "asleep"):
                await open_link(f"127.0.0.1:{port}", files, open_timeout=0.3)

    run(scenario())


def test_a_peer_that_skips_hello_never_reaches_the_handler(tmp_path: Path) -> None:
    async def scenario() -> None:
        from websockets.asyncio.client import connect

        server, port, seen, ca = await _serve(tmp_path)
        async with server:
            files = make_member(ca, tmp_path / "client", "client")
            async with connect(f"wss://127.0.0.1:{port}/", ssl=files.client_context(pin_agent_id=False),
                               server_hostname="127.0.0.1") as connection:
                await connection.send(encode(StatusRequest()))
                frame = await connection.recv()
                await connection.wait_closed()
        assert seen == []
        refusal = decode(frame if isinstance(frame, bytes) else frame.encode())
        assert isinstance(refusal, Error) and refusal.code is ErrorCode.UNAUTHORIZED

    run(scenario())


def test_a_malformed_frame_is_answered_and_the_link_closed(tmp_path: Path) -> None:
    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca")
        server_files = make_member(ca, tmp_path / "server", "server")
        outcome: list[str] = []

        async def handler(link: Link) -> None:
            try:
                await link.receive()
            except LinkError as error:
                outcome.append(str(error))

        server = await start_server(handler, "127.0.0.1", 0, server_files)
        async with server:
            files = make_member(ca, tmp_path / "client", "client")
            link = await open_link(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", files)
            await link.connection.send(b"DSKF garbage")
            reply = await link.receive()
            assert isinstance(reply, Error) and reply.code is ErrorCode.BAD_MESSAGE
            with pytest.raises(LinkError):
                await link.receive()
        assert outcome and "malformed" in outcome[0]

    run(scenario())


def test_a_peer_whose_connection_is_cut_is_named_as_gone_not_as_a_missing_close_frame(tmp_path: Path) -> None:
    """A killed peer's socket closes with no websocket close: websockets' "no close frame received or sent" said
    nothing an admin could act on."""
    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca")
        server_files = make_member(ca, tmp_path / "server", "server")

        async def handler(link: Link) -> None:
            link.connection.transport.abort()  # as the kernel does for a process that was killed

        server = await start_server(handler, "127.0.0.1", 0, server_files)
        async with server:
            files = make_member(ca, tmp_path / "client", "client")
            link = await open_link(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", files)
            with pytest.raises(LinkError, match="ended without a websocket close: the peer's process ended or its "
                                                "network dropped the connection"):
                await asyncio.wait_for(link.receive(), timeout=10.0)  # a regression fails, not hangs

    run(scenario())


@pytest.mark.parametrize("own_address_gone", [False, True])
def test_a_peer_that_stops_answering_is_named_as_timed_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          own_address_gone: bool) -> None:
    # unless this PC's own address went meanwhile (a renewed lease, a rotated IPv6 address): the keepalive's words
    # blamed the peer, which an exploratory test's office found answering at its address all along
    if own_address_gone:  # as this PC's would be: loopback never goes
        monkeypatch.setattr(link_module, "_own_address_gone", lambda link: "10.0.0.5")
    expected = (r"this side of the link lost its address 10\.0\.0\.5 \(this PC's address changed, or it left the "
                r"network\) \[sent 1011" if own_address_gone else
                r"answered no keepalive ping within 0\.4 s: it stopped, slept or lost its network \[sent 1011")
    monkeypatch.setattr(link_module, "PING_INTERVAL_S", 0.2)
    monkeypatch.setattr(link_module, "PING_TIMEOUT_S", 0.4)
    monkeypatch.setattr(link_module, "CLOSE_TIMEOUT_S", 0.2)

    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca")
        server_files = make_member(ca, tmp_path / "server", "server")
        done = asyncio.Event()

        async def handler(link: Link) -> None:
            link.connection.transport.pause_reading()  # a stopped process: no pong, no close frame
            assert link.connection.keepalive_task is not None
            link.connection.keepalive_task.cancel()  # and no ping of its own to time out first
            await done.wait()

        server = await start_server(handler, "127.0.0.1", 0, server_files)
        async with server:
            files = make_member(ca, tmp_path / "client", "client")
            link = await open_link(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", files)
            try:
                with pytest.raises(LinkError, match=expected):
                    await asyncio.wait_for(link.receive(), timeout=4.0)
            finally:
                done.set()  # else the server waits for its handler forever

    run(scenario())


def test_a_peer_that_timed_out_on_this_side_says_this_side_was_silent() -> None:
    closed = ConnectionClosed(Close(CloseCode.INTERNAL_ERROR, "keepalive ping timeout"),
                              Close(CloseCode.INTERNAL_ERROR, "keepalive ping timeout"), True)
    assert why_closed(closed) == ("the peer had no answer to its keepalive pings within its timeout: this process was "
                                  "too busy to answer, or the network between dropped [received 1011 (internal "
                                  "error) keepalive ping timeout; then sent 1011 (internal error) keepalive ping "
                                  "timeout]")
    refused = ConnectionClosed(Close(CloseCode.POLICY_VIOLATION, "busy"), None)  # the peer's own words stand
    assert why_closed(refused) == "received 1008 (policy violation) busy; no close frame sent"
    # the close echoed back: the peer's reason once ("...; then sent" repeated it, and `fleet plan` ran past 300
    # characters a line)
    echoed = ConnectionClosed(Close(CloseCode.POLICY_VIOLATION, "speaks protocol 7"),
                              Close(CloseCode.POLICY_VIOLATION, "speaks protocol 7"), True)
    assert why_closed(echoed) == "received 1008 (policy violation) speaks protocol 7"
    ours = ConnectionClosed(Close(CloseCode.POLICY_VIOLATION, "speaks protocol 7"),
                            Close(CloseCode.POLICY_VIOLATION, "speaks protocol 7"), False)  # we closed first
    assert why_closed(ours) == "sent 1008 (policy violation) speaks protocol 7, and the peer echoed it"


def test_a_peer_that_never_says_hello_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_module, "HELLO_TIMEOUT_S", 0.5)

    async def scenario() -> None:
        server, port, seen, ca = await _serve(tmp_path)
        async with server:
            files = make_member(ca, tmp_path / "client", "client")
            silent = await connect(f"wss://127.0.0.1:{port}/", ssl=files.client_context(pin_agent_id=False),
                                   server_hostname="127.0.0.1")
            await asyncio.wait_for(silent.wait_closed(), timeout=5.0)  # its pongs alone kept it open before
            assert not server.connections and not seen

    run(scenario())


def test_a_member_posing_as_another_is_a_warning_though_its_silence_was_just_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the warnings of a member dropped at Hello were keyed by the exception's type, LinkError for both: a timeout
    # of the PC hid its Hello as another agent at debug level for 10 minutes
    monkeypatch.setattr(link_module, "HELLO_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        server, port, seen, ca = await _serve(tmp_path)
        async with server:
            files = make_member(ca, tmp_path / "client", "client")
            options = {"ssl": files.client_context(pin_agent_id=False), "server_hostname": "127.0.0.1"}
            silent = await connect(f"wss://127.0.0.1:{port}/", **options)
            await asyncio.wait_for(silent.wait_closed(), timeout=5.0)
            async with connect(f"wss://127.0.0.1:{port}/", **options) as posing:
                other = make_member(ca, tmp_path / "other", "other").own_identity()
                await posing.send(encode(Hello(PROTOCOL_VERSION, other.agent_id, "0.1", Role.AGENT)))
                await posing.wait_closed()
            assert not seen

    with records_of("deskfleet.agent.link", logging.DEBUG) as logged:
        run(scenario())
    dropped = [(record.levelno, record.getMessage()) for record in logged.records
               if "before hello" in record.getMessage()]
    assert [level for level, _ in dropped] == [logging.WARNING, logging.WARNING], dropped
    assert "said no Hello" in dropped[0][1] and "said Hello as agent" in dropped[1][1]


LONG_AGO = utc_now() - datetime.timedelta(days=10)  # a certificate made then for a day ran out 9 days ago
EXPIRED_ON = (LONG_AGO + datetime.timedelta(days=1)).date().isoformat()


def test_dialling_an_agent_whose_certificate_expired_names_it_the_day_and_the_fix(tmp_path: Path) -> None:
    # It said "cannot reach ...: certificate verify failed: certificate has expired": whose, since when, what to do?
    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca")
        agent = make_member(ca, tmp_path / "agent", "agent", now=LONG_AGO, valid_days=1)
        agent_id = agent.own_identity().agent_id
        server = await start_server(lambda link: link.close(), "127.0.0.1", 0, agent)
        async with server:
            controller = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER)
            with pytest.raises(LinkError, match=f"certificate of agent {agent_id[:12]} expired on {EXPIRED_ON}: "
                                                "join it again with a new token"):
                await open_link(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", controller,
                                expected_agent_id=agent_id)

    run(scenario())


def test_a_client_whose_certificate_expired_is_refused_naming_it_on_both_sides(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The server refused it in the handshake without a word, and the client read "did not receive a valid HTTP
    # response"
    async def scenario() -> None:
        server, port, seen, ca = await _serve(tmp_path)
        async with server:
            client = make_member(ca, tmp_path / "client", "client", now=LONG_AGO, valid_days=1)
            with caplog.at_level(logging.WARNING, logger="deskfleet.agent.link"), \
                    pytest.raises(LinkRefused, match=f"403 the certificate of agent .* expired on {EXPIRED_ON}: "
                                                     "join it again") as refused:
                await open_link(f"127.0.0.1:{port}", client)
        assert refused.value.status == 403 and seen == []
        agent_id = client.own_identity().agent_id
        assert any(f"certificate of agent {agent_id[:12]} expired on {EXPIRED_ON}" in record.getMessage()
                   for record in caplog.records)

    run(scenario())


def test_a_fleet_whose_ca_expired_is_named_with_the_day_and_fleet_init_force(tmp_path: Path) -> None:
    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca", now=LONG_AGO, valid_days=1)
        agent = make_member(ca, tmp_path / "agent", "agent", now=LONG_AGO)
        server = await start_server(lambda link: link.close(), "127.0.0.1", 0, agent)
        async with server:
            controller = make_member(ca, tmp_path / "controller", "controller", Role.CONTROLLER, now=LONG_AGO)
            with pytest.raises(LinkError, match=f"fleet CA .* expired on {EXPIRED_ON}: make a new fleet with "
                                                "`deskfleet fleet init --force`"):
                await open_link(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", controller,
                                expected_agent_id=agent.own_identity().agent_id)

    run(scenario())


@pytest.mark.parametrize(("address", "host"), [
    (("10.0.0.7", 51234), "10.0.0.7"),
    (("::ffff:10.0.0.7", 51234, 0, 0), "10.0.0.7"),  # IPv4-mapped: the same host as over IPv4
    (("2001:db8:1:2:aaaa::1", 51234, 0, 0), "2001:db8:1:2::/64"),  # any address of its /64 is the same host
    (("2001:db8:1:2:bbbb::9", 51234, 0, 0), "2001:db8:1:2::/64"),
    (("fe80::1%eth0", 51234, 0, 2), "fe80::/64"),
    (None, "?"),
])
def test_the_join_limit_counts_a_host_by_its_address_or_its_ipv6_64(address: object, host: str) -> None:
    # keyed by the address alone, one IPv6 host could open every join slot from addresses of its /64
    from types import SimpleNamespace

    from deskfleet.agent.link import _remote_host

    assert _remote_host(SimpleNamespace(remote_address=address)) == host  # type: ignore[arg-type]


def test_a_link_tells_whether_the_address_it_ran_from_is_still_this_pcs() -> None:
    # all of 127/8 is this PC's though psutil lists 127.0.0.1 alone: a link from 127.0.0.2 that died was said to
    # have lost its address (from a review)
    from types import SimpleNamespace

    from deskfleet.agent.link import _own_address_gone, is_local_address

    def gone(host: str | None) -> str | None:
        return _own_address_gone(SimpleNamespace(local_host=host))  # type: ignore[arg-type]

    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.77")  # a documentation address
    assert gone("192.0.2.77") == "192.0.2.77" and gone("::ffff:192.0.2.77") == "192.0.2.77"
    assert gone("127.0.0.2") is None and gone("::ffff:127.0.0.2") is None and gone("127.0.0.1") is None
    assert gone("fe80::1%eth0") is None and gone(None) is None and gone("not an address") is None
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
    except OSError:  # no IPv6 in this kernel: an IPv6 address cannot be told gone
        assert gone("2001:db8::77") is None
    else:
        assert gone("2001:db8::77") == "2001:db8::77" and gone("::1") is None


def test_a_link_the_peer_closed_as_done_is_told_apart_from_one_that_failed() -> None:
    # every run's driver closes its links with 1000 at its end: logged at INFO, two thirds of an agent's log lines
    from types import SimpleNamespace

    from deskfleet.agent.link import _closed

    link = SimpleNamespace(describe=lambda: "controller cccccccccccc at 10.0.0.1:50000", local_host=None)
    done = _closed(link, ConnectionClosed(Close(CloseCode.NORMAL_CLOSURE, ""), Close(CloseCode.NORMAL_CLOSURE, ""),
                                          True))  # type: ignore[arg-type]
    going = _closed(link, ConnectionClosed(Close(CloseCode.GOING_AWAY, ""), None))  # type: ignore[arg-type]
    refused = _closed(link, ConnectionClosed(Close(CloseCode.POLICY_VIOLATION, "no"), None))  # type: ignore[arg-type]
    dropped = _closed(link, ConnectionClosed(None, None))  # type: ignore[arg-type]
    assert done.closed_normally and going.closed_normally
    assert not refused.closed_normally and not dropped.closed_normally
    assert str(done) == "link to controller cccccccccccc at 10.0.0.1:50000 closed: received 1000 (OK)"


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no IPv6 socket takes IPv4 too on this PC")
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_every_interface_is_both_ip_families_at_one_port(tmp_path: Path, host: str) -> None:
    # on 0.0.0.0 alone, an office's IPv6-only segment reached neither `fleet serve` (no PC could join) nor an agent,
    # which registered its IPv6 address where nothing listened (from an exploratory test of an IPv6-only LAN)
    from deskfleet.agent.link import listen_text

    async def scenario() -> None:
        ca = make_ca(tmp_path / "ca")
        server_files = make_member(ca, tmp_path / "server", "server")
        peers: list[str] = []

        async def handler(link: Link) -> None:
            peers.append(link.address)

        server = await start_server(handler, host, 0, server_files)
        async with server:
            port = server.sockets[0].getsockname()[1]
            assert len(server.sockets) == 1  # one port for both, also where it was 0
            files = make_member(ca, tmp_path / "client", "client")
            for address in (f"127.0.0.1:{port}", f"[::1]:{port}"):
                link = await open_link(address, files)
                await link.close()
            for _ in range(100):
                if len(peers) == 2:
                    break
                await asyncio.sleep(0.02)
        # an IPv4 peer is named as IPv4, not as the IPv4-mapped IPv6 address the socket gives
        assert [peer.rsplit(":", 1)[0] for peer in peers] == ["127.0.0.1", "[::1]"]
        assert listen_text(host, port) == f"every interface (IPv4 and IPv6) at port {port}"

    run(scenario())


def kernel_caps_retransmits() -> bool:
    """Whether this system takes TCP_RTO_MAX_MS (Linux 6.15 and later)."""
    with socket.socket() as probe:
        try:
            probe.setsockopt(socket.IPPROTO_TCP, link_module._TCP_RTO_MAX_MS, 1000)
        except OSError:
            return False
    return True


@pytest.mark.skipif(not kernel_caps_retransmits(), reason="this system has no TCP_RTO_MAX_MS")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_both_ends_of_a_link_cap_tcps_retransmission_back_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              loop: str) -> None:
    # an 8 s drop of a PC's link outlasted the 10 s keepalive: TCP's resends came at 6.2 s and 12.6 s
    monkeypatch.setenv("DESKFLEET_EVENT_LOOP", loop)

    def cap(link: Link) -> int:
        sock = link.connection.transport.get_extra_info("socket")
        return int(sock.getsockopt(socket.IPPROTO_TCP, link_module._TCP_RTO_MAX_MS))

    async def scenario() -> tuple[int, int]:
        server, port, seen, ca = await _serve(tmp_path)
        async with server:
            link = await open_link(f"127.0.0.1:{port}", make_member(ca, tmp_path / "client", "client", Role.CONTROLLER))
            await link.send(StatusRequest())
            await link.receive()
            caps = cap(link), cap(seen[0])
            await link.close()
            return caps

    assert event_loop.run(scenario()) == (link_module.RETRANSMIT_BACKOFF_CAP_MS,) * 2


def test_a_live_link_answers_a_ping_and_a_closed_one_does_not(tmp_path: Path) -> None:
    async def scenario() -> tuple[bool, bool]:
        server, port, _, ca = await _serve(tmp_path)
        async with server:
            link = await open_link(f"127.0.0.1:{port}", make_member(ca, tmp_path / "client", "client", Role.CONTROLLER))
            live = await link.answers_within(2.0)
            await link.close()
            return live, await link.answers_within(2.0)

    assert asyncio.run(scenario()) == (True, False)
