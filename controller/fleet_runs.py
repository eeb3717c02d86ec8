"""Which runs drive a model's chain from this controller data dir right now.

Every fleet run (`generate --fleet`, `chat --fleet`, `fleet generate`) holds a lock file of its own in the data dir's
`runs/` folder for as long as its chain is open, named by the model it drives. A run's start that would re-plan the
model's deployment for a PC that is back (FleetFailover.rejoin) first counts the others: a re-plan replaces the
stages under their streams (they fail over, spending their --max-failovers, and a deploy that meets their steps can
fail partway), so it is left to a run that starts while no other drives the model. A file whose lock nobody holds is
a run that ended without removing it (killed): it is removed when counted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from deskfleet.common.file_lock import pid_lock, try_lock_file, unlock_file
from deskfleet.controller.fleet_store import FleetStore

log = logging.getLogger(__name__)

RUNS_FOLDER = "runs"
STALE_AFTER_S = 10.0  # an unlocked run file older than this is a killed run's
_SUFFIX = ".run"


@contextlib.contextmanager
def driving(store: FleetStore, model_id: str) -> Iterator[None]:
    """Hold this run's lock file for `model_id` while the block runs; the file is removed after. A data dir where
    none can be made (read-only, full) runs without one: the run is then not counted (logged)."""
    folder = store.data_dir / RUNS_FOLDER
    path = folder / f"{_model_key(model_id)}-{os.getpid()}-{secrets.token_hex(4)}{_SUFFIX}"
    with contextlib.ExitStack() as held:
        held.callback(_remove, path)  # after the lock is let go of: Windows removes no file that is open
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            held.enter_context(pid_lock(path, lambda pid, holder: OSError(f"{path} is held by pid {pid}")))
        except OSError as error:
            log.debug("this run is not counted among the runs driving %s: %s", model_id, error)
        yield


def others_driving(store: FleetStore, model_id: str) -> int:
    """How many other runs drive `model_id` from this data dir now (this process's own file is not counted); the
    files of runs that ended without removing them are removed. 0 where the folder cannot be read."""
    folder = store.data_dir / RUNS_FOLDER
    try:
        paths = list(folder.glob(f"{_model_key(model_id)}-*{_SUFFIX}"))
    except OSError:
        return 0
    count = 0
    for path in paths:
        if path.name.split("-")[1:2] == [str(os.getpid())]:
            continue
        if _held(path):
            count += 1
    return count


# Private functions

def _model_key(model_id: str) -> str:
    """A file-name-safe key of a model id (ids hold '@' and a folder's name)."""
    return hashlib.sha256(model_id.encode("utf-8")).hexdigest()[:16]


def _held(path: Path) -> bool:
    """Whether a live run holds `path`'s lock. A file nobody holds is a run that ended without removing it: removed,
    once STALE_AFTER_S old (a run that has just made its file takes the lock an instant later)."""
    try:
        handle = open(path, "rb")  # closed below, before any unlink (Windows removes no file that is open)
    except OSError:
        return False  # removed meanwhile: that run has ended
    try:
        if not try_lock_file(handle.fileno()):
            return True
        unlock_file(handle.fileno())
    except OSError:
        return True  # cannot tell: counted, which only defers a re-plan
    finally:
        handle.close()
    with contextlib.suppress(OSError):
        if time.time() - path.stat().st_mtime > STALE_AFTER_S:
            path.unlink()
    return False


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
