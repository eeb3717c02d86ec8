"""The runs driving a model from a controller data dir (fleet_runs): each holds a lock file of its own while its
chain is open, and a run's start counts the others before it re-plans for a PC that is back."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from deskfleet.controller.fleet_runs import RUNS_FOLDER, STALE_AFTER_S, _model_key, driving, others_driving
from deskfleet.controller.fleet_store import FleetStore

MODEL, OTHER = "demo@0123456789ab", "other@ba9876543210"


def _run_in_another_process(store: FleetStore, model_id: str) -> subprocess.Popen[str]:
    """A process that drives `model_id` until its standard input closes; returns once it holds its file."""
    code = ("import sys; from pathlib import Path; from deskfleet.controller.fleet_runs import driving; "
            "from deskfleet.controller.fleet_store import FleetStore\n"
            f"with driving(FleetStore(Path({str(store.data_dir)!r})), {model_id!r}):\n"
            "    print('driving', flush=True); sys.stdin.read()\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "driving\n"
    return process


def _end(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    assert process.wait(timeout=30) == 0


def test_a_run_counts_the_other_runs_of_its_model_and_not_itself(store: FleetStore) -> None:
    with driving(store, MODEL):
        assert others_driving(store, MODEL) == 0  # its own file
        other = _run_in_another_process(store, MODEL)
        elsewhere = _run_in_another_process(store, OTHER)
        try:
            assert others_driving(store, MODEL) == 1 and others_driving(store, OTHER) == 1
        finally:
            _end(other)
            _end(elsewhere)
        assert others_driving(store, MODEL) == 0  # ended: its file is gone with it
    assert list((store.data_dir / RUNS_FOLDER).iterdir()) == []


def test_the_file_of_a_killed_run_is_not_counted_and_is_removed_once_old(store: FleetStore) -> None:
    other = _run_in_another_process(store, MODEL)
    other.kill()  # no clean-up: its file stays, its lock goes with the process
    other.wait(timeout=30)
    (left,) = (store.data_dir / RUNS_FOLDER).iterdir()
    assert others_driving(store, MODEL) == 0 and left.exists()  # young: perhaps a run that is about to lock it
    old = time.time() - STALE_AFTER_S - 1
    os.utime(left, (old, old))
    assert others_driving(store, MODEL) == 0 and not left.exists()


def test_a_data_dir_where_no_run_file_can_be_made_runs_uncounted(store: FleetStore) -> None:
    (store.data_dir / RUNS_FOLDER).write_text("a file where the folder should be")
    with driving(store, MODEL):  # no error: the run goes on, not counted
        assert others_driving(store, MODEL) == 0


def test_model_keys_are_file_names() -> None:
    key = _model_key("a folder/with spaces@0123456789ab")
    assert len(key) == 16 and key.isalnum() and key != _model_key(MODEL)


def test_a_runs_file_holds_its_pid(store: FleetStore) -> None:
    with driving(store, MODEL):
        (mine,) = (store.data_dir / RUNS_FOLDER).iterdir()
        assert mine.name.startswith(f"{_model_key(MODEL)}-{os.getpid()}-") and mine.name.endswith(".run")
        assert Path(mine).read_bytes()[1:].decode().strip() == str(os.getpid())
