"""The agent's system monitor: CPU, memory, battery, temperatures and iGPU busy, each None when unknown.

`SystemMonitor` is the interface the agent core depends on; tests give it a fake. `HostMonitor` reads
the real machine:
- CPU load and memory: psutil, the memory under the tightest limit of the agent's control groups where that is
  less (agent/cgroup_memory.py). Battery and AC: on Linux the power_supply sysfs class (every system
  battery together; a wireless mouse's or headset's battery, scope "Device", is not the PC's), elsewhere
  psutil; None on a PC without a battery.
- Temperatures: on Linux the hwmon sysfs tree (thermal zones when hwmon has none); elsewhere
  psutil.sensors_temperatures where psutil has it. Windows exposes none without admin rights: empty.
- iGPU busy: on Linux `class/drm/card*/device/gpu_busy_percent` where the driver exposes it (amdgpu),
  otherwise the per-client engine counters that i915 and xe publish in /proc/*/fdinfo (a rate, so the
  first read after start is None), read only where a DRM card is bound to i915 or xe, and finding the
  clients among every process's file handles only every FDINFO_RESCAN_S (see DrmFdinfoSampler). On
  Windows the "GPU Engine" performance counters, read through PDH by their English names on any display
  language (agent/windows_gpu.py; a rate too: the first read is None).
A sensor that cannot be read is None (or absent from `temperatures`), never a guess; a psutil probe
that raises is logged the first time and read again at the next `read()`. CPU load and memory have no
None in a MonitorReading: unreadable, they read 0 (a load that never marks the user busy, and no free
memory for the planner to place a stage in). A battery percent is clamped to [0, 100]: psutil computes
it as 100 * energy_now / energy_full, above 100 on a battery that holds more than its rated charge.

`read()` blocks (sysfs and PDH reads): call it from a worker thread
(asyncio.to_thread), every few seconds, from one thread at a time.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import psutil

from deskfleet.agent.cgroup_memory import read_memory_limit
from deskfleet.agent.windows_gpu import PdhApi, PdhSampler, windows_pdh
from deskfleet.common.availability import (
    PLAUSIBLE_CELSIUS,
    Availability,
    AvailabilityPolicy,
    MonitorReading,
    TemperatureReading,
    decide_availability,
)

__all__ = [
    "Availability", "AvailabilityPolicy", "DrmFdinfoSampler", "HostMonitor", "HostProbes", "MonitorReading",
    "SystemMonitor", "TemperatureReading", "decide_availability", "read_drm_busy_percent",
    "read_hwmon_temperatures", "read_power_supply",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_FDINFO_DRIVERS = ("i915", "xe")
# How often DrmFdinfoSampler looks through every process's file handles for GPU clients; between, it reads the
# counters of the clients it found. Walking /proc/*/fd took 79 ms on a desktop of 378 processes and 20,000
# handles, and the agent reads its monitor every 2 s while it hosts a stage: 5% of a core, for a GPU that PC
# did not even have.
FDINFO_RESCAN_S = 30.0
# psutil measures the processor's load since its previous call: a reading taken right after another (the tray's
# status and the call-in check, both every few seconds, fall together) measured over milliseconds, and said 0% of a
# PC 54% busy. Within this long of the last sample, a reading gives that sample's load again.
MIN_CPU_WINDOW_S = 1.0


class SystemMonitor(Protocol):
    """Anything that can say how the host is doing right now."""

    def read(self) -> MonitorReading: ...


def _psutil_cpu_load() -> float:
    return min(1.0, max(0.0, psutil.cpu_percent(interval=None) / 100.0))


def _psutil_memory() -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def _psutil_battery() -> tuple[float | None, bool | None] | None:
    battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
    if battery is None:
        return None
    return float(battery.percent), battery.power_plugged


def _psutil_temperatures() -> tuple[TemperatureReading, ...]:
    sensors = getattr(psutil, "sensors_temperatures", None)
    if sensors is None:
        return ()
    found = []
    for chip, entries in sensors().items():
        for index, entry in enumerate(entries):
            found.append(TemperatureReading(f"{chip}/{entry.label or f'temp{index + 1}'}", float(entry.current)))
    return tuple(sensor for sensor in found if _plausible(sensor.celsius))


@dataclass(frozen=True)
class HostProbes:
    """The psutil calls HostMonitor makes; a test replaces the ones it needs to control."""

    cpu_load: Callable[[], float] = _psutil_cpu_load
    memory: Callable[[], tuple[int, int]] = _psutil_memory  # (free, total)
    # (percent, on AC); None: the platform's own reader (Linux: the sysfs power_supply class, else psutil)
    battery: Callable[[], tuple[float | None, bool | None] | None] | None = None
    temperatures: Callable[[], tuple[TemperatureReading, ...]] = _psutil_temperatures  # non-Linux only


@dataclass
class HostMonitor:
    """Reads the real host. `sysfs_root`/`proc_root` let a test point the Linux readers at a fake tree, and
    `pdh` the Windows one at a fake PDH (None: this Windows' own)."""

    sysfs_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")
    platform: str = sys.platform
    probes: HostProbes = field(default_factory=HostProbes)
    clock: Callable[[], float] = time.monotonic
    pdh: PdhApi | None = None
    _fdinfo: DrmFdinfoSampler | None = field(default=None, init=False)
    _gpu_counters: PdhSampler | None = field(default=None, init=False)
    _failed: set[str] = field(default_factory=set, init=False)  # probes whose failure was logged
    _cpu_load: float = field(default=0.0, init=False)  # the last sample, taken at _cpu_sampled_at (self.clock)
    _cpu_sampled_at: float = field(default=-math.inf, init=False)  # the first reading samples (since the prime)

    def __post_init__(self) -> None:
        self._probe("cpu load", self.probes.cpu_load, 0.0)  # psutil measures load since the previous call: prime it
        if self.platform.startswith("linux"):
            self._fdinfo = DrmFdinfoSampler(self.proc_root, self.clock)
        elif self.platform == "win32":
            api = self.pdh or windows_pdh()
            self._gpu_counters = PdhSampler(api) if api is not None else None

    def read(self) -> MonitorReading:
        """One reading of every sensor; a sensor that fails to read is None (logged the first time)."""
        free, total = self.memory()
        percent, on_ac = self._probe("battery", self._battery_probe(), None) or (None, None)
        if percent is not None:
            percent = min(100.0, max(0.0, percent)) if math.isfinite(percent) else None
        if (now := self.clock()) - self._cpu_sampled_at >= MIN_CPU_WINDOW_S:
            self._cpu_load, self._cpu_sampled_at = self._probe("cpu load", self.probes.cpu_load, 0.0), now
        return MonitorReading(
            cpu_load=self._cpu_load,
            memory_free_bytes=free,
            memory_total_bytes=total,
            battery_percent=percent,
            on_ac_power=on_ac,
            temperatures=self._temperatures(),
            igpu_busy=self._igpu_busy(),
        )

    def _probe(self, name: str, probe: Callable[[], _T], unknown: _T) -> _T:
        """`probe()`, or `unknown` when it raises: psutil reads files the OS may refuse, or hold nonsense."""
        try:
            return probe()
        except Exception as error:  # any failure of one sensor leaves the others readable
            if name not in self._failed:
                self._failed.add(name)
                logger.warning("cannot read the %s, reported as unknown (logged once): %s: %s", name,
                               type(error).__name__, error)
            else:
                logger.debug("cannot read the %s: %s: %s", name, type(error).__name__, error)
            return unknown

    def memory(self) -> tuple[int, int]:
        """(bytes available, total) to this agent: the machine's, or under the tightest memory limit of its control
        groups where that is less (agent/cgroup_memory.py: a service capped with systemd's MemoryMax= reported the
        whole PC's free memory, and could be given a stage it is killed for); (0, 0) when the probe fails."""
        free, total = self._probe("memory", self.probes.memory, (0, 0))
        if total and self.platform.startswith("linux"):
            limit = read_memory_limit(self.proc_root, self.sysfs_root)
            if limit is not None:
                free, total = min(free, limit.available_bytes), min(total, limit.limit_bytes)
        return free, total

    def _battery_probe(self) -> Callable[[], tuple[float | None, bool | None] | None]:
        if self.probes.battery is not None:
            return self.probes.battery
        if self.platform.startswith("linux"):
            return lambda: read_power_supply(self.sysfs_root)
        return _psutil_battery

    def _temperatures(self) -> tuple[TemperatureReading, ...]:
        if self.platform.startswith("linux"):
            return read_hwmon_temperatures(self.sysfs_root)
        try:
            return self.probes.temperatures()
        except (OSError, RuntimeError) as error:
            logger.debug("temperatures unavailable: %s", error)
            return ()

    def _igpu_busy(self) -> float | None:
        if self.platform.startswith("linux"):
            percent = read_drm_busy_percent(self.sysfs_root)
            if percent is not None:
                return percent / 100.0
            if self._fdinfo is None or not has_fdinfo_gpu(self.sysfs_root):
                return None  # no i915/xe card: no process holds one of its clients, none is looked for
            return self._fdinfo.sample()
        return self._gpu_counters.sample() if self._gpu_counters is not None else None


# Linux: hwmon and drm sysfs

def available_memory_reader(monitor: SystemMonitor) -> Callable[[], tuple[int, int] | None]:
    """What the agent's KV memory guard reads (agent/kv_memory_guard.py): (the bytes available to new allocations
    without swapping, the total the agent may use), None where unknown (a probe that failed, a total of 0), which
    refuses nothing. For a
    HostMonitor its memory probe alone: its read() also looks at the GPU's clients, and is taken one thread at a
    time (AgentCore._read_monitor), while the guard is asked from the stages' worker threads; any other monitor
    (a test's) is read whole."""
    if isinstance(monitor, HostMonitor):
        host = monitor

        def host_memory() -> tuple[int, int] | None:
            free, total = host.memory()  # a failure logged once, as read's; under a cgroup's limit where there is one
            return (free, total) if total > 0 else None
        return host_memory

    def read_whole() -> tuple[int, int] | None:
        reading = monitor.read()
        return (reading.memory_free_bytes, reading.memory_total_bytes) if reading.memory_total_bytes > 0 else None
    return read_whole


def read_hwmon_temperatures(sysfs_root: Path) -> tuple[TemperatureReading, ...]:
    """Every plausible `temp*_input` under class/hwmon (thermal zones if hwmon has none), in °C."""
    found: list[TemperatureReading] = []
    for chip in sorted((sysfs_root / "class" / "hwmon").glob("hwmon*")):
        chip_name = _read_text(chip / "name") or chip.name
        for sensor in sorted(chip.glob("temp*_input")):
            label = _read_text(sensor.with_name(sensor.name.replace("_input", "_label"))) or sensor.name[:-6]
            millidegrees = _read_int(sensor)
            if millidegrees is not None and _plausible(millidegrees / 1000.0):
                found.append(TemperatureReading(f"{chip_name}/{label}", millidegrees / 1000.0))
    if found:
        return tuple(found)
    for zone in sorted((sysfs_root / "class" / "thermal").glob("thermal_zone*")):
        millidegrees = _read_int(zone / "temp")
        if millidegrees is not None and _plausible(millidegrees / 1000.0):
            found.append(TemperatureReading(_read_text(zone / "type") or zone.name, millidegrees / 1000.0))
    return tuple(found)


def read_power_supply(sysfs_root: Path) -> tuple[float | None, bool | None] | None:
    """(battery percent, on AC) from `class/power_supply`, or None where the PC has no battery of its own.

    psutil reads the first supply named BAT* or *battery* and AC power from `AC`/`AC0` alone, so a desktop
    with a wireless mouse (hidpp_battery_0, discharging) read as a PC on battery, a laptop's second
    battery was ignored and an adapter named ADP1 or ACAD was unknown. Here: every battery (type
    "Battery") that is present and not a peripheral's (scope "Device") counts, weighted by its full charge
    when all report the same unit (energy_* in µWh or charge_* in µAh), else as the mean of their
    percentages (the `capacity` file where the pair is missing or full reads 0: unknown, not 0%). On AC:
    True when any mains or USB supply of the PC is online, False when those are all offline, else from
    the batteries' status (Discharging: False; Charging or Full: True), else None.
    """
    batteries: list[tuple[tuple[str, int, int] | None, int | None, str]] = []  # (unit, now, full), capacity, status
    online: list[int] = []
    for supply in sorted((sysfs_root / "class" / "power_supply").glob("*")):
        if _read_text(supply / "scope").lower() == "device":
            continue  # a mouse, keyboard, headset or game pad: not what powers the PC
        kind = _read_text(supply / "type").lower()
        if kind == "battery":
            if _read_text(supply / "present") == "0":
                continue  # an empty second bay
            pair = None
            for unit in ("energy", "charge"):
                now, full = _read_int(supply / f"{unit}_now"), _read_int(supply / f"{unit}_full")
                if now is not None and full is not None and now >= 0 and full > 0:
                    pair = (unit, now, full)
                    break
            batteries.append((pair, _read_int(supply / "capacity"), _read_text(supply / "status").lower()))
        else:
            state = _read_int(supply / "online")
            if state is not None:
                online.append(state)
    if not batteries:
        return None
    pairs = [pair for pair, _, _ in batteries]
    percent: float | None
    if all(pair is not None for pair in pairs) and len({pair[0] for pair in pairs if pair is not None}) == 1:
        percent = 100.0 * sum(pair[1] for pair in pairs if pair) / sum(pair[2] for pair in pairs if pair)
    else:
        each = []
        for pair, capacity, _ in batteries:
            if pair is not None:
                each.append(100.0 * pair[1] / pair[2])
            elif capacity is not None:
                each.append(float(capacity))
        percent = sum(each) / len(each) if each else None
    statuses = {status for _, _, status in batteries}
    on_ac: bool | None
    if any(state > 0 for state in online):
        on_ac = True
    elif online:
        on_ac = False
    elif "discharging" in statuses:
        on_ac = False
    elif statuses & {"charging", "full"}:
        on_ac = True
    else:
        on_ac = None
    return percent, on_ac


def has_fdinfo_gpu(sysfs_root: Path) -> bool:
    """Whether a `class/drm/card<N>` is bound to a driver that publishes client counters in fdinfo (i915, xe)."""
    for card in (sysfs_root / "class" / "drm").glob("card*"):
        if card.name[4:].isdigit():
            try:
                driver = os.readlink(card / "device" / "driver")
            except OSError:
                continue
            if Path(driver).name in _FDINFO_DRIVERS:
                return True
    return False


def read_drm_busy_percent(sysfs_root: Path) -> float | None:
    """The busiest `class/drm/card<N>/device/gpu_busy_percent`, or None where no driver exposes it."""
    values = []
    for card in (sysfs_root / "class" / "drm").glob("card*"):
        if not card.name[4:].isdigit():
            continue  # connectors such as card0-eDP-1
        value = _read_int(card / "device" / "gpu_busy_percent")
        if value is not None and 0 <= value <= 100:
            values.append(float(value))
    return max(values, default=None)


class DrmFdinfoSampler:
    """iGPU busy from the engine counters i915 and xe publish per DRM client in /proc/<pid>/fdinfo.

    i915 gives `drm-engine-<class>: <ns> ns` (busy time); xe gives `drm-cycles-<class>` and
    `drm-total-cycles-<class>`. `sample()` returns the busiest engine class's busy fraction since the
    previous sample, or None on the first call or when no i915/xe client is visible (a GPU nobody uses
    reads None, not 0: we cannot see it). Clients that exit between samples are not counted, so the value
    may be low, never high. Reading other users' fdinfo needs the rights to do so (root, or same user).

    Finding the clients means a readlink() of every file handle of every process; that is done at most every
    `rescan_s` (and whenever none was found), and the samples between read only the fdinfo of the handles
    found: a client that opens the GPU meanwhile is counted from the next rescan on, and its work before the
    sample that first sees it is not counted (low, never high).
    """

    def __init__(self, proc_root: Path, clock: Callable[[], float], rescan_s: float = FDINFO_RESCAN_S) -> None:
        self._proc_root = proc_root
        self._clock = clock
        self._rescan_s = rescan_s
        self._previous: tuple[float, dict[tuple[str, str], dict[str, tuple[int, int | None]]]] | None = None
        self._handles: list[Path] = []  # the fdinfo files of the DRM handles the last rescan found
        self._scanned_at: float | None = None

    def sample(self) -> float | None:
        now = self._clock()
        clients = self._read_clients()
        previous, self._previous = self._previous, (now, clients)
        if previous is None or not clients:
            return None
        then, old_clients = previous
        busy: dict[str, int] = {}
        cycles_total: dict[str, int] = {}  # xe engines: the GPU's own clock over the interval
        for key, engines in clients.items():
            old = old_clients.get(key)
            if old is None:  # first seen now: its counters hold its whole past, not this interval's work
                continue
            for engine, (value, total) in engines.items():
                old_value, old_total = old.get(engine, (0, None))
                busy[engine] = busy.get(engine, 0) + max(0, value - old_value)
                if total is not None:
                    delta = total - old_total if old_total is not None else 0
                    cycles_total[engine] = max(cycles_total.get(engine, 0), delta)
        fractions = []
        wall_ns = (now - then) * 1e9
        for engine, value in busy.items():
            if engine in cycles_total:
                if cycles_total[engine] > 0:
                    fractions.append(value / cycles_total[engine])
            elif wall_ns > 0:
                fractions.append(value / wall_ns)
        return min(1.0, max(fractions)) if fractions else None

    def _read_clients(self) -> dict[tuple[str, str], dict[str, tuple[int, int | None]]]:
        """{(pdev, client id): {engine: (busy ns or cycles, total cycles or None)}} of the known DRM handles,
        found again among every process's handles when none is known or `rescan_s` has passed."""
        now = self._clock()
        if not self._handles or self._scanned_at is None or not 0 <= now - self._scanned_at < self._rescan_s:
            self._handles, self._scanned_at = self._drm_handles(), now
        clients: dict[tuple[str, str], dict[str, tuple[int, int | None]]] = {}
        for fdinfo in self._handles:
            fields = _parse_fdinfo(_read_text(fdinfo, strip=False))  # "" once the handle or process is gone
            if fields.get("drm-driver") not in _FDINFO_DRIVERS or "drm-client-id" not in fields:
                continue  # closed, or its number reused for another file
            key = (fields.get("drm-pdev", ""), fields["drm-client-id"])
            clients[key] = _engine_counters(fields)
        return clients

    def _drm_handles(self) -> list[Path]:
        """The fdinfo files of every process's handles on /dev/dri (one readlink per handle on the PC)."""
        found: list[Path] = []
        for fd_dir in self._proc_root.glob("[0-9]*/fd"):
            try:
                fds = [entry for entry in os.scandir(fd_dir) if os.readlink(entry.path).startswith("/dev/dri/")]
            except OSError:
                continue  # the process exited, or it is not ours to read
            found.extend(fd_dir.parent / "fdinfo" / entry.name for entry in fds)
        return found


def _parse_fdinfo(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        name, separator, value = line.partition(":")
        if separator:
            fields[name.strip()] = value.strip()
    return fields


def _engine_counters(fields: dict[str, str]) -> dict[str, tuple[int, int | None]]:
    counters: dict[str, tuple[int, int | None]] = {}
    for name, value in fields.items():
        number = re.match(r"\d+", value)
        if number is None:
            continue
        if name.startswith("drm-engine-") and not name.startswith("drm-engine-capacity-"):
            counters[name[len("drm-engine-"):]] = (int(number.group()), None)
        elif name.startswith("drm-cycles-"):
            engine = name[len("drm-cycles-"):]
            total = re.match(r"\d+", fields.get(f"drm-total-cycles-{engine}", ""))
            counters[engine] = (int(number.group()), int(total.group()) if total else None)
    return counters


# Private helpers

def _plausible(celsius: float) -> bool:
    return PLAUSIBLE_CELSIUS[0] <= celsius <= PLAUSIBLE_CELSIUS[1]  # broken sensors are unknown, not hot


def _read_text(path: Path, strip: bool = True) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return text.strip() if strip else text


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    try:
        return int(text)
    except ValueError:
        if text:
            logger.debug("%s holds %r, not an integer", path, text)
        return None
