"""AgentService's mDNS advertisement: the record it builds from the settings and the status, and a status
that fails once. The Advertiser is a fake: nothing is sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.paths import AgentSettings
from deskfleet.agent.service import AgentService
from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import AgentRecord
from deskfleet.common.wire import ProtocolError, StatusReport

AGENT = "a" * 52


@dataclass
class FakeCore:
    failures: dict[int, Exception] = field(default_factory=dict)  # raised by the status() call of that number
    agent_id: str = AGENT
    calls: int = 0

    async def status(self) -> StatusReport:
        self.calls += 1
        if self.calls - 1 in self.failures:
            raise self.failures[self.calls - 1]
        return StatusReport(AgentState.AVAILABLE, 1 << 30, 0.1, None, None, None, None, (), None)


class FakeAdvertiser:
    records: ClassVar[list[AgentRecord]] = []

    def __init__(self, record: AgentRecord, port: int, addresses: Any) -> None:
        self.records.append(record)

    async def __aenter__(self) -> FakeAdvertiser:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def update(self, record: AgentRecord) -> bool:
        self.records.append(record)
        return True


def advertised(device: str, failures: dict[int, Exception], monkeypatch: pytest.MonkeyPatch) -> list[AgentRecord]:
    """The records a service with `device` advertises, first and refreshed, until it has five."""
    monkeypatch.setattr(service_module, "Advertiser", FakeAdvertiser)
    monkeypatch.setattr(service_module, "ADVERTISE_REFRESH_S", 0.0)
    FakeAdvertiser.records = []
    service = AgentService.__new__(AgentService)
    service.settings = AgentSettings(device=device)
    service.core = FakeCore(failures)  # type: ignore[assignment]
    service.membership = SimpleNamespace(fleet_id="0123456789abcdef")  # type: ignore[assignment]
    service.bound_port = 7431

    async def scenario() -> None:
        task = asyncio.create_task(service._advertise_forever("10.99.0.1"))
        for _ in range(200):
            await asyncio.sleep(0)
            if len(FakeAdvertiser.records) >= 5 or task.done():
                break
        assert not task.done(), task.exception() if task.done() else None
        task.cancel()

    asyncio.run(scenario())
    return FakeAdvertiser.records


def test_a_virtual_device_is_advertised_as_its_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    records = advertised("AUTO:GPU,CPU", {}, monkeypatch)
    assert len(records) >= 5 and {record.devices for record in records} == {("GPU", "CPU")}
    assert AgentRecord.from_txt(records[0].to_txt()) == records[0]


def test_a_status_that_fails_is_tried_again_at_the_next_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    denied = PermissionError(13, "Permission denied")
    failures: dict[int, Exception] = {0: denied, 1: ProtocolError("battery_percent 100.4"), 3: denied,
                                      4: ProtocolError("weight_gb_per_s")}
    records = advertised("GPU.1", failures, monkeypatch)
    assert len(records) >= 5 and {record.devices for record in records} == {("GPU.1",)}
