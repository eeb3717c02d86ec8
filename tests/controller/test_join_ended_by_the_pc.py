"""A join that the joining PC ends, saying why (it speaks another fleet protocol), is logged with its reason: the
controller's log said only "join client ... went away", and the admin could not tell a PC to upgrade from one
whose network dropped."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close, CloseCode

from deskfleet.agent.link import utc_now
from deskfleet.controller.fleet_ca import init_fleet, serve_enrollment
from deskfleet.controller.fleet_store import FleetStore


class ClosingPc:
    """A joining PC that closes as the offer is sent, with `reason` (empty: no reason)."""

    remote_address = ("10.0.0.7", 50000)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    async def send(self, frame: bytes) -> None:
        raise ConnectionClosed(Close(CloseCode.POLICY_VIOLATION, self.reason) if self.reason else None, None)


@pytest.mark.parametrize("reason", ["agent speaks protocol 9 (deskfleet 0.9.0), you 8: upgrade deskfleet on the "
                                    "joining agent", ""])
def test_a_join_the_pc_ended_is_logged_with_its_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       reason: str) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    with caplog.at_level(logging.INFO, logger="deskfleet.controller.fleet_ca"):
        asyncio.run(serve_enrollment(ClosingPc(reason), store))  # type: ignore[arg-type]
    (record,) = [record for record in caplog.records if "join" in record.getMessage()]
    if reason:
        assert record.levelno == logging.WARNING
        assert record.getMessage() == f"join from ('10.0.0.7', 50000) ended by the joining PC: {reason}"
    else:
        assert record.levelno == logging.INFO and record.getMessage().endswith("went away")
