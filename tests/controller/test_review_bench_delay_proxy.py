"""The delay proxy of `bench fleet`'s WAN rows: a peer resetting its connection ends that connection only."""

from __future__ import annotations

import asyncio
import socket
import struct

from deskfleet.controller.bench.delay_proxy import DelayProxy


def reset_at_once(port: int) -> None:
    """Connect and close with an RST (SO_LINGER 0), before the proxy has dialled its target for it."""
    connection = socket.create_connection(("127.0.0.1", port))
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_a_client_resetting_its_connection_leaves_the_proxy_serving_the_others() -> None:
    async def scenario() -> None:
        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        proxy = DelayProxy(f"127.0.0.1:{target.sockets[0].getsockname()[1]}", delay_s=0.001)
        proxy.bind()
        serving = asyncio.create_task(proxy.serve())
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            for _ in range(5):
                reset_at_once(proxy.port)
                await asyncio.sleep(0.05)  # the proxy accepts it, dials the target, sees the reset
                assert not serving.done(), f"the proxy stopped: {serving.exception()!r}"
            writer.write(b"still here")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(10), 5.0) == b"still here"
            writer.close()
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            target.close()
            await target.wait_closed()

    asyncio.run(scenario())
