"""Authenticated fleet links: websockets over TLS 1.3 with client certificates, carrying wire frames.

Used by both sides (the controller installs the agent package). The rules every link follows:
- TLS 1.3 with the fleet CA as the only trust anchor and a certificate on both ends (common/tls.py);
- right after the handshake, before the websocket upgrade is answered, the server re-reads the peer's
  certificate and refuses a revoked agent with HTTP 403 (revocation is not in the certificate);
- the first message each way is Hello, and its agent id must be the one the certificate proves;
  nothing else is read before it, so nothing a stranger sends reaches a stage;
- one websocket message = one wire frame (binary); frames up to the codec's limit, but a listening side reads at
  most SMALL_FRAME_BYTES of a member's until its Hello checked out, and of a member it has no large frames to
  take from after it (start_server's `large_frames`);
- websocket pings keep the link alive and close it within PING_INTERVAL_S + PING_TIMEOUT_S +
  CLOSE_TIMEOUT_S (17 s) when the peer disappears: after a missed pong, websockets sends a close frame
  and waits CLOSE_TIMEOUT_S for the answer a stopped peer never gives (measured: 17.0 s on a SIGSTOPped
  agent); a killed peer's socket closes at once;
- TCP's retransmission back-off is capped at RETRANSMIT_BACKOFF_CAP_MS where the system takes it (Linux 6.15 and
  later), so that a link whose cable or Wi-Fi dropped for less than the ping timeout carries on within a second of
  coming back (`cap_retransmit_backoff`).

This module is thin asyncio around the sans-I/O codec in common/wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import ipaddress
import logging
import re
import socket
import ssl
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, NoReturn, TypedDict

from cryptography import x509
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.frames import CloseCode
from websockets.http11 import Request, Response

from deskfleet.agent.tls_gate import TlsGate, address_text, host_key
from deskfleet.common import pki, tls
from deskfleet.common.log_limit import LogEvery
from deskfleet.common.version import software_version
from deskfleet.common.wire import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Hello,
    Message,
    ProtocolError,
    Role,
    decode,
    encode,
    host_port,
    listens_everywhere,
    parse_address,
    peek_version,
)

log = logging.getLogger(__name__)

PING_INTERVAL_S = 5.0
PING_TIMEOUT_S = 10.0
# A peer that does not answer our close frame within this is stalled (a stopped process): the TCP connection is
# dropped then. websockets' default, 10 s, held Ctrl-C on a chain with a stalled PC for that long.
CLOSE_TIMEOUT_S = 2.0
CANCELLED_CLOSE_S = 0.5  # how long a dial cancelled in its Hello waits for its close to be answered
# The longest wait between two resends of unacknowledged data. TCP doubles it from ~0.2 s at each resend, to 120 s:
# after an 8 s drop of a PC's link, the resends came at 6.2 s (still down) and 12.6 s, and the 10 s keepalive ping
# had timed out meanwhile, so a chain of PCs that were all fine failed over (measured side by side, 3-PC chains in
# network namespaces, 700-token runs: 8 s drops of a PC's or the controller's link failed over in 12 of 17 runs
# before, in none of 17 with the cap, each resuming within 0.2-1.0 s of the link coming back; a PC cut off for good
# was found as before, 16-19 s from the cut to the warning). Drops longer than the keepalive's 10 s still fail over.
# It costs one resend a second while a link is down.
RETRANSMIT_BACKOFF_CAP_MS = 1000
_TCP_RTO_MAX_MS = 44  # <linux/tcp.h>, Linux 6.15 and later; Python's socket module does not name it yet
OPEN_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = OPEN_TIMEOUT_S  # a peer that opened a websocket but says no Hello is dropped after this
# The join exchange's messages are a few KB (a CSR, a token, certificates): a client with no certificate
# may send no more, and no more than this many such clients are served at once (anyone on the LAN can
# open one; at the fleet's frame limit three of them made the controller buffer 1.2 GB), nor more than
# MAX_JOINS_PER_HOST from one address: one host holding every slot open (the controller's JoinRequest wait,
# fleet_ca.JOIN_REQUEST_TIMEOUT_S, ended each after 30 s, and it opened another) blocked every join of the fleet.
ENROLLMENT_MAX_FRAME_BYTES = 64 * 1024
# What a listening side reads of a member's frames until its Hello checked out, and after it from a member that
# `start_server`'s `large_frames` does not name: a Hello is a few hundred bytes. At the codec's limit (320 MB) a
# member's unfinished message held that much of the agent's memory per link, on as many links as it opened.
SMALL_FRAME_BYTES = 64 * 1024
# The largest frame a link that only reads a member's replies takes (a survey's StatusReport, a deploy's ShardHave
# and StageReady: a few KB): a member answered a survey's StatusRequest with 300 MB, and `fleet ls` held it
REPLY_MAX_FRAME_BYTES = 1024 * 1024
MAX_CONCURRENT_JOINS = 16
MAX_JOINS_PER_HOST = 4
REFUSAL_LOG_EVERY_S = 60.0  # a join refused as one too many is logged once this often per host
# a member dropped at Hello (another protocol, most often: a PC not upgraded yet retries every 30 s) is logged as a
# warning once this often per member and kind of failure, at debug level between
HELLO_FAILURE_LOG_EVERY_S = 600.0


SOFTWARE_VERSION = software_version()  # said in every Hello: `fleet ls` shows each agent's

Connection = ServerConnection | ClientConnection
RevocationSource = Callable[[], pki.RevocationSet]


class LinkError(ConnectionError):
    """The link failed or was refused; the message names the peer and the reason. `closed_because`: where an open
    link closed, why, in words (why_closed), for a message that names the peer already; `closed_normally`: the peer
    closed it as done (1000 OK, 1001 going away), as a driver does at the end of every run; `too_big`: the peer
    closed it as a frame we sent was larger than it reads from us (1009: SMALL_FRAME_BYTES, as we feed none of its
    stages), a refusal, not a link that failed."""

    def __init__(self, message: str, closed_because: str | None = None, closed_normally: bool = False,
                 too_big: bool = False, own_address_gone: str | None = None, peer_closed: bool = False) -> None:
        super().__init__(message)
        self.closed_because = closed_because
        self.closed_normally = closed_normally
        self.too_big = too_big
        # the address this end of the link ran from, where the link died as this PC lost it: no peer is at fault
        self.own_address_gone = own_address_gone
        self.peer_closed = peer_closed  # the peer's close frame came (it closed the link: no network dropped it)


class LinkVersionError(LinkError):
    """The peer speaks another protocol version (`peer_protocol`; its deskfleet `peer_software` where its Hello
    said): one of the two must be upgraded, and the message says which. `peer_agent_id`: the id its certificate
    showed, where the link got that far."""

    def __init__(self, message: str, peer_protocol: int, peer_software: str | None,
                 peer_agent_id: str | None = None) -> None:
        super().__init__(message)
        self.peer_protocol = peer_protocol
        self.peer_software = peer_software
        self.peer_agent_id = peer_agent_id


class HelloMismatch(LinkError):
    """The peer's Hello named another agent id or role than its certificate proves: a member posing as another."""


