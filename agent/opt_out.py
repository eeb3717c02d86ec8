"""The employee's opt-out: whether the person at this PC has paused it for the fleet.

`deskfleet-agent pause` and `resume` (and the tray's toggle, agent/tray.py) write `opt_out.json` in the
agent's state folder; the running agent reads it at every status request and every limits check (a couple of
seconds), so the employee needs no rights over the agent's process or the admin's settings file. A paused PC
reports `paused`, is never planned, refuses assignments, and gives up what it hosts at once.

A file that cannot be read or parsed counts as paused: the person who wrote it wanted the PC back, and an
agent must not serve against that because of a damaged file (the problem is logged, naming the file).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.json_file import JsonFileError, read_json_object

log = logging.getLogger(__name__)

OPT_OUT_FILE = "opt_out.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class OptOut:
    paused: bool
    since: str  # ISO 8601 UTC of the last pause or resume; "" when unknown
    problem: str | None = None  # why the file could not be read (then paused)


def read_opt_out(state_dir: Path) -> OptOut:
    """This PC's opt-out; not paused when the employee never paused it (no file)."""
    path = state_dir / OPT_OUT_FILE
    if not path.exists() and not path.is_symlink():
        return OptOut(False, "")
    try:
        body = read_json_object(path)
        paused, since = body.get("paused"), body.get("since", "")
        if not isinstance(paused, bool) or not isinstance(since, str):
            raise JsonFileError(f"{path}: 'paused' must be true or false and 'since' a time, got {body!r:.80}")
    except (JsonFileError, OSError) as error:
        return OptOut(True, "", f"{error}: taken as paused; `deskfleet-agent pause` or `resume` writes it anew")
    return OptOut(paused, since)


def write_opt_out(state_dir: Path, paused: bool, now: str) -> Path:
    """Pause (or resume) this PC; the file is replaced whole."""
    path = state_dir / OPT_OUT_FILE
    body = {"format_version": FORMAT_VERSION, "paused": paused, "since": now}
    write_atomic(path, (json.dumps(body, indent=2) + "\n").encode("utf-8"))
    return path


class OptOutReader:
    """Reads the opt-out for the running agent, logging a damaged file once (until it changes)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.state_dir = state_dir
        self._logged: str | None = None

    def read(self) -> OptOut:
        if self.state_dir is None:
            return OptOut(False, "")
        opt_out = read_opt_out(self.state_dir)
        if opt_out.problem is not None and opt_out.problem != self._logged:
            log.warning("%s", opt_out.problem)
        self._logged = opt_out.problem
        return opt_out
