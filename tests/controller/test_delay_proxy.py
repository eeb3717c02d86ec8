"""The benchmark's WAN: a TCP proxy that delays each direction, bounded, with an optional bandwidth."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest

from deskfleet.controller.bench.delay_proxy import DelayProxy, ProxyThread


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(proxy: DelayProxy, payload: bytes) -> tuple[bytes, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    received = await reader.readexactly(len(payload))
    elapsed = time.monotonic() - started
    writer.close()
    return received, elapsed


def test_each_direction_is_delayed_and_bytes_arrive_intact() -> None:
    async def scenario() -> list[tuple[bytes, float]]:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        proxy = DelayProxy(f"127.0.0.1:{port}", delay_s=0.05)
        proxy.bind()
        results = []
        async with server, asyncio.TaskGroup() as group:
            serving = group.create_task(proxy.serve())
            results.append(await _round_trip(proxy, b"x"))
            payload = os.urandom(3 << 20)  # many chunks: the bounded buffer pushes back, order holds
            results.append(await _round_trip(proxy, payload))
            results.append((payload, 0.0))
            proxy.delay_s, proxy.bandwidth_bytes_s = 0.0, 10e6  # 1 MB at 10 MB/s: >= 0.1 s each way
            results.append(await _round_trip(proxy, payload[: 1 << 20]))
            serving.cancel()
        return results

    (small, small_s), (big, big_s), (payload, _), (limited, limited_s) = asyncio.run(scenario())
    assert small == b"x" and 0.1 <= small_s < 0.5  # two one-way delays
    assert big == payload and big_s >= 0.1
    assert limited == payload[: 1 << 20] and limited_s >= 0.1


def test_a_delay_or_bandwidth_no_link_can_have_is_refused_also_when_changed() -> None:
    for delay, bandwidth in ((math.nan, None), (math.inf, None), (-1.0, None), (1e6, None), (0.1, 0.0),
                             (0.1, -5.0), (0.1, math.nan), (0.1, math.inf), (0.1, 1e-300)):
        with pytest.raises(ValueError):
            DelayProxy("127.0.0.1:9", delay, bandwidth)
    with ProxyThread([DelayProxy("127.0.0.1:9", 0.01)]) as proxies:
        with pytest.raises(ValueError, match="delay must be from 0 to 10 s, got nan"):
            proxies.set_delay(math.nan)  # delivered everything at once: the wait compared false
        assert proxies.proxies[0].delay_s == 0.01
