"""The agent's registration over days: a controller (`fleet serve`) that is restarted or off for a while is
logged once per outage, not once per retry, and the registration that ends the outage says how long it took."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.link import LinkError, LinkVersionError
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentService
from deskfleet.common.availability import CallInWatch


class FakeLink:
    address = "10.0.0.1:7341"

    def __init__(self) -> None:
        self.connection = SimpleNamespace(transport=SimpleNamespace(get_extra_info=lambda name: ("10.0.0.7", 50000)))
        self.sent: list[object] = []

    async def send(self, message: object) -> None:
        self.sent.append(message)


class FakeCore:
    agent_id = "a" * 52

    def __init__(self) -> None:
        self.call_in = CallInWatch()

    async def serve_link(self, link: object, registration: bool = False) -> None:
        return None  # the controller went away at once


def registering_service(outcomes: list[str], monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> list[float]:
    """Run _register_forever against `outcomes` ("fail" or "ok", one per dial) until they run out; the sleeps."""
    sleeps: list[float] = []
    dials = iter(outcomes)

    async def dial(*args: object, **kwargs: object) -> FakeLink:
        outcome = next(dials, None)
        if outcome is None:
            raise asyncio.CancelledError
        if outcome == "fail":
            raise LinkError("cannot reach 10.0.0.1:7341: [Errno 111] Connect call failed")
        if outcome == "version":
            raise LinkVersionError("controller cccccccccccc at 10.0.0.1:7341 speaks fleet protocol 7 (deskfleet "
                                   "0.1.0), this agent 8 (deskfleet 0.8.0): upgrade deskfleet on controller "
                                   "cccccccccccc", 7, "0.1.0")
        return FakeLink()

    async def no_wait(delay: float) -> None:
        sleeps.append(delay)

    service = AgentService.__new__(AgentService)
    service.membership = SimpleNamespace(controller_addresses=("10.0.0.1:7341",), controller_id="c",  # type: ignore[assignment]
                                         fleet_id="0123456789abcdef", token_sha256=None)
    service.controller_search_interfaces = lambda: []  # no mDNS here: a moved controller is looked for in vain
    service.files = None  # type: ignore[assignment]
    service.paths = AgentPaths.resolve(data_dir)
    service.listen = "0.0.0.0:7431"
    service.listen_families = frozenset({4})  # listening on IPv4 alone: it registers the address it reached from
    service.bound_port = 7431
    service.core = FakeCore()  # type: ignore[assignment]
    monkeypatch.setattr(service_module, "open_link", dial)
    monkeypatch.setattr(service_module.asyncio, "sleep", no_wait)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(service._register_forever())
    return sleeps


def test_a_controller_that_is_off_is_logged_once_per_outage_not_per_retry(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    # Every retry logged "cannot register with the controller" as a warning: a controller off over a weekend
    # filled an agent's log with two lines a minute, on every PC.
    caplog.set_level(logging.DEBUG, logger=service_module.log.name)
    sleeps = registering_service(["ok"] + ["fail"] * 12 + ["ok"] + ["fail"] * 3 + ["ok"], monkeypatch, tmp_path)
    warnings = [record.getMessage() for record in caplog.records
                if record.levelno >= logging.WARNING and "cannot register" in record.getMessage()]
    assert len(warnings) == 2, warnings  # one per outage
    assert "retrying every 30 s at most" in warnings[0]
    registered = [record.getMessage() for record in caplog.records if "registered with the controller" in
                  record.getMessage()]
    assert len(registered) == 3
    assert "failed attempt" not in registered[0]
    assert "(after 12 failed attempts over " in registered[1]
    assert "(after 3 failed attempts over " in registered[2]
    quiet = [record for record in caplog.records
             if record.levelno == logging.DEBUG and "attempt" in record.getMessage()]
    assert len(quiet) == 11 + 2
    assert max(sleeps) == service_module.RETRY_MAX_S  # it still backs off, to 30 s at most


def test_a_controller_that_answers_again_but_refuses_this_pc_s_protocol_is_warned_of(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    # `fleet serve` restarted on an older release: the log said only "connection refused" (its first failure)
    # while the controller refused every attempt for minutes, the reason at debug level
    caplog.set_level(logging.DEBUG, logger=service_module.log.name)
    registering_service(["ok"] + ["fail"] * 3 + ["version"] * 4 + ["fail"] * 2 + ["ok"], monkeypatch, tmp_path)
    warnings = [record.getMessage() for record in caplog.records
                if record.levelno >= logging.WARNING and "cannot register" in record.getMessage()]
    assert len(warnings) == 2, warnings  # the first failure, then the other reason (once each in an outage)
    assert "Connect call failed" in warnings[0]
    assert warnings[1].startswith("cannot register with the controller, now for another reason (attempt 4): ")
    assert "upgrade deskfleet on controller cccccccccccc" in warnings[1]


def test_attempts_alternating_between_two_reasons_are_warned_of_once_each(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    # a moved and upgraded controller: its old address refuses the connection, its new one the protocol, in turn
    caplog.set_level(logging.DEBUG, logger=service_module.log.name)
    registering_service(["ok"] + ["fail", "version"] * 5 + ["ok"], monkeypatch, tmp_path)
    warnings = [record.getMessage() for record in caplog.records
                if record.levelno >= logging.WARNING and "cannot register" in record.getMessage()]
    assert len(warnings) == 2, warnings


def test_the_agent_does_not_log_every_link_websockets_opens_and_closes(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Every survey (`fleet ls`, a deploy, a failover) added websockets' "connection open" and "connection closed"
    # info lines to every agent's log: a `fleet ls` a minute was thousands of lines a day per PC.
    from deskfleet.agent import cli

    websockets_log = logging.getLogger("websockets")
    monkeypatch.setattr(websockets_log, "level", websockets_log.level)  # restored after the test
    caplog.set_level(logging.INFO)  # the root logger at info, as the agent's basicConfig sets it
    cli.main(["pause", "--data-dir", str(tmp_path)])  # any command: the logging is set up before it runs
    assert not websockets_log.isEnabledFor(logging.INFO)
    assert websockets_log.isEnabledFor(logging.WARNING)
