"""A speed cache that holds valid JSON but no plausible speed is measured over, never reported."""

from __future__ import annotations

from pathlib import Path

import openvino as ov
import pytest

from deskfleet.agent.speed_probe import CACHE_NAME, SpeedMeasurement, cached_speed
from deskfleet.common.agent_state import AgentState
from deskfleet.common.wire_messages import StatusReport


@pytest.mark.parametrize("speed", ["Infinity", "1e300", "100000", "true", "NaN", "-3", '"12"'])
def test_an_implausible_cached_speed_is_measured_again(tmp_path: Path, speed: str) -> None:
    (tmp_path / CACHE_NAME).write_text(
        f'{{"device": "CPU", "version": "{ov.get_version()}", "weight_gb_per_s": {speed}, "seconds_per_call": 0.01}}')
    fresh = SpeedMeasurement("CPU", ov.get_version(), 12.5, 0.005)
    measured = cached_speed(tmp_path, "CPU", lambda device: fresh)
    assert measured == fresh
    StatusReport(state=AgentState.AVAILABLE, free_memory_bytes=1, cpu_load=0.0, battery_percent=None,
                 on_ac_power=None, temperature_c=None, igpu_busy=None, stages=(), last_error=None,
                 weight_gb_per_s=measured.weight_gb_per_s)  # what the agent reports at every status
    assert cached_speed(tmp_path, "CPU", lambda device: pytest.fail("measured twice")) == fresh


def test_a_deeply_nested_cache_is_measured_over(tmp_path: Path) -> None:
    (tmp_path / CACHE_NAME).write_text("[" * 100_000 + "]" * 100_000)
    fresh = SpeedMeasurement("CPU", ov.get_version(), 12.5, 0.005)
    assert cached_speed(tmp_path, "CPU", lambda device: fresh) == fresh