class LinkRefused(LinkError):
    """The peer answered the upgrade with an HTTP error: `status` (403: this member's certificate was refused: see
    `removed`)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    @property
    def removed(self) -> bool:
        """The peer refused this member as removed from the fleet (not for a date: see pki.REMOVED_WORDS)."""
        return self.status == HTTPStatus.FORBIDDEN and pki.REMOVED_WORDS in str(self)


@dataclass(frozen=True)
class TlsFiles:
    """Where one fleet member keeps its credentials (PEM files; the key readable by the owner only)."""

    ca_path: Path
    cert_path: Path
    key_path: Path

    @classmethod
    def in_folder(cls, folder: Path, name: str) -> TlsFiles:
        return cls(folder / "ca.pem", folder / f"{name}.pem", folder / f"{name}-key.pem")

    def exist(self) -> bool:
        return not self.missing()

    def missing(self) -> list[Path]:
        """The credential files that are not there."""
        return [path for path in (self.ca_path, self.cert_path, self.key_path) if not path.is_file()]

    def ca_certificate(self) -> x509.Certificate:
        with self._naming(self.ca_path):
            return pki.load_certificate_pem(self.ca_path.read_bytes())

    def own_identity(self) -> pki.PeerIdentity:
        with self._naming(self.cert_path):
            return pki.certificate_identity(pki.load_certificate_pem(self.cert_path.read_bytes()))

    def server_context(self) -> ssl.SSLContext:
        with self._naming(self.cert_path, self.key_path):
            return tls.server_context(ca_path=self.ca_path, cert_path=self.cert_path, key_path=self.key_path)

    def client_context(self, pin_agent_id: bool = True) -> ssl.SSLContext:
        with self._naming(self.cert_path, self.key_path):
            return tls.client_context(ca_path=self.ca_path, cert_path=self.cert_path, key_path=self.key_path,
                                      pin_agent_id=pin_agent_id)

    @staticmethod
    @contextlib.contextmanager
    def _naming(*paths: Path) -> Iterator[None]:
        """PkiError naming the credential files when one cannot be loaded (ssl says only "PEM lib")."""
        try:
            yield
        except (pki.PkiError, ssl.SSLError, ValueError) as error:
            names = " or ".join(str(path) for path in paths)
            raise pki.PkiError(f"{names} cannot be used ({error}): this member's credentials are damaged; "
                               "join the fleet again (the controller: restore its data dir)") from None


def _closed(link: Link, error: ConnectionClosed) -> LinkError:
    why = why_closed(error)
    gone = _own_address_gone(link) if error.rcvd is None else None  # a peer's close frame came: it closed, not us
    if gone is not None:
        # this PC's own address went (a renewed lease, a rotated IPv6 address, its network left): the keepalive's
        # words blamed the peer, which an exploratory test's office found answering at its address all along
        why = f"this side of the link lost its address {gone} (this PC's address changed, or it left the " \
              f"network) [{error}]"
    normally = error.rcvd is not None and error.rcvd.code in (CloseCode.NORMAL_CLOSURE, CloseCode.GOING_AWAY)
    too_big = error.rcvd is not None and error.rcvd.code == CloseCode.MESSAGE_TOO_BIG
    return LinkError(f"link to {link.describe()} closed: {why}", closed_because=why, closed_normally=normally,
                     too_big=too_big, own_address_gone=gone, peer_closed=error.rcvd is not None)


def _own_address_gone(link: Link) -> str | None:
    """The address this end of `link` ran from, where this PC no longer has it (a socket can no longer be bound to
    it); None where it has it still, or it cannot be told (loopback, which never goes: all of 127/8 is this PC's
    though no interface lists 127.0.0.2; a link-local one, whose zone is not kept)."""
    if link.local_host is None:
        return None
    try:
        ip = ipaddress.ip_address(link.local_host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
        return None
    return str(ip) if not is_local_address(str(ip)) else None


def is_local_address(host: str) -> bool:
    """Whether `host` (an IP address) is this PC's: a socket can be bound to it. An address routed to this PC but
    listed by no interface (a local route) counts; where binding fails for another reason than the address, it
    counts too (nothing is said to be gone that may not be)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
    except OSError as error:
        return error.errno != errno.EADDRNOTAVAIL
    return True


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


