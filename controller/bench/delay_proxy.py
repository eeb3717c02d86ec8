"""A userspace WAN for tests and benchmarks: TCP proxies that add a one-way delay to every hop.

Put one `DelayProxy` in front of each agent's listen port and dial the proxy instead of the agent (TLS
runs end to end through it: the proxy sees only ciphertext, and the agent id is still pinned by the
certificate). Every byte is delivered `delay_s` after it arrived, in each direction, so a daisy-chain
step controller -> stage 0 -> ... -> stage n-1 -> controller pays (n+1) delays: the hops into each
agent pass its proxy forwards, and the last agent's results come back through its proxy in reverse.
An optional bandwidth (bytes/s per direction and connection) serialises bytes like a link would.

Bounded: each direction buffers at most `max_buffered_chunks` reads of up to CHUNK_BYTES; when full the
proxy stops reading, and TCP flow control pushes back on the sender. Every task is owned by a TaskGroup.
Not for production: it exists to measure what latency does to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deskfleet.common import event_loop
from deskfleet.common.wire import parse_address

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
MAX_DELAY_S = 10.0  # one way: a WAN round trip of 20 s is past any real link (and past the chain's timeouts)
MIN_BANDWIDTH_BYTES_S = 1000.0  # 8 kbit/s: below it a step's few KB take seconds a hop (1e-300 was a hang)


def check_link(delay_s: float, bandwidth_bytes_s: float | None) -> None:
    """ValueError unless 0 <= delay_s <= MAX_DELAY_S and the bandwidth is None (no limit) or above 0, both finite:
    a NaN delay delivered at once (the wait compared false) and an infinite one never."""
    if not 0.0 <= delay_s <= MAX_DELAY_S:  # NaN fails this too
        raise ValueError(f"a hop's delay must be from 0 to {MAX_DELAY_S:g} s, got {delay_s}")
    if bandwidth_bytes_s is not None and not MIN_BANDWIDTH_BYTES_S <= bandwidth_bytes_s < math.inf:
        raise ValueError(f"a link's bandwidth must be a finite number of bytes a second, at least "
                         f"{MIN_BANDWIDTH_BYTES_S:g}, got {bandwidth_bytes_s}")


@dataclass
class DelayProxy:
    """Listens on listen_host:port (0 = any free port, see `address` once started), forwards to target."""

    target: str  # host:port
    delay_s: float = 0.0  # one way, each direction; may be changed while running
    bandwidth_bytes_s: float | None = None
    listen_host: str = "127.0.0.1"
    port: int = 0
    max_buffered_chunks: int = 256

    def __post_init__(self) -> None:
        parse_address(self.target)
        check_link(self.delay_s, self.bandwidth_bytes_s)
        self._listener: socket.socket | None = None

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def bind(self) -> None:
        """Open the listening socket now (so `address` is known before serving)."""
        listener = socket.create_server((self.listen_host, self.port), reuse_port=False)
        listener.setblocking(False)
        self.port = int(listener.getsockname()[1])
        self._listener = listener

    async def serve(self) -> None:
        """Accept and proxy connections until cancelled."""
        if self._listener is None:
            self.bind()
        listener = self._listener
        assert listener is not None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    connection, _ = await loop.sock_accept(listener)
                    group.create_task(self._proxy(connection))
        finally:
            listener.close()

    async def _proxy(self, client_socket: socket.socket) -> None:
        host, port = parse_address(self.target)
        try:
            client_reader, client_writer = await asyncio.open_connection(sock=client_socket)
            server_reader, server_writer = await asyncio.open_connection(host, port)
        except OSError as error:
            log.warning("delay proxy %s -> %s: %s", self.address, self.target, error)
            client_socket.close()
            return
        for writer in (client_writer, server_writer):
            sock = writer.get_extra_info("socket")
            # A peer that reset its connection meanwhile has had its socket closed (EBADF); raised here, that
            # would end serve()'s TaskGroup and with it every connection: the copy below sees the reset instead.
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._direction(client_reader, server_writer))
                group.create_task(self._direction(server_reader, client_writer))
        except* (OSError, ConnectionError) as errors:
            log.debug("delay proxy connection ended: %s", errors.exceptions[0])
        finally:
            for writer in (client_writer, server_writer):
                writer.close()

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, delivering each chunk delay_s after it arrived (and after the link is free)."""
        pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(self.max_buffered_chunks)

        async def receive() -> None:
            link_free = 0.0
            while data := await reader.read(CHUNK_BYTES):
                now = time.monotonic()
                if self.bandwidth_bytes_s is not None:
                    link_free = max(now, link_free) + len(data) / self.bandwidth_bytes_s
                    now = link_free
                await pending.put((now + self.delay_s, data))
            await pending.put((time.monotonic() + self.delay_s, b""))

        async def deliver() -> None:
            while True:
                due, data = await pending.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        async with asyncio.TaskGroup() as group:
            group.create_task(receive())
            group.create_task(deliver())


class ProxyThread:
    """Runs proxies on an event loop in a background thread. Use as a context manager."""

    def __init__(self, proxies: Sequence[DelayProxy]) -> None:
        self.proxies = list(proxies)
        for proxy in self.proxies:
            proxy.bind()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: event_loop.run(self._main()), name="delay-proxies", daemon=True)

    def set_delay(self, delay_s: float, bandwidth_bytes_s: float | None = None) -> None:
        """Change every proxy's delay (and bandwidth) for connections old and new."""
        check_link(delay_s, bandwidth_bytes_s)
        for proxy in self.proxies:
            proxy.delay_s = delay_s
            proxy.bandwidth_bytes_s = bandwidth_bytes_s

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        self._started.wait(10.0)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10.0)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(proxy.serve()) for proxy in self.proxies]
            await self._stop.wait()
            for task in tasks:
                task.cancel()
