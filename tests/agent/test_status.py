"""AgentStatus: made from a reading and a policy, converted to the wire and to JSON and back."""

from __future__ import annotations

import json

from deskfleet.agent.shard_cache import CacheUsage
from deskfleet.agent.status import AgentStatus, make_status
from deskfleet.common.agent_state import AgentState, UnavailableReason
from deskfleet.common.availability import GIB, AvailabilityPolicy, MonitorReading, TemperatureReading
from deskfleet.common.version import software_version
from deskfleet.common.wire import StageRef, StatusReport, decode, encode

CACHE = CacheUsage(used_bytes=10, limit_bytes=100, shard_count=1, partial_count=0, pinned_bytes=10)
READING = MonitorReading(cpu_load=0.5, memory_free_bytes=1 * GIB, memory_total_bytes=8 * GIB,
                         battery_percent=77.0, on_ac_power=True,
                         temperatures=(TemperatureReading("a", 40.0), TemperatureReading("b", 61.0)),
                         igpu_busy=None)
STAGE = StageRef("tiny", 0, 2)


def test_make_status_decides_and_snapshots() -> None:
    status = make_status(READING, AvailabilityPolicy(), (STAGE,), CACHE, "boom", taken_at=5.0, version="9.9")
    assert status.state is AgentState.UNAVAILABLE  # 1 GiB free < 2 GiB
    assert status.reasons == (UnavailableReason.LOW_MEMORY,)
    assert status.stages == (STAGE,) and status.version == "9.9" and status.last_error == "boom"
    serving = make_status(READING, AvailabilityPolicy(min_free_memory_bytes=0), (STAGE,), CACHE, None, 5.0)
    assert serving.state is AgentState.SERVING and serving.version == software_version()


def test_to_wire_carries_the_hottest_sensor_and_round_trips_the_codec() -> None:
    status = make_status(READING, AvailabilityPolicy(), (STAGE,), CACHE, None, 5.0, "1")
    report = status.to_wire()
    assert report == StatusReport(state=AgentState.UNAVAILABLE, free_memory_bytes=GIB, cpu_load=0.5,
                                  battery_percent=77.0, on_ac_power=True, temperature_c=61.0, igpu_busy=None,
                                  stages=(STAGE,), last_error=None, reasons=status.reasons, detail=status.detail)
    assert report.reasons and report.detail  # the planner's "left out" line says why, with the numbers
    assert decode(encode(report)) == report


def test_dict_round_trip_through_json() -> None:
    status = make_status(READING, AvailabilityPolicy(paused=True), (STAGE,), CACHE, None, 5.0, "1")
    assert AgentStatus.from_dict(json.loads(json.dumps(status.to_dict()))) == status
