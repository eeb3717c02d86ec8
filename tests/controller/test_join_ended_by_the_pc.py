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
from deskfleet.controller import fleet_ca
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
                                                       monkeypatch: pytest.MonkeyPatch, reason: str) -> None:
    monkeypatch.setattr(fleet_ca, "_join_ends_said", fleet_ca.LogEvery())
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


def test_a_stranger_s_close_reason_forges_no_log_line_and_is_a_warning_once_a_minute(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # the joining side has no certificate: anyone on the LAN could write lines into the controller's log, at will
    monkeypatch.setattr(fleet_ca, "_join_ends_said", fleet_ca.LogEvery())
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    with caplog.at_level(logging.DEBUG, logger="deskfleet.controller.fleet_ca"):
        for _ in range(3):
            asyncio.run(serve_enrollment(ClosingPc("ok\n2026-12-05 INFO forged line"), store))  # type: ignore[arg-type]
    ended = [record for record in caplog.records if "ended by the joining PC" in record.getMessage()]
    assert [record.levelno for record in ended] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert ended[0].getMessage().endswith(": ok?2026-12-05 INFO forged line")
