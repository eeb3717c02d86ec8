"""The agent's mDNS advertisement over days: the PC's addresses change under it (a laptop moved from its dock
to the Wi-Fi, a new DHCP lease, a network that came up after the agent started). The address source and the
Advertiser are fakes: nothing is sent."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from zeroconf import NonUniqueNameException

from deskfleet.agent import advertise as advertise_module
from deskfleet.agent import service as service_module
from deskfleet.agent.paths import AgentSettings
from deskfleet.agent.service import AgentService
from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import AgentRecord
from deskfleet.common.wire import StatusReport

AGENT = "a" * 52


class FakeCore:
    agent_id = AGENT

    async def status(self) -> StatusReport:
        return StatusReport(AgentState.AVAILABLE, 1 << 30, 0.1, None, None, None, None, (), None)


class FakeAdvertiser:
    """Records each advertisement's addresses and whether it was closed (goodbye) before the next started."""

    events: ClassVar[list[tuple[str, tuple[str, ...]]]] = []
    fail_on: ClassVar[set[tuple[str, ...]]] = set()
    name_taken: ClassVar[int] = 0  # this many starts find the agent's name announced by another host

    def __init__(self, record: AgentRecord, port: int, addresses: Any) -> None:
        self.addresses = tuple(addresses)

    async def __aenter__(self) -> FakeAdvertiser:
        if self.addresses in self.fail_on:
            self.events.append(("failed", self.addresses))
            raise OSError(19, "No such device")
        if FakeAdvertiser.name_taken:
            FakeAdvertiser.name_taken -= 1
            self.events.append(("taken", self.addresses))
            raise NonUniqueNameException
        self.events.append(("start", self.addresses))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.events.append(("close", self.addresses))

    async def update(self, record: AgentRecord) -> bool:
        return False


def advertise_while(addresses_over_time: list[list[str]], monkeypatch: pytest.MonkeyPatch,
                    host: str = "0.0.0.0") -> list[tuple[str, tuple[str, ...]]]:
    """Run the advertisement while the PC's interface addresses go through `addresses_over_time`, one list per
    reading (the last one stays); the advertisements started and closed."""
    readings = iter(addresses_over_time)
    last: list[list[str]] = [[]]

    def interface_addresses() -> list[str]:
        last[0] = next(readings, last[0])
        return list(last[0])

    monkeypatch.setattr(service_module, "Advertiser", FakeAdvertiser)
    monkeypatch.setattr(service_module, "ADVERTISE_REFRESH_S", 0.0)
    monkeypatch.setattr(advertise_module, "interface_addresses", interface_addresses)
    FakeAdvertiser.events = []
    service = AgentService.__new__(AgentService)
    service.settings = AgentSettings()
    service.core = FakeCore()  # type: ignore[assignment]
    service.membership = SimpleNamespace(fleet_id="0123456789abcdef")  # type: ignore[assignment]
    service.bound_port = 7431

    async def scenario() -> None:
        task = asyncio.create_task(service._advertise_forever(host))
        for _ in range(20 * len(addresses_over_time) + 50):
            await asyncio.sleep(0)
            if task.done():
                break
        assert not task.done(), task.exception() if task.done() else None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    return FakeAdvertiser.events


def starts(events: list[tuple[str, tuple[str, ...]]]) -> list[tuple[str, ...]]:
    return [addresses for what, addresses in events if what == "start"]


def test_a_pc_that_moves_from_its_dock_to_the_wifi_is_advertised_at_its_new_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The addresses were read once at start: the record kept announcing the dock's address, on sockets bound to
    # it, until the agent was restarted.
    dock, wifi = ["10.1.0.5"], ["192.168.7.23"]
    events = advertise_while([dock] * 3 + [wifi] * 3, monkeypatch)
    assert starts(events) == [tuple(dock), tuple(wifi)]
    assert events.index(("close", tuple(dock))) < events.index(("start", tuple(wifi)))  # goodbye first


def test_an_agent_started_before_the_network_was_up_is_advertised_once_it_is(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A service started at boot, before DHCP answered, logged "not advertising" and never advertised.
    caplog.set_level(logging.INFO, logger=service_module.log.name)
    events = advertise_while([[]] * 5 + [["10.1.0.5"]], monkeypatch)
    assert starts(events) == [("10.1.0.5",)]
    said = [record.getMessage() for record in caplog.records if "not advertising" in record.getMessage()]
    assert said == ["not advertising over mDNS: this PC has no network address yet (link-local ones are not "
                    "announced)"]  # once, not every check


def test_a_network_without_multicast_is_tried_again_when_the_address_changes(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=service_module.log.name)
    monkeypatch.setattr(FakeAdvertiser, "fail_on", {("10.1.0.5",)})
    events = advertise_while([["10.1.0.5"]] * 6 + [["192.168.7.23"]], monkeypatch)
    assert [event for event in events if event[0] == "failed"] == [("failed", ("10.1.0.5",))]  # not every check
    assert starts(events) == [("192.168.7.23",)]
    failures = [record for record in caplog.records if "advertisement failed" in record.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.WARNING


def test_an_agent_whose_name_another_host_announces_keeps_trying_to_advertise(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # zeroconf's probe raised NonUniqueNameException, which is no OSError: the advertisement ended for good (the
    # agent's id is public, so anyone on the LAN could keep it off mDNS until a restart)
    caplog.set_level(logging.INFO, logger=service_module.log.name)
    monkeypatch.setattr(FakeAdvertiser, "name_taken", 3)
    events = advertise_while([["10.1.0.5"]], monkeypatch)
    assert [what for what, _ in events][:4] == ["taken", "taken", "taken", "start"]
    warnings = [record.getMessage() for record in caplog.records if "another host announces" in record.getMessage()]
    assert len(warnings) == 1, warnings  # said once, not at every try
