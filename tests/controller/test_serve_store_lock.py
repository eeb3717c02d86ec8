"""`fleet serve` takes the data dir's blocking file lock in a thread: a `fleet token` or `fleet remove` suspended
(Ctrl-Z) while it held the lock stalled the serve's event loop, and with it every agent's link and ping."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from deskfleet.agent.link import utc_now
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore

TICKS = 20  # turns of the loop while the lock is held; counted, not timed (a slow CI machine turns it slower)
WAIT_S = 30.0  # only a bound for a broken run


def hold_the_lock(store: FleetStore, held: threading.Event, release: threading.Event) -> None:
    with store.locked():  # the suspended command, in another process in the field
        held.set()
        release.wait(WAIT_S)


def test_a_registration_waits_for_a_held_lock_without_stalling_the_loop(tmp_path: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    server = FleetServer(store, "127.0.0.1:7430")
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=hold_the_lock, args=(store, held, release))
    holder.start()
    assert held.wait(WAIT_S)

    async def scenario() -> int:
        # A loop stalled by the lock turns no more until the holder lets go (after WAIT_S): by then the
        # registration is done. Turning TICKS times with the registration still waiting is the fix.
        recorded = asyncio.create_task(server._record("a" * 52, ("10.0.0.7:7431",)))
        ticks = 0
        while ticks < TICKS and not recorded.done():  # the loop keeps turning meanwhile (pings, other links)
            await asyncio.sleep(0.01)
            ticks += 1
        waited = ticks if not recorded.done() else 0
        release.set()
        await asyncio.wait_for(recorded, WAIT_S)
        return waited

    try:
        ticks = asyncio.run(scenario())
    finally:
        release.set()
        holder.join()
    assert ticks >= TICKS, "the loop stalled while the lock was held: the registration was recorded before it turned"
    assert store.roster()["a" * 52].addresses == ("10.0.0.7:7431",)
