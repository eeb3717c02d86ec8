"""HostMonitor over fake sysfs/proc trees, fake psutil probes and a fake Windows PDH."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import pytest

from deskfleet.agent.monitor import (
    DrmFdinfoSampler,
    HostMonitor,
    HostProbes,
    SystemMonitor,
    TemperatureReading,
    available_memory_reader,
    read_drm_busy_percent,
    read_hwmon_temperatures,
)
from deskfleet.agent.shard_cache import CacheUsage
from deskfleet.agent.status import make_status
from deskfleet.common.availability import AvailabilityPolicy, MonitorReading
from tests.fake_clock import FakeClock


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_probes(battery: tuple[float | None, bool | None] | None = (80.0, True)) -> HostProbes:
    return HostProbes(cpu_load=lambda: 0.25, memory=lambda: (3, 10), battery=lambda: battery,
                      temperatures=lambda: (TemperatureReading("psutil/x", 40.0),))


def test_hwmon_temperatures_labels_and_implausible_values(tmp_path: Path) -> None:
    chip = tmp_path / "class/hwmon/hwmon0"
    write(chip / "name", "coretemp\n")
    write(chip / "temp1_input", "45000\n")
    write(chip / "temp1_label", "Package id 0\n")
    write(chip / "temp2_input", "-128000\n")  # a broken sensor: unknown, not cold
    write(chip / "temp3_input", "garbage\n")
    write(tmp_path / "class/hwmon/hwmon1/temp1_input", "51500")  # no name file
    assert read_hwmon_temperatures(tmp_path) == (TemperatureReading("coretemp/Package id 0", 45.0),
                                                 TemperatureReading("hwmon1/temp1", 51.5))


def test_thermal_zones_only_when_hwmon_is_empty(tmp_path: Path) -> None:
    write(tmp_path / "class/thermal/thermal_zone0/temp", "60000")
    write(tmp_path / "class/thermal/thermal_zone0/type", "x86_pkg_temp")
    assert read_hwmon_temperatures(tmp_path) == (TemperatureReading("x86_pkg_temp", 60.0),)
    assert read_hwmon_temperatures(tmp_path / "missing") == ()


def test_drm_gpu_busy_percent_skips_connectors(tmp_path: Path) -> None:
    assert read_drm_busy_percent(tmp_path) is None
    write(tmp_path / "class/drm/card0/device/gpu_busy_percent", "12")
    write(tmp_path / "class/drm/card1/device/gpu_busy_percent", "40")
    write(tmp_path / "class/drm/card0-eDP-1/device/gpu_busy_percent", "99")
    assert read_drm_busy_percent(tmp_path) == 40.0


def add_client(proc: Path, pid: int, fd: int, fdinfo: str) -> None:
    (proc / str(pid) / "fd").mkdir(parents=True, exist_ok=True)
    link = proc / str(pid) / "fd" / str(fd)
    if not link.is_symlink():
        os.symlink("/dev/dri/renderD128", link)
    write(proc / str(pid) / "fdinfo" / str(fd), fdinfo)


def test_fdinfo_i915_engine_busy_rate(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    sampler = DrmFdinfoSampler(tmp_path, clock)
    assert sampler.sample() is None  # nothing visible
    (tmp_path / "77" / "fd").mkdir(parents=True)
    os.symlink("/dev/null", tmp_path / "77" / "fd" / "0")  # not a DRM fd: ignored
    client = "drm-driver:\ti915\ndrm-pdev:\t0000:00:02.0\ndrm-client-id:\t7\ndrm-engine-render:\t{r} ns\n" \
             "drm-engine-video:\t{v} ns\ndrm-engine-capacity-video:\t2\n"
    add_client(tmp_path, 10, 4, client.format(r=1_000_000_000, v=0))
    add_client(tmp_path, 10, 5, client.format(r=1_000_000_000, v=0))  # same client via a second fd
    assert sampler.sample() is None  # first sample: a rate needs two
    clock.now += 2.0
    add_client(tmp_path, 10, 4, client.format(r=1_500_000_000, v=200_000_000))
    add_client(tmp_path, 10, 5, client.format(r=1_500_000_000, v=200_000_000))
    assert sampler.sample() == 0.25  # render: 0.5 s busy of 2 s


def test_fdinfo_xe_cycles_rate(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    sampler = DrmFdinfoSampler(tmp_path, clock)
    client = "drm-driver: xe\ndrm-client-id: 3\ndrm-cycles-rcs: {c}\ndrm-total-cycles-rcs: {t}\n"
    add_client(tmp_path, 20, 3, client.format(c=100, t=1000))
    assert sampler.sample() is None
    clock.now += 1.0
    add_client(tmp_path, 20, 3, client.format(c=400, t=2000))
    assert sampler.sample() == 0.3


def test_host_monitor_on_linux_reads_the_fake_tree(tmp_path: Path) -> None:
    write(tmp_path / "sys/class/hwmon/hwmon0/temp1_input", "70000")
    write(tmp_path / "sys/class/drm/card0/device/gpu_busy_percent", "55")
    monitor: SystemMonitor = HostMonitor(sysfs_root=tmp_path / "sys", proc_root=tmp_path / "proc",
                                         platform="linux", probes=fake_probes(), clock=FakeClock(100.0))
    reading = monitor.read()
    assert (reading.cpu_load, reading.memory_free_bytes, reading.memory_total_bytes) == (0.25, 3, 10)
    assert (reading.battery_percent, reading.on_ac_power) == (80.0, True)
    assert reading.temperatures == (TemperatureReading("hwmon0/temp1", 70.0),)
    assert reading.igpu_busy == 0.55


def test_missing_sensors_are_unknown(tmp_path: Path) -> None:
    monitor = HostMonitor(sysfs_root=tmp_path, proc_root=tmp_path, platform="linux",
                          probes=fake_probes(battery=None), clock=FakeClock(100.0))
    reading = monitor.read()
    assert (reading.battery_percent, reading.on_ac_power, reading.igpu_busy) == (None, None, None)
    assert reading.temperatures == () and reading.max_temperature_c is None


def test_other_platforms_use_psutil_temperatures(tmp_path: Path) -> None:
    monitor = HostMonitor(sysfs_root=tmp_path, platform="darwin", probes=fake_probes(), clock=FakeClock(100.0))
    reading = monitor.read()
    assert reading.temperatures == (TemperatureReading("psutil/x", 40.0),) and reading.igpu_busy is None


@pytest.mark.parametrize(("percent", "shown"), [(100.4, 100.0), (-0.5, 0.0), (55.5, 55.5), (math.nan, None),
                                                (math.inf, None), (None, None)])
def test_battery_percent_is_clamped_and_reaches_the_wire(tmp_path: Path, percent: float | None,
                                                        shown: float | None) -> None:
    monitor = HostMonitor(sysfs_root=tmp_path, proc_root=tmp_path, platform="linux",
                          probes=fake_probes(battery=(percent, False)), clock=FakeClock(100.0))
    reading = monitor.read()
    assert (reading.battery_percent, reading.on_ac_power) == (shown, False)
    cache = CacheUsage(used_bytes=0, limit_bytes=1, shard_count=0, partial_count=0, pinned_bytes=0)
    assert make_status(reading, AvailabilityPolicy(), (), cache, None, 0.0, "1").to_wire().battery_percent == shown


def test_a_probe_that_raises_is_unknown_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def refused() -> tuple[int, int]:
        raise PermissionError(13, "Permission denied", "/sys/class/power_supply/BAT0/energy_now")

    probes = HostProbes(cpu_load=refused, memory=refused, battery=refused,  # type: ignore[arg-type]
                        temperatures=lambda: ())
    caplog.set_level(logging.DEBUG, logger="deskfleet.agent.monitor")
    monitor = HostMonitor(sysfs_root=tmp_path, proc_root=tmp_path, platform="linux", probes=probes,
                          clock=FakeClock(100.0))
    for _ in range(3):
        reading = monitor.read()
        assert (reading.battery_percent, reading.on_ac_power) == (None, None)
        assert (reading.cpu_load, reading.memory_free_bytes, reading.memory_total_bytes) == (0.0, 0, 0)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("Permission denied" in message for message in warnings)  # one a probe
    assert sorted(message.split(",")[0] for message in warnings) == [
        "cannot read the battery", "cannot read the cpu load", "cannot read the memory"]


def test_real_host_reading_is_plausible() -> None:
    reading = HostMonitor().read()
    assert 0.0 <= reading.cpu_load <= 1.0
    assert 0 < reading.memory_free_bytes <= reading.memory_total_bytes


def test_the_kv_memory_guard_reads_the_memory_probe_alone_and_unknown_is_none(tmp_path: Path) -> None:
    # the guard is asked from the stages' worker threads: HostMonitor.read (the GPU's clients too) is not for them
    def no_gpu_reading() -> float:
        raise AssertionError("the whole monitor was read")

    monitor = HostMonitor(sysfs_root=tmp_path, proc_root=tmp_path, platform="linux", probes=fake_probes(),
                          clock=FakeClock(100.0))
    monitor._igpu_busy = no_gpu_reading  # type: ignore[method-assign]
    assert available_memory_reader(monitor)() == (3, 10)

    def refused() -> tuple[int, int]:
        raise OSError("no /proc/meminfo")

    broken = HostMonitor(sysfs_root=tmp_path, proc_root=tmp_path, platform="linux",
                         probes=HostProbes(cpu_load=lambda: 0.0, memory=refused), clock=FakeClock(100.0))
    assert available_memory_reader(broken)() is None  # unknown: the guard refuses nothing

    class Fake:
        def __init__(self, free: int, total: int) -> None:
            self.reading = MonitorReading(0.0, free, total, None, None, (), None)

        def read(self) -> MonitorReading:
            return self.reading

    assert available_memory_reader(Fake(5, 10))() == (5, 10)
    assert available_memory_reader(Fake(0, 0))() is None


def test_a_reading_right_after_another_gives_its_load_again(tmp_path: Path) -> None:
    # psutil measures the load since its previous call: the tray's status read 2 ms after the call-in check's
    # measured over those 2 ms, and said 0% of a PC 54% busy
    loads = iter([0.0, 0.54, 0.0, 0.31])  # the prime, then what psutil would say at each call
    clock = FakeClock(100.0)
    monitor = HostMonitor(sysfs_root=tmp_path, proc_root=tmp_path, platform="linux", clock=clock,
                          probes=HostProbes(cpu_load=lambda: next(loads), memory=lambda: (3, 10), battery=lambda: None))
    assert monitor.read().cpu_load == 0.54
    clock.now += 0.002
    assert monitor.read().cpu_load == 0.54  # not psutil's 0.0 over 2 ms
    clock.now += 1.0
    assert monitor.read().cpu_load == 0.0
    clock.now += 5.0
    assert monitor.read().cpu_load == 0.31
