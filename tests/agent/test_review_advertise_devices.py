"""The advertiser's service info for an agent with more devices than one TXT string holds: zeroconf refused
it (ValueError: bytes must be in range(0, 256)) and the agent was never advertised; the device list is
summarized now, and what zeroconf would send parses back. Offline: no socket is opened."""

from __future__ import annotations

from deskfleet.agent.advertise import Advertiser
from deskfleet.common.discovery_record import TXT_STRING_MAX_BYTES, AgentRecord, advertised_devices
from tests.agent.test_advertise import LOOPBACK, make_record


def test_an_agent_with_many_devices_gets_a_service_info_that_parses_back() -> None:
    devices = (*(f"GPU.{index}" for index in range(60)), "NPU", "CPU")
    assert len("dev=" + ",".join(devices)) > TXT_STRING_MAX_BYTES
    record = make_record(7, devices=devices)
    info = Advertiser(record, 7431, [LOOPBACK])._service_info()
    parsed = AgentRecord.from_txt(info.properties)
    assert parsed.devices == advertised_devices(devices) and parsed.devices[-3:] == ("GPU", "NPU", "CPU")
    assert parsed.agent_id == record.agent_id and parsed.state is record.state
