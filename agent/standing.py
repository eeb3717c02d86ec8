"""Whether this PC stands in a fleet, as its agent's state folder says: joined (its membership file, which
agent/enroll.py writes) and refused as removed (a note the running agent keeps). Light on purpose: the tray reads
these every couple of seconds and loads neither TLS nor websockets for it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from deskfleet.common.atomic_file import write_atomic

log = logging.getLogger(__name__)

MEMBERSHIP_FILE = "membership.json"
# in the state folder: written when the controller refused this PC as removed (agent/service.py), read by `pause`
# and `resume` (which said "the next plan may use this PC again" of a PC the fleet refuses), gone at the next join
REMOVED_FILE = "removed.json"


def joined(state_dir: Path) -> bool:
    """Whether this data dir's agent joined a fleet (its membership file is there; enroll.Membership reads it)."""
    return (state_dir / MEMBERSHIP_FILE).is_file()


def note_removed(state_dir: Path, when: str) -> None:
    """Keep that the controller refused this PC as removed from the fleet (see REMOVED_FILE); a failure is logged."""
    try:
        write_atomic(state_dir / REMOVED_FILE, json.dumps({"removed_seen": when}).encode("utf-8"))
    except OSError as error:
        log.warning("cannot note in %s that this PC was removed (%s)", state_dir, error.strerror or error)


def forget_removed(state_dir: Path) -> None:
    """The controller took this PC: it is no removed PC (see REMOVED_FILE); a failure is logged."""
    try:
        (state_dir / REMOVED_FILE).unlink(missing_ok=True)
    except OSError as error:
        log.warning("cannot delete %s (%s): `deskfleet-agent pause` may say this PC was removed", state_dir /
                    REMOVED_FILE, error.strerror or error)


def removed_seen(state_dir: Path) -> str | None:
    """When the running agent was last refused as removed (an ISO date), or None: not removed, as far as it saw."""
    try:
        seen = json.loads((state_dir / REMOVED_FILE).read_text(encoding="utf-8")).get("removed_seen")
    except (OSError, ValueError, AttributeError):
        return None
    return seen if isinstance(seen, str) else "an earlier run"