KEEPALIVE_TIMEOUT_REASON = "keepalive ping timeout"  # the close reason websockets gives a missed pong


def why_closed(error: ConnectionClosed) -> str:
    """What ended a link, in words an admin can act on, with websockets' own account in brackets.

    websockets says "no close frame received or sent" for a peer whose process ended or whose network dropped
    the connection, and "sent 1011 (internal error) keepalive ping timeout; no close frame received" for one
    that stopped answering (asleep, stopped, or cut off without a reset): neither said that the PC went away,
    nor that the second was a timeout."""
    sent, received = error.sent, error.rcvd
    if received is None and sent is not None and sent.reason == KEEPALIVE_TIMEOUT_REASON:
        return (f"the peer answered no keepalive ping within {PING_TIMEOUT_S:g} s: it stopped, slept or lost its "
                f"network [{error}]")
    if received is not None and received.reason == KEEPALIVE_TIMEOUT_REASON:
        return (f"the peer had no answer to its keepalive pings within its timeout: this process was too busy to "
                f"answer, or the network between dropped [{error}]")
    if received is None and sent is None:
        return f"the connection ended without a websocket close: the peer's process ended or its network " \
               f"dropped the connection [{error}]"
    if received is not None and sent is not None and (sent.code, sent.reason) == (received.code, received.reason):
        # the close echoed: websockets' "...; then sent" repeated the reason; said once, by whoever said it first
        return f"received {received}" if error.rcvd_then_sent else f"sent {sent}, and the peer echoed it"
    return str(error)


def no_revocations() -> pki.RevocationSet:
    return pki.RevocationSet()


