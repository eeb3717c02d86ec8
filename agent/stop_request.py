"""Asking the running agent to stop, through its state folder: how `deskfleet-agent stop` and Windows' autostart stop
it as Ctrl-C would (its stages given up, its links closed, its lock and status left right) where no signal can reach
it. A process started by Task Scheduler with pythonw.exe has no console: Windows has no Ctrl-C, SIGTERM or
CTRL_BREAK to send it, and `schtasks /End` ends it on the spot.

The request names the pid of the agent it is for (`stop-request.json`), so a request left behind never stops a later
agent; the agent looks for it every STOP_CHECK_S, and removes it as it stops. It is written by the PC's user, who owns
the state folder and the agent alike: no right is given that the user did not have.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.json_file import JsonFileError, read_json_object

log = logging.getLogger(__name__)

STOP_REQUEST_FILE = "stop-request.json"
FORMAT_VERSION = 1
STOP_CHECK_S = 1.0  # how often the running agent looks for a request
# how long the asker waits for the agent to have stopped: it gives its stages up after the step under way, and closes
# its links (a few seconds); past this, Windows' autostart ends it as `schtasks /End` does
STOP_WAIT_S = 20.0


def request_stop(state_dir: Path, pid: int) -> None:
    """Ask the agent `pid` running on `state_dir` to stop."""
    asked_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    write_atomic(state_dir / STOP_REQUEST_FILE,
                 f'{{"format_version": {FORMAT_VERSION}, "pid": {pid}, "asked_at": "{asked_at}"}}\n'.encode())


def requested_pid(state_dir: Path) -> int | None:
    """The pid a request left in `state_dir` is for; None where there is none, or it cannot be read (a damaged file
    stops no agent: its asker says the agent did not stop)."""
    path = state_dir / STOP_REQUEST_FILE
    try:
        body = read_json_object(path)
    except FileNotFoundError:
        return None
    except JsonFileError as error:
        log.warning("%s", error)
        return None
    pid = body.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def clear_stop_request(state_dir: Path) -> None:
    (state_dir / STOP_REQUEST_FILE).unlink(missing_ok=True)


def process_ended(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie, ended but not yet waited for by its parent, has)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # another user's process has that pid now
        return True


def stop_agent(state_dir: Path, pid: int, timeout: float = STOP_WAIT_S,
               ended: Callable[[int], bool] = process_ended) -> bool:
    """Ask the agent `pid` to stop and wait for it to end; whether it ended within `timeout`. The request is taken
    back where it did not (an agent that never looks for it must not find it later)."""
    request_stop(state_dir, pid)
    deadline = time.monotonic() + timeout
    while not ended(pid):
        if time.monotonic() >= deadline:
            if requested_pid(state_dir) == pid:
                clear_stop_request(state_dir)
            return False
        time.sleep(0.1)
    return True
