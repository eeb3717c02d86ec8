"""The speed probe measures weight throughput and caches it per device and OpenVINO version."""

from __future__ import annotations

import json
from pathlib import Path

import openvino as ov
import pytest

from deskfleet.agent.speed_probe import CACHE_NAME, SpeedMeasurement, cached_speed, measure_speed


def test_measures_a_positive_rate() -> None:
    measured = measure_speed("CPU", weight_bytes=4 << 20, calls=3)
    assert measured.weight_gb_per_s > 0 and measured.seconds_per_call > 0
    assert measured.device == "CPU"


def test_injected_clock_gives_the_rate() -> None:
    ticks = iter(range(1000))
    measured = measure_speed("CPU", weight_bytes=8 << 20, calls=3, clock=lambda: float(next(ticks)) * 0.01)
    # every call takes exactly one tick of 10 ms: 8 MiB of f16 weights per 10 ms
    assert abs(measured.seconds_per_call - 0.01) < 1e-12
    assert abs(measured.weight_gb_per_s - (8 << 20) / 0.01 / 1e9) < 1e-6


def test_cache_is_used_and_a_bad_cache_is_remeasured(tmp_path: Path) -> None:
    calls: list[str] = []

    def fake(device: str) -> SpeedMeasurement:
        calls.append(device)
        return SpeedMeasurement(device, ov.get_version(), 12.5, 0.001)

    assert cached_speed(tmp_path, "CPU", fake).weight_gb_per_s == 12.5
    assert cached_speed(tmp_path, "CPU", fake).weight_gb_per_s == 12.5
    assert calls == ["CPU"]
    cached_speed(tmp_path, "GPU", fake)  # another device: measured again
    assert calls == ["CPU", "GPU"]
    (tmp_path / CACHE_NAME).write_text("{not json")
    cached_speed(tmp_path, "GPU", fake)
    assert calls == ["CPU", "GPU", "GPU"]
    assert json.loads((tmp_path / CACHE_NAME).read_text())["device"] == "GPU"


def test_a_measurement_that_cannot_be_cached_still_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A read-only state folder threw a good measurement away for the whole run (the PC then planned as slowest).
    from deskfleet.agent import speed_probe

    def read_only(path: Path, data: bytes) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(speed_probe, "write_atomic", read_only)
    measured = SpeedMeasurement("CPU", ov.get_version(), 12.5, 0.001)
    assert cached_speed(tmp_path, "CPU", lambda device: measured) == measured


def test_other_hardware_under_the_same_state_folder_is_measured_again(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A memory upgrade (the rate follows memory bandwidth), or a state folder copied to another PC with an
    # image, kept the old figure for good
    from deskfleet.agent import speed_probe

    calls: list[float] = []

    def fake(device: str) -> SpeedMeasurement:
        calls.append(12.5 * (len(calls) + 1))
        return SpeedMeasurement(device, ov.get_version(), calls[-1], 0.001)

    monkeypatch.setattr(speed_probe, "hardware_fingerprint", lambda: "cpu X | 8 cores | 16 GiB")
    assert cached_speed(tmp_path, "CPU", fake).weight_gb_per_s == 12.5
    assert cached_speed(tmp_path, "CPU", fake).weight_gb_per_s == 12.5
    monkeypatch.setattr(speed_probe, "hardware_fingerprint", lambda: "cpu X | 8 cores | 32 GiB")
    assert cached_speed(tmp_path, "CPU", fake).weight_gb_per_s == 25.0
    assert json.loads((tmp_path / CACHE_NAME).read_text())["hardware"] == "cpu X | 8 cores | 32 GiB"
    assert "cores" in speed_probe.hardware_fingerprint() and "GiB" in speed_probe.hardware_fingerprint()
