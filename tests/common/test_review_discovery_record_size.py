"""AgentRecord.to_txt always fits mDNS: one TXT string ("key=value") holds at most 255 bytes, and zeroconf
refuses the whole registration for a longer one, so an agent with many devices (or long device names) was
not discoverable at all. Devices beyond what fits are summarized by their kinds, which the controller's
parser (AgentRecord.from_txt) reads back like any device list."""

from __future__ import annotations

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import (
    MAX_ADVERTISED_MEMORY_BYTES,
    MAX_PROTOCOL_VERSION,
    SERVICE_TYPE,
    TXT_RECORD_MAX_BYTES,
    TXT_STRING_MAX_BYTES,
    AgentRecord,
    RecordError,
    advertised_devices,
)

AGENT = "a" * 52
GPUS = tuple(f"GPU.{index}" for index in range(60))  # 60 names: 349 bytes as "dev=GPU.0,GPU.1,..."
LONGEST = tuple(f"{chr(ord('A') + index)}{'X' * 31}" for index in range(20))  # 20 kinds of 32 characters


def record(devices: tuple[str, ...] = ("CPU", "GPU.0"), **overrides: object) -> AgentRecord:
    fields: dict[str, object] = dict(agent_id=AGENT, fleet_id="0123456789abcdef", version="0.1.0",
                                     devices=devices, free_memory_bytes=5 << 30, state=AgentState.AVAILABLE)
    fields.update(overrides)
    return AgentRecord(**fields)  # type: ignore[arg-type]


def wire(txt: dict[str, str]) -> bytes:
    """The TXT record's bytes (a length byte, then "key=value", per string); ValueError past 255, as zeroconf."""
    return b"".join(bytes((len(item),)) + item for item in (f"{key}={value}".encode() for key, value in txt.items()))


def strings(txt: dict[str, str]) -> list[int]:
    return [len(f"{key}={value}".encode()) for key, value in txt.items()]


def test_a_record_that_fits_is_sent_whole() -> None:
    original = record(("CPU", "GPU.0", "NPU"))
    assert advertised_devices(original.devices) == original.devices
    assert AgentRecord.from_txt(original.to_txt()) == original


def test_device_names_beyond_what_fits_are_summarized_by_kind_and_parse_back() -> None:
    devices = (*GPUS, "NPU", "CPU")
    txt = record(devices).to_txt()
    assert max(strings(txt)) <= TXT_STRING_MAX_BYTES
    parsed = AgentRecord.from_txt({key.encode(): value.encode() for key, value in txt.items()})
    kept = parsed.devices[:-3]
    assert kept == GPUS[:len(kept)] and len(kept) >= 30  # as many names as fit, in order
    assert parsed.devices[-3:] == ("GPU", "NPU", "CPU")  # then every kind of the rest: more GPUs, an NPU, a CPU
    assert len("dev=" + ",".join((*GPUS[:len(kept) + 1], "GPU", "NPU", "CPU"))) > TXT_STRING_MAX_BYTES  # no more fit
    assert (parsed.agent_id, parsed.fleet_id, parsed.state) == (AGENT, "0123456789abcdef", AgentState.AVAILABLE)


def test_a_kind_is_not_repeated_when_listed_by_that_very_name() -> None:
    devices = ("GPU", *GPUS)
    summary = advertised_devices(devices)
    assert summary[0] == "GPU" and summary.count("GPU") == 1 and summary[1:] == GPUS[:len(summary) - 1]


def test_when_even_the_kinds_do_not_fit_the_first_kinds_that_do_are_sent() -> None:
    summary = advertised_devices(LONGEST)
    assert summary == LONGEST[:7]  # 7 names of 32 characters and their commas: 4 + 7 * 33 - 1 = 234 bytes
    assert AgentRecord.from_txt(record(LONGEST).to_txt()).devices == LONGEST[:7]


def test_the_worst_record_fits_each_string_and_the_total_limit() -> None:
    worst = record(LONGEST * 5, version="v" * 40, free_memory_bytes=10 ** 300, state=AgentState.UNAVAILABLE,
                   protocol_version=MAX_PROTOCOL_VERSION)
    txt = worst.to_txt()
    assert max(strings(txt)) <= TXT_STRING_MAX_BYTES
    assert len(wire(txt)) <= TXT_RECORD_MAX_BYTES
    parsed = AgentRecord.from_txt(txt)
    assert parsed.free_memory_bytes == MAX_ADVERTISED_MEMORY_BYTES  # capped (19 digits), not refused
    assert parsed.version == "v" * 40 and parsed.protocol_version == MAX_PROTOCOL_VERSION


@pytest.mark.parametrize("protocol_version", [-1, MAX_PROTOCOL_VERSION + 1])
def test_a_protocol_version_out_of_range_is_refused_naming_proto(protocol_version: int) -> None:
    with pytest.raises(RecordError, match="'proto'"):
        record(protocol_version=protocol_version)
    with pytest.raises(RecordError, match="'proto'"):
        AgentRecord.from_txt({**record().to_txt(), "proto": str(MAX_PROTOCOL_VERSION + 1)})


def test_zeroconf_takes_the_summarized_record_and_gives_it_back() -> None:
    zeroconf = pytest.importorskip("zeroconf")
    devices = (*GPUS, "NPU", "CPU")
    name = f"{AGENT}.{SERVICE_TYPE}"
    with pytest.raises(ValueError):  # what happened before: zeroconf refuses a string over 255 bytes
        zeroconf.ServiceInfo(SERVICE_TYPE, name, port=1, properties={**record().to_txt(), "dev": ",".join(devices)})
    original = record(devices)
    info = zeroconf.ServiceInfo(SERVICE_TYPE, name, port=1, properties=original.to_txt())
    assert info.text == wire(original.to_txt()) and len(info.text) <= TXT_RECORD_MAX_BYTES
    received = zeroconf.ServiceInfo(SERVICE_TYPE, name, port=1, properties=info.text)  # decoded from the wire
    assert AgentRecord.from_txt(received.properties) == record(advertised_devices(devices))