class Link:
    """One open, authenticated websocket to a fleet member, after the Hello exchange."""

    def __init__(self, connection: Connection, peer: pki.PeerIdentity, address: str) -> None:
        self.connection = connection
        self.peer = peer
        self.address = address
        self.peer_software: str | None = None  # the deskfleet version its Hello named
        sockname = connection.transport.get_extra_info("sockname")  # a closed TLS transport no longer tells it
        self.local_host: str | None = str(sockname[0]) if isinstance(sockname, tuple) and sockname else None
        cap_retransmit_backoff(connection)

    async def answers_within(self, seconds: float) -> bool:
        """Whether the peer answers a websocket ping within `seconds`: a link that outlived a network fault may still
        be waiting out TCP's back-off, or lead to a peer gone that its keepalive has not found yet."""
        try:
            async with asyncio.timeout(seconds):
                pong = await self.connection.ping()
                await pong
        except (TimeoutError, ConnectionClosed):
            return False
        return True

    def sending(self) -> bool:
        """Whether data written to the link waits in its transport to be sent."""
        transport = self.connection.transport
        return transport is not None and transport.get_write_buffer_size() > 0

    def take_large_frames(self) -> None:
        """Read frames up to the codec's limit on this link from now on: a listening side's link reads at most
        SMALL_FRAME_BYTES until it is told so (`start_server`'s `large_frames`, or later: a stage assigned)."""
        self.connection.protocol.max_message_size = DEFAULT_LIMITS.max_frame_bytes

    def take_small_frames(self) -> None:
        """Read frames of at most SMALL_FRAME_BYTES again (a stage released: its previous hop sends nothing large),
        from the next frame's start; a frame being read goes on under the limit it began with."""
        self.connection.protocol.max_message_size = SMALL_FRAME_BYTES

    # Public methods

    async def send(self, message: Message) -> None:
        try:
            await self.connection.send(encode(message))
        except ConnectionClosed as error:
            raise _closed(self, error) from None

    async def receive(self) -> Message:
        """The next message. A malformed one is answered with Error(BAD_MESSAGE), the link closed, and
        LinkError raised; an Error from the peer is returned like any other message."""
        return await self._decode(await self._receive_frame())

    async def _receive_frame(self) -> bytes:
        try:
            frame = await self.connection.recv()
        except ConnectionClosed as error:
            raise _closed(self, error) from None
        if isinstance(frame, str):
            await self.refuse(ErrorCode.BAD_MESSAGE, "text frames are not part of the protocol")
            raise LinkError(f"{self.describe()} sent a text frame")
        return frame

    async def _decode(self, frame: bytes) -> Message:
        try:
            return decode(frame)
        except ProtocolError as error:
            await self.refuse(ErrorCode.BAD_MESSAGE, str(error))
            raise LinkError(f"{self.describe()} sent a malformed message: {error}") from None

    async def refuse(self, code: ErrorCode, text: str) -> None:
        """Tell the peer why, then close (policy violation)."""
        try:
            await self.connection.send(encode(Error(code, text[:1000])))
        except ConnectionClosed:
            pass
        await self.connection.close(1008, code.value)

    async def close(self) -> None:
        await self.connection.close()

    def describe(self) -> str:
        return f"{self.peer.role.value} {self.peer.agent_id[:12]} at {self.address}"


def cap_retransmit_backoff(connection: Connection) -> bool:
    """Cap the TCP retransmission back-off of `connection`'s socket at RETRANSMIT_BACKOFF_CAP_MS; False where the
    system has no such option (an older Linux refuses it; Windows and macOS have none: their own back-off stays) or
    the socket is not at hand. Both event loops give the TCP socket beneath the TLS layer."""
    sock = connection.transport.get_extra_info("socket") if connection.transport is not None else None
    if sock is None or not sys.platform.startswith("linux"):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, RETRANSMIT_BACKOFF_CAP_MS)
    except OSError as error:
        log.debug("TCP's retransmission back-off stays uncapped on this system: %s", error)
        return False
    return True


# Public functions: serving

