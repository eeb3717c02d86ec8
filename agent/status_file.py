"""The running agent's status, published in its state folder for the tray (agent/tray.py) to show.

The agent looks at its status every STATUS_CHECK_S while it runs (service.py) and writes `status.json` when what the
tray shows of it changed (`shows_a_change`), and at least every HEARTBEAT_S: its AgentStatus, who paused it, whether
it is registered with the fleet's controller, and which process it is. The tray runs in the employee's desktop
session as the same user, reads the file, and asks the operating system whether that process still runs (a file
left by an agent that stopped or crashed is not taken for a running one, nor a reused pid for the agent). The file
only shows what is now: it is written without syncs to disk, and a damaged one is named, not trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from deskfleet.agent.status import AgentStatus, PauseSource
from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.json_file import JsonFileError, read_json_object

STATUS_FILE = "status.json"
FORMAT_VERSION = 1
STATUS_CHECK_S = 5.0  # how often the running agent looks whether the tray would show something else
# how often it is written when nothing shown changed: a laptop's disk is not woken every few seconds for the same
# numbers (ext4 commits a renamed file's data with its journal, every 5 s, synced or not), and the tray still tells
# an agent that went quiet (STALE_AFTER_S)
HEARTBEAT_S = 60.0
STALE_AFTER_S = 2 * HEARTBEAT_S + STATUS_CHECK_S  # a status older than this, from a running agent, is said to be old
GIB = 1 << 30
# How far a reading moves before the tray is told of it, in the order of _readings: load, free memory, battery,
# hottest sensor, iGPU, the cache's size (the menu shows them rounded; between, it may be this far behind)
READING_STEPS = (0.05, 0.25 * GIB, 2.0, 3.0, 0.05, 0.25 * GIB)
# how far apart the agent's recorded start and the start the OS gives for its pid may be (both come from the OS's
# process table, rounded differently) and still be the same process
SAME_PROCESS_START_S = 1.0


class StatusFileError(ValueError):
    """The status file exists but cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class PublishedStatus:
    """What the agent process `pid` (started at `process_started_at`, epoch seconds) published."""

    status: AgentStatus
    agent_id: str
    pid: int
    process_started_at: float
    paused_by: PauseSource | None  # None: not paused
    controller_connected: bool  # registered on a live link to `fleet serve` now
    releases_after_s: float | None = None  # on battery or too hot so long, a serving PC gives its part up; None: never

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "status": self.status.to_dict(), "agent_id": self.agent_id,
                "pid": self.pid, "process_started_at": self.process_started_at,
                "paused_by": None if self.paused_by is None else self.paused_by.value,
                "controller_connected": self.controller_connected, "releases_after_s": self.releases_after_s}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> PublishedStatus:
        """Inverse of `to_dict`; KeyError / TypeError / ValueError on a malformed body."""
        pid, started = body["pid"], body["process_started_at"]
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"'pid' must be a process id, got {pid!r:.40}")
        if isinstance(started, bool) or not isinstance(started, int | float) or not math.isfinite(started):
            raise ValueError(f"'process_started_at' must be a time, got {started!r:.40}")
        agent_id, connected, paused_by = body["agent_id"], body["controller_connected"], body["paused_by"]
        if not isinstance(agent_id, str) or not isinstance(connected, bool):
            raise ValueError("'agent_id' must be text and 'controller_connected' true or false")
        releases = body.get("releases_after_s")
        if releases is not None and not _number(releases):
            raise ValueError(f"'releases_after_s' must be a number of seconds or null, got {releases!r:.40}")
        status = body["status"]
        if not isinstance(status, dict):
            raise ValueError("'status' must be an object")
        agent = AgentStatus.from_dict(status)
        _check_types(agent)
        return cls(agent, agent_id, pid, float(started), None if paused_by is None else PauseSource(paused_by),
                   connected, None if releases is None else float(releases))


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_types(status: AgentStatus) -> None:
    """ValueError naming the first field of `status` whose value is not of its kind (from_dict takes them as
    written: a file with a null in a number's place failed in the tray's drawing, every 2 s)."""
    reading, cache = status.reading, status.cache
    numbers = {"cpu_load": reading.cpu_load, "taken_at": status.taken_at,
               **{f"temperatures[{index}]": sensor.celsius for index, sensor in enumerate(reading.temperatures)}}
    optional = {"battery_percent": reading.battery_percent, "igpu_busy": reading.igpu_busy}
    counts = {"memory_free_bytes": reading.memory_free_bytes, "memory_total_bytes": reading.memory_total_bytes,
              "used_bytes": cache.used_bytes, "limit_bytes": cache.limit_bytes,
              **{f"stages[{index}].{name}": value for index, stage in enumerate(status.stages)
                 for name, value in (("layer_start", stage.layer_start), ("layer_end", stage.layer_end))}}
    wrong = [name for name, value in numbers.items() if not _number(value)]
    wrong += [name for name, value in optional.items() if value is not None and not _number(value)]
    wrong += [name for name, value in counts.items() if isinstance(value, bool) or not isinstance(value, int)]
    if reading.on_ac_power not in (True, False, None):
        wrong.append("on_ac_power")
    if not isinstance(status.last_error, str | None) or any(not isinstance(stage.model_id, str)
                                                            for stage in status.stages):
        wrong.append("last_error or a stage's model_id")
    if wrong:
        raise ValueError(f"'{wrong[0]}' is not of its kind")


