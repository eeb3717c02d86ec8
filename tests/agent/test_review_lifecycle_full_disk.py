"""An agent whose data dir is on a full disk when it starts: the one-agent-per-data-dir lock still holds (a
second agent is refused), and a lock file that cannot even be created is named, not a bare errno."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest

from deskfleet.agent import cli
from deskfleet.agent.enroll import Membership
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import LOCK_FILE, AgentService
from deskfleet.common import file_lock, pki
from tests.fleet_pki import make_ca, make_member


class FullDisk(io.FileIO):
    """A file on a disk with no room left: opening and locking work, writing does not."""

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def joined(data_dir: Path) -> AgentPaths:
    paths = AgentPaths.resolve(data_dir)
    paths.create()
    files = make_member(make_ca(data_dir / "ca"), paths.state_dir, "agent")
    Membership(pki.fleet_id(files.ca_certificate()), files.own_identity().agent_id, "c" * 52,
               ("127.0.0.1:1",)).save(paths.state_dir)
    return paths


def service_on(data_dir: Path) -> AgentService:
    service = AgentService.__new__(AgentService)
    service.paths = AgentPaths.resolve(data_dir)
    return service


def test_an_agent_on_a_full_disk_holds_its_data_dir_without_writing_its_pid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Writing the pid after the lock raised ENOSPC and the agent stopped ("error: [Errno 28] No space left on
    # device"), though a full disk only keeps it from taking new shards: the stages in its cache still serve.
    joined(tmp_path)
    monkeypatch.setattr(file_lock, "open", lambda path, mode, buffering=-1, opener=None: FullDisk(path, "a+"),
                        raising=False)
    first, second = service_on(tmp_path), service_on(tmp_path)
    with first._data_dir_lock():
        assert any("cannot write this process's id" in record.getMessage() and LOCK_FILE in record.getMessage()
                   for record in caplog.records)
        with pytest.raises(OSError, match=r"is in use by another agent \(pid unknown\)"):
            with second._data_dir_lock():
                pass
    with second._data_dir_lock():  # free again once the first stopped
        pass


def test_a_lock_file_that_cannot_be_created_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    paths = joined(tmp_path)

    def no_room(path: Path, mode: str, buffering: int = -1, opener: Any = None) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(file_lock, "open", no_room, raising=False)
    assert cli.main(["--headless", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:17431"]) == 2
    error = capsys.readouterr().err
    assert f"cannot open the lock file {paths.state_dir / LOCK_FILE}: No space left on device" in error, error