async def start_server(handler: Callable[[Link], Awaitable[None]], host: str, port: int, files: TlsFiles,
                       revocations: RevocationSource = no_revocations,
                       enrollment: Callable[[ServerConnection], Awaitable[None]] | None = None,
                       large_frames: Callable[[pki.PeerIdentity], bool] = lambda peer: False) -> Server:
    """Listen for fleet members. `handler` gets each link after its Hello and must return when done.

    Every connection reads frames of at most SMALL_FRAME_BYTES until its Hello checked out; then a member that
    `large_frames` names (an agent's controller, a hosted stage's previous hop) reads up to the codec's limit,
    before this side's Hello goes out, so that nothing the peer sends after it meets the small limit. Another
    member's link stays small; `Link.take_large_frames` widens it later.

    `enrollment` (the controller only): a client that presents NO certificate is handed, raw, to this
    handler, which must speak only the join exchange; a client presenting a certificate that does not
    chain to the fleet CA still fails the TLS handshake. Such a port reads frames of at most
    ENROLLMENT_MAX_FRAME_BYTES from every client, members too (they only say Hello and Register there).
    The returned server is an async context manager.
    """
    own = files.own_identity()
    ca_certificate = files.ca_certificate()
    context = files.server_context()
    if enrollment is not None:
        context.verify_mode = ssl.CERT_OPTIONAL
    joins: Counter[str] = Counter()  # certificate-less clients being served now, by their address
    refusals_said = LogEvery()  # by host: a join refused as too many
    hello_failures_said = LogEvery()  # by (member, kind of failure): a member dropped at Hello

    def check_peer(connection: ServerConnection, request: Request) -> Response | None:
        if enrollment is not None and not _has_peer_certificate(connection):
            return None
        try:
            peer_identity(connection, ca_certificate, revocations())
        except pki.PkiError as error:
            log.warning("refused %s: %s", _remote(connection), error)
            return connection.respond(HTTPStatus.FORBIDDEN, f"{error}\n")
        return None

    async def on_connection(connection: ServerConnection) -> None:
        if enrollment is not None and not _has_peer_certificate(connection):
            host = _remote_host(connection)
            busy = ("joins in progress" if joins.total() >= MAX_CONCURRENT_JOINS else
                    f"joins in progress from {host}" if joins[host] >= MAX_JOINS_PER_HOST else None)
            if busy is not None:
                # once a minute a host: one that reopens its connections at once wrote 1,671 lines in 30 s
                level = logging.WARNING if refusals_said.due(host, REFUSAL_LOG_EVERY_S) else logging.DEBUG
                log.log(level, "refused a join from %s: too many %s (said once a minute)", _remote(connection), busy)
                await connection.close(CloseCode.TRY_AGAIN_LATER, f"too many {busy}")
                return
            joins[host] += 1
            try:
                await enrollment(connection)
            finally:
                joins[host] -= 1
                if not joins[host]:
                    del joins[host]
            return
        peer = peer_identity(connection, ca_certificate, revocations())
        link = Link(connection, peer, _remote(connection))
        try:
            await _exchange_hello(link, own, expect_first=True, large_frames=large_frames)
        except LinkError as error:
            # an office of PCs not upgraded yet, each retrying every 30 s, wrote a warning a PC a retry; a member
            # posing as another is a kind of its own (HelloMismatch), so a timeout of the same PC does not hide it
            warn = hello_failures_said.due((peer.agent_id, type(error).__name__), HELLO_FAILURE_LOG_EVERY_S)
            log.log(logging.WARNING if warn else logging.DEBUG, "dropped %s before hello: %s%s", link.address, error,
                    f" (said again every {HELLO_FAILURE_LOG_EVERY_S / 60:.0f} minutes at most)" if warn else "")
            return
        await handler(link)

    # TLS per connection (tls_gate): a refusal names its peer, and one host cannot hold connections without limit
    gate = TlsGate(context, handshake_timeout_s=OPEN_TIMEOUT_S, shutdown_timeout_s=CLOSE_TIMEOUT_S)
    sock = every_interface_socket(host, port)
    where: dict[str, Any] = {"sock": sock} if sock is not None else {"host": host, "port": port}
    return await serve(on_connection, create_connection=gate.connection_class(), process_request=check_peer,
                       **where, **_server_websocket_options(takes_enrollment=enrollment is not None))


def listen_text(host: str, port: int) -> str:
    """Where a server listens, for its log: "every interface (IPv4 and IPv6) at port 7431", or host:port."""
    if listens_everywhere(host):
        return f"every interface ({'IPv4 and IPv6' if socket.has_dualstack_ipv6() else 'IPv4'}) at port {port}"
    return host_port(host, port)


def every_interface_socket(host: str, port: int) -> socket.socket | None:
    """For a host that means every interface, one socket of both IP families (IPv4 peers arrive as IPv4-mapped IPv6
    addresses, which host_key and address_text read as IPv4), where the PC has IPv6; None: listen on `host` as given.
    On 0.0.0.0 alone, an office's IPv6-only segment reached neither `fleet serve` (no PC could join) nor an agent,
    which registered its IPv6 address where nothing listened; asyncio's own "every interface" binds a socket a family,
    each at a port of its own where the port is 0."""
    if not listens_everywhere(host) or not socket.has_dualstack_ipv6():
        return None
    try:
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise
        log.debug("listening on IPv4 alone: no IPv6 socket (%s)", error)  # IPv6 turned off on this PC
        return None


def listening_families(sockets: Iterable[socket.socket]) -> frozenset[int]:
    """The IP versions (4, 6) a server's `sockets` take connections over: a dual-stack IPv6 socket both."""
    families = set()
    for listener in sockets:
        if listener.family == socket.AF_INET:
            families.add(4)
        elif listener.family == socket.AF_INET6:
            families.add(6)
            if not listener.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY):
                families.add(4)
    return frozenset(families)


def peer_identity(connection: Connection, ca_certificate: x509.Certificate,
                  revoked: pki.RevocationSet) -> pki.PeerIdentity:
    """The verified identity of the TLS peer of `connection`; PkiError if absent, foreign or revoked."""
    ssl_object = connection.transport.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise pki.PkiError("the peer presented no certificate")
    return tls.peer_identity(der, ca_certificate, utc_now(), revoked)


# Public functions: connecting