def shows_a_change(before: PublishedStatus | None, now: PublishedStatus) -> bool:
    """Whether the tray should be told `now`, `before` being the status last written: a change of state, stages,
    pause, controller link, error or detail; a reading moved past READING_STEPS from the one written (the numbers
    of a PC at work move a little at every look, and were written every 5 s); or `before` older than HEARTBEAT_S."""
    if before is None or now.status.taken_at - before.status.taken_at >= HEARTBEAT_S or _exact(before) != _exact(now):
        return True
    # a sensor appearing or going is in _exact: here both readings are numbers, or both None
    return any(a is not None and b is not None and abs(a - b) >= step
               for a, b, step in zip(_readings(before), _readings(now), READING_STEPS, strict=True))


def _exact(published: PublishedStatus) -> tuple[object, ...]:
    status = published.status
    return (status.state, status.reasons, status.detail, status.stages, status.last_error, status.version,
            published.pid, published.paused_by, published.controller_connected, published.releases_after_s,
            status.reading.on_ac_power, status.reading.memory_total_bytes, status.cache.limit_bytes,
            status.reading.battery_percent is None, status.reading.max_temperature_c is None,
            status.reading.igpu_busy is None)


def _readings(published: PublishedStatus) -> tuple[float | None, ...]:
    reading = published.status.reading
    return (reading.cpu_load, float(reading.memory_free_bytes), reading.battery_percent, reading.max_temperature_c,
            reading.igpu_busy, float(published.status.cache.used_bytes))


def this_process_started_at() -> float:
    """When this process started, as the OS tells it (what the tray compares a published pid's start with)."""
    return psutil.Process().create_time()


def write_status_file(state_dir: Path, published: PublishedStatus) -> None:
    """Replace the status file whole (OSError when it cannot be written: a full disk, a read-only folder)."""
    data = (json.dumps(published.to_dict(), indent=1, allow_nan=False) + "\n").encode("utf-8")
    write_atomic(state_dir / STATUS_FILE, data, durable=False)


def read_status_file(state_dir: Path) -> PublishedStatus | None:
    """The status the agent published last; None when there is none (it never ran on this data dir). StatusFileError
    naming the file when it cannot be read, is damaged, or comes from another version of deskfleet."""
    path = state_dir / STATUS_FILE
    try:
        body = read_json_object(path)
    except FileNotFoundError:
        return None
    except JsonFileError as error:
        raise StatusFileError(str(error)) from None
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        raise StatusFileError(f"{path} is of format {version!r:.20}, which this tray does not read (it reads "
                              f"{FORMAT_VERSION}): the agent and the tray are of different deskfleet versions")
    try:
        return PublishedStatus.from_dict(body)
    except (KeyError, TypeError, ValueError) as error:
        problem = f"lacks {error}" if isinstance(error, KeyError) else str(error)
        raise StatusFileError(f"{path} is damaged ({problem})") from None


def publisher_running(published: PublishedStatus, now: float) -> bool:
    """Whether the process that published `published` still runs: its pid lives, and either started when it said,
    or wrote the file lately. On Linux a process's start time is computed from the boot time, which moves with the
    wall clock: once the clock was set right (NTP at boot, a laptop waking), the start time no longer matched, and a
    running agent was said to have stopped. A reused pid matches neither for long."""
    try:
        started = psutil.Process(published.pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:  # another user's process has that pid now: not this user's agent
        return False
    return abs(started - published.process_started_at) <= SAME_PROCESS_START_S or \
        abs(now - published.status.taken_at) <= STALE_AFTER_S
