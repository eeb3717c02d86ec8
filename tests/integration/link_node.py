"""One end of test_link_blip.py's fleet link, run as a process inside a network namespace.

    python -m tests.integration.link_node serve TLS_DIR HOST:PORT
        serves fleet links; prints "listening", then one JSON line per message received: its text and the time
    python -m tests.integration.link_node dial TLS_DIR HOST:PORT SECONDS
        opens a link and sends a numbered message every 0.25 s for SECONDS; prints "open", then "closed: WHY" if the
        link closed under it, else "done"
TLS_DIR holds `ca.pem` and the member's `NAME.pem` / `NAME-key.pem` (tests/fleet_pki.make_member), NAME the mode.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from deskfleet.agent.link import Link, LinkError, TlsFiles, open_link, start_server
from deskfleet.common import event_loop
from deskfleet.common.wire import Error, ErrorCode, parse_address

SEND_EVERY_S = 0.25


async def serve(files: TlsFiles, address: str) -> None:
    async def handler(link: Link) -> None:
        while True:
            try:
                message = await link.receive()
            except LinkError as error:
                print(json.dumps({"closed": str(error), "t": time.time()}), flush=True)
                return
            assert isinstance(message, Error)
            print(json.dumps({"text": message.message, "t": time.time()}), flush=True)

    host, port = parse_address(address)
    async with await start_server(handler, host, port, files):
        print("listening", flush=True)
        await asyncio.Event().wait()


async def dial(files: TlsFiles, address: str, seconds: float) -> None:
    link = await open_link(address, files)
    print("open", flush=True)
    try:
        for number in range(int(seconds / SEND_EVERY_S)):
            await link.send(Error(ErrorCode.INTERNAL, f"{number} {time.time()}"))
            await asyncio.sleep(SEND_EVERY_S)
    except LinkError as error:
        print(f"closed: {error}", flush=True)
        return
    finally:
        await link.close()
    print("done", flush=True)


def main() -> None:
    mode, folder, address, *rest = sys.argv[1:]
    files = TlsFiles.in_folder(Path(folder), mode)
    event_loop.run(serve(files, address) if mode == "serve" else dial(files, address, float(rest[0])))


if __name__ == "__main__":
    main()
