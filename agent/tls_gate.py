"""A fleet port's TLS, done per connection by deskfleet rather than by the event loop's TLS server.

The event loop's TLS server (asyncio's, uvloop's) drops a refused handshake before any code of ours sees the
connection, so a refusal could not name the peer, and one host could hold any number of connections in their
handshakes (10 s each) until the process ran out of files. Here the server listens on plain TCP and each accepted
connection is:
- counted against its host's address until its websocket is open, or it closes; past MAX_OPENING_PER_HOST of one
  address, or MAX_OPENING of all, it is dropped at once;
- taken through TLS with `loop.start_tls`; a refusal is logged naming the peer's address and why
  (`tls.refusal`), a kind of refusal as a warning at most once a minute, a debug line between;
- handed to websockets only once its handshake succeeded.

A connection still counts while its websocket's opening handshake runs: at the controller's port a client without
a certificate (a joining PC) passes TLS, and could otherwise hold its connection silent for websockets' open timeout
without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import ssl
from collections import Counter
from typing import Any, ClassVar, cast

from websockets.asyncio.server import ServerConnection

from deskfleet.common import tls
from deskfleet.common.log_limit import LogEvery

log = logging.getLogger(__name__)

# A member opens a handful of links to a port at once (the controller's run, survey and server, the previous
# hops of the stages it hosts), each through its handshakes in milliseconds; every test fleet shares one
# loopback address. An address holding more than this many connections that are not open yet is refused more.
# An IPv6 peer counts by its address, not its /64 as a join does: on an IPv6 LAN the /64 is every PC of the segment
# (fe80::/64 every link-local one), so one stranger would have blocked every member's links.
MAX_OPENING_PER_HOST = 64
# And all hosts together: a host can take any address of its IPv6 /64, and each connection in its handshake holds
# ~90 KB of TLS state (uvloop; asyncio's loop ~256 KB), which the open-files limit alone bounded at ~6 GB.
MAX_OPENING = 1024
REFUSAL_LOG_EVERY_S = 60.0  # a kind of refusal, or one host's connections refused as too many, is a warning
# at most this often, a debug line between


def host_key(address: object, ipv6_prefix: int = 128) -> str:
    """Who a peer is, for a per-host limit: its IPv4 address (an IPv4-mapped IPv6 one as IPv4), an IPv6 one's network
    of `ipv6_prefix` bits (128: the address itself; a join counts by /64, as a host on an IPv6 LAN can take any
    address of its /64), or "?" when unknown. `address` is a socket's peer name, as `get_extra_info("peername")`
    gives it."""
    if not isinstance(address, (tuple, list)) or not address:
        return "?"
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])  # without a zone: fe80::1%eth0
    except ValueError:
        return str(address[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if ipv6_prefix < 128:
            return str(ipaddress.ip_network(f"{ip}/{ipv6_prefix}", strict=False))
    return str(ip)


def address_text(address: object) -> str:
    """A peer name as host:port ([host]:port for IPv6), "?" when unknown."""
    if not isinstance(address, (tuple, list)) or len(address) < 2:
        return "?"
    host, port = address[0], address[1]
    with contextlib.suppress(ValueError):  # an IPv4 peer of a socket of both families: as IPv4
        mapped = ipaddress.ip_address(str(host))
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
            host = str(mapped.ipv4_mapped)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class TlsGate:
    """One listening port's TLS: its context, the count of each host's connections that are not open yet, and
    what it has logged. `connection_class()` is the websockets connection that uses it."""

    def __init__(self, context: ssl.SSLContext, handshake_timeout_s: float, shutdown_timeout_s: float) -> None:
        self.context = context
        self.handshake_timeout_s = handshake_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.max_opening_per_host = MAX_OPENING_PER_HOST  # read as the port opens (tests lower them)
        self.max_opening = MAX_OPENING
        self.opening: Counter[str] = Counter()  # by host_key: connections accepted whose websocket is not open yet
        self.handshakes: set[asyncio.Task[None]] = set()  # TLS handshakes running (held against the collector)
        self.refusals_said = LogEvery()  # by kind of refusal
        self.busy_said = LogEvery()  # by host (None: all of them): a connection refused as one too many

    def connection_class(self) -> type[ServerConnection]:
        """The websockets connection class (serve's `create_connection`) whose connections go through this gate."""
        gate = self

        class GatedConnection(GatedServerConnection):
            _gate = gate

        return GatedConnection

    def admit(self, host: str, address: str) -> bool:
        """Count a new connection against its host; False (said once a minute a host) when the host, or all of them
        together, have too many."""
        if self.opening[host] >= self.max_opening_per_host:
            level = logging.WARNING if self.busy_said.due(host, REFUSAL_LOG_EVERY_S) else logging.DEBUG
            log.log(level, "refused a connection from %s: %d connections of %s are opening already (said once a "
                    "minute a host)", address, self.opening[host], host)
            return False
        if self.opening.total() >= self.max_opening:
            level = logging.WARNING if self.busy_said.due(None, REFUSAL_LOG_EVERY_S) else logging.DEBUG
            log.log(level, "refused a connection from %s: %d connections are opening already, from %d hosts (said "
                    "once a minute)", address, self.opening.total(), len(self.opening))
            return False
        self.opening[host] += 1
        return True

    def release(self, host: str) -> None:
        self.opening[host] -= 1
        if self.opening[host] <= 0:
            del self.opening[host]

    def refused(self, address: str, error: BaseException, took_s: float) -> None:
        """Log a handshake that failed after `took_s`: a refusal naming the peer and why; a peer that hung up or ran
        out of time at debug level only (a port scan is no refusal)."""
        said = tls.refusal(error)
        if said is not None:
            level = logging.WARNING if self.refusals_said.due(said, REFUSAL_LOG_EVERY_S) else logging.DEBUG
            log.log(level, "refused a connection from %s: %s (only this fleet's members connect)", address, said)
        elif took_s >= self.handshake_timeout_s:  # the loops abort it with a ConnectionAbortedError of their own
            log.debug("dropped a connection from %s: no TLS handshake within %.3g s", address, self.handshake_timeout_s)
        else:
            log.debug("a connection from %s closed during its TLS handshake: %r", address, error)


class GatedServerConnection(ServerConnection):
    """A websockets server connection accepted over plain TCP that goes through its gate's TLS before websockets sees
    any of it.

    Two hand-overs keep every byte in order:
    - uvloop starts reading an accepted connection after `connection_made` whatever it paused (asyncio's loop
      honours the pause), so the client's first TLS bytes can reach this protocol before `start_tls` takes the
      transport over. They are kept (`_raw`) and handed to the TLS protocol that `start_tls` put in place, by a
      callback queued before `start_tls` runs: the loop calls it before the TLS protocol's own `connection_made`
      and before reading resumes, and a TLS protocol keeps what it is given before its handshake starts.
    - What the peer sends between the handshake and websockets taking over (its upgrade request, sent right behind
      its last handshake message, which the TLS layer passes on before the awaiting code runs) is held (`_held`)
      and passed on in order.
    """

    _gate: ClassVar[TlsGate]
    MAX_RAW_BYTES: ClassVar[int] = 256 * 1024  # a ClientHello is a few KB: more before TLS began is no TLS client

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opening_host: str | None = None  # the host this connection counts against, while it does
        self._raw: list[bytes] | None = []  # what came before start_tls took the transport over; None once it has
        self._raw_bytes = 0
        self._held: list[bytes] | None = []  # what came after the handshake, before websockets took over; None then
        self._held_eof = False
        self._lost = False
        self._tcp: asyncio.Transport | None = None  # the accepted connection's own transport, under the TLS one

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's TCP transport is no asyncio.Transport subclass
        peer = transport.get_extra_info("peername")
        host = host_key(peer)
        if not self._gate.admit(host, address_text(peer)):
            self._lost = True
            transport.abort()
            return
        self._opening_host, self._tcp = host, transport
        transport.pause_reading()  # honoured by asyncio's loop, not by uvloop's (see the class's doc)
        task = self.loop.create_task(self._start_tls(transport, address_text(peer)))
        self._gate.handshakes.add(task)
        task.add_done_callback(self._gate.handshakes.discard)

    async def _start_tls(self, transport: asyncio.Transport, address: str) -> None:
        if self._lost or transport.is_closing():
            # gone before TLS began (uvloop read its EOF: a port scan's connect and close). start_tls on a closing
            # transport "succeeded" there and armed the handshake's timer, which kept the TLS state (~90 KB) for its
            # 10 s, outside the per-host cap: 3,000 connect-and-close held 92 MB
            log.debug("a connection from %s closed before its TLS handshake began", address)
            transport.abort()
            self._release()
            return
        transport.pause_reading()
        self.loop.call_soon(self._hand_raw_over, transport)  # before start_tls's own callbacks: see the class's doc
        started = self.loop.time()
        try:
            secured = await self.loop.start_tls(
                transport, self, self._gate.context, server_side=True,
                ssl_handshake_timeout=self._gate.handshake_timeout_s,
                ssl_shutdown_timeout=self._gate.shutdown_timeout_s)
        except asyncio.CancelledError:  # the loop is closing
            transport.abort()
            self._release()
            raise
        except Exception as error:  # start_tls has closed the transport
            self._gate.refused(address, error, self.loop.time() - started)
            transport.abort()
            self._release()
            return
        if secured is None or self._lost or not self.server.is_serving():
            # lost right after its handshake, or the server closed meanwhile: no handler for it
            if secured is not None:
                secured.abort()
            transport.abort()
            self._release()
            return
        held, self._held = self._held or [], None
        super().connection_made(secured)  # websockets takes over: its handler starts and runs the opening handshake
        for data in held:
            super().data_received(data)
        if self._held_eof:
            super().eof_received()

    def _hand_raw_over(self, transport: asyncio.Transport) -> None:
        """Give what the client sent before start_tls began to the TLS protocol start_tls put in place."""
        raw, self._raw = self._raw or [], None
        tls_protocol: object = transport.get_protocol()
        if tls_protocol is None:  # the transport closed meanwhile: start_tls says so
            return
        if tls_protocol is self:  # start_tls did not take the transport over at once: these bytes have nowhere to go
            if not transport.is_closing():
                log.error("dropped a connection: the event loop's start_tls did not take the transport over when it "
                          "began (%s)", type(self.loop).__module__)
                transport.abort()
            return
        for data in raw:
            if hasattr(tls_protocol, "buffer_updated"):
                while data:  # the TLS protocols of both loops read through a buffer of their own
                    buffer = memoryview(tls_protocol.get_buffer(len(data)))  # type: ignore[attr-defined]
                    size = min(len(buffer), len(data))
                    buffer[:size] = data[:size]
                    tls_protocol.buffer_updated(size)
                    data = data[size:]
            else:
                cast(asyncio.Protocol, tls_protocol).data_received(data)

    def data_received(self, data: bytes) -> None:
        if self._raw is not None:  # before TLS (uvloop): kept for the TLS protocol
            self._raw.append(data)
            self._raw_bytes += len(data)
            if self._raw_bytes > self.MAX_RAW_BYTES:
                self._lost = True
                if self._tcp is not None:
                    self._tcp.abort()
            return
        if self._held is not None:
            self._held.append(data)
            return
        super().data_received(data)

    def eof_received(self) -> None:
        if self._raw is not None:  # before TLS (uvloop): the transport closes itself, and TLS is not begun
            self._lost = True
            return
        if self._held is not None:  # after the handshake, before websockets took over: passed on in order
            self._held_eof = True
            return
        super().eof_received()

    async def handshake(self, *args: Any, **kwargs: Any) -> None:
        """websockets' opening handshake: the connection stops counting against its host once it is done."""
        try:
            await super().handshake(*args, **kwargs)
        finally:
            self._release()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._release()
        if self._held is None:  # websockets took it over
            super().connection_lost(exc)

    def _release(self) -> None:
        if self._opening_host is not None:
            self._gate.release(self._opening_host)
            self._opening_host = None
