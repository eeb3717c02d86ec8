"""`fleet serve` takes the data dir's blocking file lock in a thread: a `fleet token` or `fleet remove` suspended
(Ctrl-Z) while it held the lock stalled the serve's event loop, and with it every agent's link and ping."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from deskfleet.agent.link import utc_now
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore

HELD_S = 0.6


def hold_the_lock(store: FleetStore, held: threading.Event, release: threading.Event) -> None:
    with store.locked():  # the suspended command, in another process in the field
        held.set()
        release.wait(10)


def test_a_registration_waits_for_a_held_lock_without_stalling_the_loop(tmp_path: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    server = FleetServer(store, "127.0.0.1:7430")
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_the_lock, args=(store, held, release))
    holder.start()
    assert held.wait(10)

    async def scenario() -> tuple[int, float]:
        ticks = 0
        recorded = asyncio.create_task(server._record("a" * 52, ("10.0.0.7:7431",)))
        started = time.monotonic()
        while time.monotonic() - started < HELD_S:  # the loop keeps turning meanwhile (pings, other links)
            await asyncio.sleep(0.01)
            ticks += 1
        release.set()
        await asyncio.wait_for(recorded, 10)
        return ticks, time.monotonic() - started

    try:
        ticks, elapsed = asyncio.run(scenario())
    finally:
        release.set()
        holder.join()
    assert ticks >= 10, f"the loop turned {ticks} times in {elapsed:.2f} s while the lock was held"
    assert store.roster()["a" * 52].addresses == ("10.0.0.7:7431",)