async def open_link(address: str, files: TlsFiles, expected_agent_id: str | None = None,
                    revocations: RevocationSource = no_revocations, open_timeout: float = OPEN_TIMEOUT_S,
                    max_frame_bytes: int | None = None) -> Link:
    """Connect to a fleet member at host:port and exchange Hello. `max_frame_bytes`: the largest frame the link
    takes from the peer (None: the codec's limit, 320 MB: a stage's results); a link that only reads replies (a
    survey's, a deploy's) says less, or any member could make the dialling side hold that much a link.

    With `expected_agent_id` the TLS handshake itself pins the peer (its certificate must name that
    agent id); without it (a manual --peer) any fleet certificate is accepted and read afterwards.
    Raises LinkError naming the address and the reason; `open_timeout` bounds the TCP, TLS and websocket
    opening (not the Hello, which HELLO_TIMEOUT_S bounds).
    """
    host, port = parse_address(address)
    context = files.client_context(pin_agent_id=expected_agent_id is not None)
    uri = f"wss://{_uri_host(host)}:{port}/"
    options = websocket_options()
    if max_frame_bytes is not None:
        options["max_size"] = max_frame_bytes
    try:
        connection = await connect(uri, ssl=context, server_hostname=expected_agent_id or host,
                                   open_timeout=open_timeout, **options)
    except InvalidStatus as error:
        raise LinkRefused(f"{address} refused the link: HTTP {error.response.status_code} "
                          f"{error.response.body.decode('utf-8', 'replace').strip()}",
                          error.response.status_code) from None
    except (OSError, TimeoutError, InvalidHandshake, ssl.SSLError) as error:
        raise LinkError(f"cannot reach {address}: {_connect_failure(error)}") from None
    except ValueError as error:  # the resolver's refusal of a name (UnicodeError): one address, not the caller's run
        raise LinkError(f"cannot reach {address}: {str(error)[:200]}") from None
    try:
        try:
            peer = peer_identity(connection, files.ca_certificate(), revocations())
        except pki.PkiError as error:  # the peer is told why (an expired certificate: whose, since when, the fix)
            await connection.close(1008, _close_reason(f"unauthorized: {error}"))
            raise LinkError(f"{address} is not an acceptable fleet member: {error}") from None
        link = Link(connection, peer, address)
        await _exchange_hello(link, files.own_identity(), expect_first=False)
    except asyncio.CancelledError:  # cancelled in its Hello (a race of a PC's addresses lost): said with a close
        # frame, briefly waited for. Aborted, the link read on the other side as one that failed: `fleet serve`
        # said after each of its restarts that a live agent "did not register" (from an exploratory test)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(connection.close(CloseCode.GOING_AWAY, "given up as it opened"),
                                   CANCELLED_CLOSE_S)
        connection.transport.abort()
        raise
    except BaseException:  # refused: nothing keeps it
        connection.transport.abort()
        raise
    return link


