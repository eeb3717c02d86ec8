"""Asking the running agent to stop, through its state folder: how `deskfleet-agent stop` and Windows' autostart stop
it as Ctrl-C would (its stages given up, its links closed, its lock and status left right) where no signal can reach
it. A process started by Task Scheduler with pythonw.exe has no console: Windows has no Ctrl-C, SIGTERM or
CTRL_BREAK to send it, and `schtasks /End` ends it on the spot.

The request (`stop-request.json`) names the process it is for by its pid and the time the OS says it started, as the
agent's status file gives them: a request left behind (two `stop`s at once, an agent that ended otherwise) never
stops a later agent, even one given the same pid (a container's PID 1, a pid Windows reuses). The agent clears any
request as it starts, looks for one every STOP_CHECK_S, and removes it as it stops. It is written by the PC's user,
who owns the state folder and the agent alike: no right is given that the user did not have.
"""

from __future__ import annotations

import datetime
import enum
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.json_file import JsonFileError, read_json_object

log = logging.getLogger(__name__)

STOP_REQUEST_FILE = "stop-request.json"
FORMAT_VERSION = 1
STOP_CHECK_S = 1.0  # how often the running agent looks for a request
# how long the asker waits for the agent to take the request and end: it gives its stages up after the step under way,
# and closes its links (a few seconds)
STOP_WAIT_S = 20.0
# and how much longer for one that took it but is still closing (a stage's compile finishing in a worker thread)
STOPPING_GRACE_S = 40.0
SAME_PROCESS_START_S = 1.0  # the OS's start times of one process, rounded differently, are this close


@dataclass(frozen=True)
class StopRequest:
    pid: int
    process_started_at: float  # the OS's start time of the process, epoch seconds


class Outcome(enum.Enum):
    STOPPED = "stopped"
    STOPPING = "stopping"  # it took the request, and is still closing
    NOT_TAKEN = "not taken"  # it never looked (hung), or cannot read the folder: the request was taken back


def request_stop(state_dir: Path, request: StopRequest) -> None:
    """Ask the agent process `request` names to stop (OSError where the folder cannot be written)."""
    body = {"format_version": FORMAT_VERSION, "pid": request.pid, "process_started_at": request.process_started_at,
            "asked_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    write_atomic(state_dir / STOP_REQUEST_FILE, (json.dumps(body) + "\n").encode())


def read_stop_request(state_dir: Path) -> StopRequest | None:
    """The request in `state_dir`, None where there is none; JsonFileError (naming the file) where it cannot be read
    or is not a request."""
    path = state_dir / STOP_REQUEST_FILE
    try:
        body = read_json_object(path)
    except FileNotFoundError:
        return None
    pid, started = body.get("pid"), body.get("process_started_at")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0) or \
            not (isinstance(started, (int, float)) and not isinstance(started, bool)):
        raise JsonFileError(f"{path} is not a stop request (no pid and start time): it stops no agent; delete it")
    return StopRequest(pid, float(started))


def running_agent(state_dir: Path) -> StopRequest | None:
    """The agent running on `state_dir` now, as its status file names it (the request that stops it); None where none
    runs. StatusFileError (naming the file) where the file cannot be read: another user's agent, a damaged file."""
    from deskfleet.agent.status_file import publisher_running, read_status_file

    published = read_status_file(state_dir)
    if published is None or not publisher_running(published, time.time()):
        return None
    return StopRequest(published.pid, published.process_started_at)


def clear_stop_request(state_dir: Path) -> None:
    (state_dir / STOP_REQUEST_FILE).unlink(missing_ok=True)


def is_for(request: StopRequest | None, pid: int, started_at: float) -> bool:
    return request is not None and request.pid == pid and \
        abs(request.process_started_at - started_at) <= SAME_PROCESS_START_S


class StopRequestWatch:
    """What the running agent looks at every STOP_CHECK_S: whether a request for this very process is there. A file
    that cannot be read is logged once (until its problem changes), not every second."""

    def __init__(self, state_dir: Path, pid: int, started_at: float) -> None:
        self.state_dir, self.pid, self.started_at = state_dir, pid, started_at
        self._logged: str | None = None

    def asked(self) -> bool:
        try:
            request = read_stop_request(self.state_dir)
        except (JsonFileError, OSError) as error:
            if str(error) != self._logged:
                log.warning("%s", error)
            self._logged = str(error)
            return False
        self._logged = None
        return is_for(request, self.pid, self.started_at)


def stop_agent(state_dir: Path, request: StopRequest, timeout: float = STOP_WAIT_S,
               grace: float = STOPPING_GRACE_S, ended: Callable[[], bool] | None = None) -> Outcome:
    """Ask the agent process `request` names to stop, and wait: STOPPED once it has ended; STOPPING where it took the
    request but had not ended `grace` seconds past `timeout`; NOT_TAKEN where it had not taken it within `timeout`
    (the request is then taken back: an agent that never looks must not find it later). OSError where the request
    cannot be written."""
    ended = ended or _ended_check(request.pid)
    request_stop(state_dir, request)
    deadline = time.monotonic() + timeout
    while not ended():
        if time.monotonic() >= deadline:
            try:
                still_there = is_for(read_stop_request(state_dir), request.pid, request.process_started_at)
            except (JsonFileError, OSError):
                still_there = False
            if still_there:
                clear_stop_request(state_dir)
                return Outcome.NOT_TAKEN
            if deadline - time.monotonic() < -grace:
                return Outcome.STOPPING
        time.sleep(0.1)
    return Outcome.STOPPED


def _ended_check(pid: int) -> Callable[[], bool]:
    """Whether process `pid` (the one running now) has ended: gone, a zombie (ended, not yet waited for by its
    parent), or its pid given to another process since (psutil compares its start time)."""
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return lambda: True

    def ended() -> bool:
        try:
            return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return ended
