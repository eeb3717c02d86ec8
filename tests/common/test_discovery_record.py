"""AgentRecord TXT encoding: round trip, coarse memory, hostile records rejected with the key named."""

from __future__ import annotations

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import (
    MEMORY_STEP_BYTES,
    SERVICE_TYPE,
    AgentRecord,
    RecordError,
    agent_id_of_instance,
    instance_name,
)

AGENT = "a" * 52


def record(**overrides: object) -> AgentRecord:
    fields: dict[str, object] = dict(agent_id=AGENT, fleet_id="0123456789abcdef", version="0.1.0",
                                     devices=("CPU", "GPU.0"), free_memory_bytes=5 * MEMORY_STEP_BYTES + 7,
                                     state=AgentState.AVAILABLE)
    fields.update(overrides)
    return AgentRecord(**fields)  # type: ignore[arg-type]


def test_round_trip_through_zeroconf_style_bytes() -> None:
    original = record()
    as_bytes = {key.encode(): value.encode() for key, value in original.to_txt().items()}
    assert AgentRecord.from_txt(as_bytes) == original
    assert AgentRecord.from_txt(original.to_txt()) == original


def test_coarse_rounds_memory_down() -> None:
    assert record().coarse().free_memory_bytes == 5 * MEMORY_STEP_BYTES
    assert record().coarse().coarse() == record().coarse()


def test_instance_names() -> None:
    assert instance_name(AGENT) == f"{AGENT}.{SERVICE_TYPE}" == record().instance_name
    assert agent_id_of_instance(instance_name(AGENT)) == AGENT
    assert agent_id_of_instance(f"printer.{SERVICE_TYPE}") is None
    assert agent_id_of_instance(f"{AGENT}._http._tcp.local.") is None


@pytest.mark.parametrize(("change", "key"), [
    ({"id": "nope"}, "id"), ({"fleet": "XYZ"}, "fleet"), ({"mem": "-1"}, "mem"), ({"mem": "lots"}, "mem"),
    ({"state": "sleeping"}, "state"), ({"proto": "v1"}, "proto"), ({"dev": "CPU,<script>"}, "dev"),
    ({"ver": ""}, "ver"),
])
def test_bad_values_name_the_key(change: dict[str, str], key: str) -> None:
    txt = {**record().to_txt(), **change}
    with pytest.raises(RecordError, match=repr(key)):
        AgentRecord.from_txt(txt)


def test_missing_key_and_non_ascii_and_valueless() -> None:
    txt = record().to_txt()
    del txt["state"]
    with pytest.raises(RecordError, match="'state' is missing"):
        AgentRecord.from_txt(txt)
    raw: dict[bytes, bytes | None] = {key.encode(): value.encode() for key, value in record().to_txt().items()}
    with pytest.raises(RecordError, match="'ver' is missing"):  # a required key given as a flag, with no value
        AgentRecord.from_txt({**raw, b"ver": None})
    # a flag of a later version (RFC 6763 6.4 allows keys with no value) does not cost the record: it was refused
    assert AgentRecord.from_txt({**raw, b"gpu-busy": None}) == record()
    with pytest.raises(RecordError, match="TXT key 'ver' is not ASCII"):  # named as text: it said "b'ver'"
        AgentRecord.from_txt({**raw, b"ver": "é".encode()})