async def open_first(addresses: Sequence[str], open_one: Callable[[str], Coroutine[Any, Any, Link]], stagger_s: float,
                     failed: Callable[[str, LinkError], None] | None = None) -> Link:
    """The link `open_one` opens at the first of `addresses` to answer. Each is dialled `stagger_s` after the one
    before it, or as soon as that one fails (RFC 8305's race of a name's addresses): an address that answers costs
    the ones after it nothing, and one black-holed costs `stagger_s`, not the open timeout. Dials still going once one
    opens are cancelled, links they opened closed. `failed` hears each address that fails. Raises LinkError: the one
    address's, or one naming every address's failure."""
    if not addresses:
        raise ValueError("no address to dial")
    waiting = list(addresses)
    dials: dict[asyncio.Task[Link], str] = {}
    failures: list[LinkError] = []
    link: Link | None = None
    try:
        while link is None and (waiting or dials):
            if waiting:
                address = waiting.pop(0)
                dials[asyncio.create_task(open_one(address), name=f"dial {address}")] = address
            done, _ = await asyncio.wait(dials, timeout=stagger_s if waiting else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            for dial in done:
                address = dials.pop(dial)
                try:
                    opened = dial.result()
                except LinkError as error:
                    failures.append(error)
                    if failed is not None:
                        failed(address, error)
                    continue
                if link is None:
                    link = opened
                else:
                    await opened.close()
    except BaseException:  # cancelled, or a dial raised what no dial should: the link that won goes too
        if link is not None:
            with contextlib.suppress(Exception):
                await link.close()
        raise
    finally:
        for dial in dials:
            dial.cancel()
        for result in await asyncio.gather(*dials, return_exceptions=True):
            if not isinstance(result, BaseException):  # opened as the race ended: nobody takes it
                await result.close()
    if link is not None:
        return link
    if len(failures) == 1:
        raise failures[0]
    raise LinkError("; ".join(str(error) for error in failures))


# Private functions

def _close_reason(text: str) -> str:
    """`text` cut to what a websocket close frame carries (123 bytes of UTF-8)."""
    data = text.encode("utf-8")
    return text if len(data) <= 123 else data[:120].decode("utf-8", "ignore") + "..."


def _has_peer_certificate(connection: Connection) -> bool:
    ssl_object = connection.transport.get_extra_info("ssl_object")
    return ssl_object is not None and bool(ssl_object.getpeercert(binary_form=True))


class WebsocketOptions(TypedDict):
    max_size: int
    ping_interval: float
    ping_timeout: float
    close_timeout: float
    compression: None


def websocket_options() -> WebsocketOptions:
    """Options every fleet websocket uses, enrollment included: frames up to the codec's limit, pings."""
    return WebsocketOptions(max_size=DEFAULT_LIMITS.max_frame_bytes, ping_interval=PING_INTERVAL_S,
                            ping_timeout=PING_TIMEOUT_S, close_timeout=CLOSE_TIMEOUT_S, compression=None)


def _server_websocket_options(takes_enrollment: bool) -> WebsocketOptions:
    """A listening side limits frames to SMALL_FRAME_BYTES from the connection's first byte: websockets parses a
    frame sent right behind the upgrade request before process_request sees the client, so a limit lowered there
    let a stranger's pipelined frame of up to the codec's limit (320 MB) into memory. A member's link reads more
    once its Hello checked out and `start_server`'s `large_frames` names it (enrollment's clients never do, nor
    `fleet serve`'s members, which send only Hello, Register and the removals they keep: a port that takes enrollment
    reads ENROLLMENT_MAX_FRAME_BYTES from all)."""
    options = websocket_options()
    options["max_size"] = ENROLLMENT_MAX_FRAME_BYTES if takes_enrollment else SMALL_FRAME_BYTES
    return options


async def _exchange_hello(link: Link, own: pki.PeerIdentity, expect_first: bool,
                          large_frames: Callable[[pki.PeerIdentity], bool] | None = None) -> None:
    """Server: read the peer's Hello, then answer; client: send ours, then read theirs. A peer that stays
    silent is dropped after HELLO_TIMEOUT_S (its websocket pongs alone would keep the link open). The server
    widens the link's frames for a peer `large_frames` names before it answers."""
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            await _hello(link, own, expect_first, large_frames)
    except TimeoutError:
        await link.close()
        raise LinkError(f"{link.address} said no Hello within {HELLO_TIMEOUT_S:.0f} s") from None


async def _hello(link: Link, own: pki.PeerIdentity, expect_first: bool,
                 large_frames: Callable[[pki.PeerIdentity], bool] | None) -> None:
    ours = Hello(PROTOCOL_VERSION, own.agent_id, SOFTWARE_VERSION, own.role)
    if not expect_first:
        await link.send(ours)
    try:
        frame = await link._receive_frame()
    except LinkError as error:
        # a peer of another version that closed at our Hello: its close reason says its protocol (any version
        # since the first writes it so), which `fleet ls` shows, and which side to upgrade
        refused = _VERSION_REFUSAL.search(error.closed_because or "")
        if refused is None:
            raise
        raise _version_error(link, own, int(refused["protocol"]), refused["software"]) from None
    # A peer of another version is told apart before decoding: the codec refuses every frame of another version,
    # its Hello (or its refusal of ours) too, and that read as "sent a malformed message" on both ends.
    peeked = peek_version(frame)
    if peeked is not None and peeked[0] != PROTOCOL_VERSION:
        if expect_first:  # our Hello first, though the peer cannot decode it: it peeks our protocol and software
            with contextlib.suppress(LinkError):
                await link.send(ours)
        await _refuse_version(link, own, *peeked)
    message = await link._decode(frame)
    if isinstance(message, Error):
        await link.close()
        raise LinkError(f"{link.address} refused us: {message.code.value}: {message.message}")
    if not isinstance(message, Hello):
        await link.refuse(ErrorCode.UNAUTHORIZED, f"the first message must be Hello, got {type(message).__name__}")
        raise LinkError(f"{link.address} spoke before saying Hello ({type(message).__name__})")
    if message.protocol_version != PROTOCOL_VERSION:
        await _refuse_version(link, own, message.protocol_version, message.software_version)
    software = message.software_version
    link.peer_software = software[:40] if software.isprintable() else None  # shown in `fleet ls`'s table
    if message.agent_id != link.peer.agent_id or message.role is not link.peer.role:
        await link.refuse(ErrorCode.UNAUTHORIZED, "Hello does not match the certificate")
        raise HelloMismatch(f"{link.address} said Hello as {message.role.value} {message.agent_id[:12]}, but its "
                            f"certificate is {link.peer.role.value} {link.peer.agent_id[:12]}")
    if expect_first:
        if large_frames is not None and large_frames(link.peer):
            link.take_large_frames()
        await link.send(ours)


async def _refuse_version(link: Link, own: pki.PeerIdentity, theirs: int, their_software: str | None) -> NoReturn:
    """Close a link whose peer speaks protocol `theirs`, and raise LinkVersionError saying which side to upgrade.
    The peer is told in the close reason, which a peer of any version can read (an Error frame of this version
    is one its codec refuses)."""
    where = "your PC" if theirs < PROTOCOL_VERSION else f"the {own.role.value} {own.agent_id[:12]}"
    reason = (f"{own.role.value} speaks protocol {PROTOCOL_VERSION} (deskfleet {SOFTWARE_VERSION[:16]}), "
              f"you {theirs}: upgrade deskfleet on {where}")
    await link.connection.close(1008, _close_reason(reason))
    raise _version_error(link, own, theirs, their_software)


def _version_error(link: Link, own: pki.PeerIdentity, theirs: int, their_software: str | None) -> LinkVersionError:
    """The error of a link whose peer speaks protocol `theirs` (deskfleet `their_software`, where known)."""
    peer = f"{link.peer.role.value} {link.peer.agent_id[:12]}"
    software = f"deskfleet {their_software}" if their_software else "another deskfleet version"
    upgrade = f"upgrade deskfleet on {peer}" if theirs < PROTOCOL_VERSION else \
        f"upgrade deskfleet on this {own.role.value} to the {peer}'s version"
    return LinkVersionError(f"{peer} at {link.address} speaks fleet protocol {theirs} ({software}), this "
                            f"{own.role.value} {PROTOCOL_VERSION} (deskfleet {SOFTWARE_VERSION}): {upgrade} (the "
                            "controller and every agent must speak one protocol)", theirs, their_software,
                            link.peer.agent_id)


# The close reason of a peer that refused our Hello's protocol (_refuse_version's, in every version so far):
# "agent speaks protocol 7 (deskfleet 0.1.0), you 8: upgrade deskfleet on ..."
_VERSION_REFUSAL = re.compile(r"\b(?:agent|controller) speaks protocol (?P<protocol>\d{1,9}) \(deskfleet "
                              r"(?P<software>[^()\s]{1,40})\), you \d{1,9}: upgrade deskfleet on ")


def _remote_host(connection: Connection) -> str:
    """Who the peer is, for the per-host join limit: an IPv6 one by its /64 (tls_gate.host_key)."""
    return host_key(connection.remote_address, ipv6_prefix=64)


def _remote(connection: Connection) -> str:
    return address_text(connection.remote_address)


def _uri_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_X509_HOSTNAME_MISMATCH = 62  # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH: a certificate of the CA, for another name


def _connect_failure(error: BaseException) -> str:
    """Why a link could not open, never blank: a listener that drops the connection mid-handshake (not a fleet
    member: another service on the port) raised ConnectionResetError with no text, and `fleet ls` said only
    "cannot reach ADDRESS: "."""
    text = str(error) or type(error).__name__
    if isinstance(error, ssl.SSLCertVerificationError) and error.verify_code == _X509_HOSTNAME_MISMATCH:
        # signed by the fleet CA, for another agent id: the address is another member's now (DHCP gave it away)
        return f"{text}: the PC listening there is another member of this fleet, not the one dialled (the " \
               "address moved to another PC?)"
    if isinstance(error, ssl.SSLCertVerificationError):  # an agent of a fleet made anew retried with this alone
        return f"{text}: its certificate is not signed by this PC's fleet CA: it belongs to another fleet, or the " \
               "fleet was made anew (`deskfleet fleet init --force`), after which every PC must join again with a " \
               "new token"
    if isinstance(error, ConnectionRefusedError):  # the PC answered: it is on, but nothing listens at the port
        return f"{text}: the PC is on but nothing listens at that port (the agent or `fleet serve` is not running, " \
               "or listens at another port)"
    if isinstance(error, TimeoutError):  # no answer at all: a TCP connect that was never answered reads the same
        return f"{text}: no answer (the PC is off or asleep, a firewall drops the port, or what listens there is " \
               "no deskfleet agent or controller)"
    if isinstance(error, (ConnectionResetError, ssl.SSLEOFError)):
        return f"{text}: it closed the connection while the link was opening (is a deskfleet agent or controller " \
               "listening there, or another service?)"
    return text


__all__ = ["PING_INTERVAL_S", "PING_TIMEOUT_S", "Link", "LinkError", "LinkVersionError", "Role", "TlsFiles",
           "open_link", "peer_identity", "start_server", "utc_now", "why_closed"]
