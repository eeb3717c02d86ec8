"""The running agent's status, published in its state folder for the tray (agent/tray.py) to show.

The agent writes `status.json` every STATUS_PUBLISH_S while it runs (service.py): its AgentStatus, who paused it,
whether it is registered with the fleet's controller, and which process it is. The tray runs in the employee's
desktop session as the same user, reads the file, and asks the operating system whether that process still runs
(a file left by an agent that stopped or crashed is not taken for a running one, nor a reused pid for the agent).
The file only shows what is now: it is written without syncs to disk, and a damaged one is named, not trusted.
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
STATUS_PUBLISH_S = 5.0  # how often the running agent rewrites it (the tray reads it every couple of seconds)
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

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "status": self.status.to_dict(), "agent_id": self.agent_id,
                "pid": self.pid, "process_started_at": self.process_started_at,
                "paused_by": None if self.paused_by is None else self.paused_by.value,
                "controller_connected": self.controller_connected}

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
        status = body["status"]
        if not isinstance(status, dict):
            raise ValueError("'status' must be an object")
        return cls(AgentStatus.from_dict(status), agent_id, pid, float(started),
                   None if paused_by is None else PauseSource(paused_by), connected)


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


def publisher_running(published: PublishedStatus) -> bool:
    """Whether the process that published `published` still runs (its pid, started when it said)."""
    try:
        started = psutil.Process(published.pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:  # another user's process has that pid now: not this user's agent
        return False
    return abs(started - published.process_started_at) <= SAME_PROCESS_START_S
