"""The controller data dir on a full disk (or read-only): `fleet init`, `fleet token` and `fleet remove` end
with one line naming the file, exit 2, and leave every file as it was. An OSError from the atomic write
raised out of the CLI as a traceback (only FileNotFoundError was a user error), and an init that ran out of
space left half a fleet, which the next init refused as "part of a fleet"."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import deskfleet.common.atomic_file as atomic_file
from deskfleet.common import pki
from deskfleet.controller.cli import main

AGENT_ID = "a" * 52


def _contents(data_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(data_dir.iterdir()) if not path.name.startswith(".")}


def _full(descriptor: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic_file.os, "fsync", _full)


@pytest.mark.parametrize("command", [["token", "--uses", "3"], ["remove", AGENT_ID]])
def test_a_full_disk_is_named_and_nothing_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0
    before = _contents(tmp_path / "ctl")
    capsys.readouterr()
    monkeypatch.setattr(atomic_file.os, "fsync", _full)
    assert main(["fleet", *command, *data]) == 2
    out, err = capsys.readouterr()
    name = "tokens.json" if command[0] == "token" else "revoked.json"
    assert f"cannot write {tmp_path / 'ctl' / name}: No space left on device; it is unchanged" in err, err
    assert "Traceback" not in err and out == ""  # no token printed that the ledger does not hold
    assert _contents(tmp_path / "ctl") == before
    assert not [path.name for path in (tmp_path / "ctl").iterdir() if path.name.endswith(".tmp")]


def test_init_on_a_full_disk_leaves_no_half_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  full_disk: None) -> None:
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 2
    err = capsys.readouterr().err
    assert f"no fleet was created in {tmp_path / 'ctl'}: cannot write" in err and "Traceback" not in err, err
    assert _contents(tmp_path / "ctl") == {}


def test_init_after_the_disk_is_freed_works(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    data = ["--data-dir", str(tmp_path / "ctl")]
    calls = []
    real = atomic_file.os.fsync

    def full_after_two(descriptor: int) -> None:  # the keys fit, the certificates do not
        calls.append(descriptor)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(descriptor)

    monkeypatch.setattr(atomic_file.os, "fsync", full_after_two)
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 2
    monkeypatch.setattr(atomic_file.os, "fsync", real)
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0, capsys.readouterr().err
    ca = (tmp_path / "ctl" / "ca.pem").read_bytes()
    assert pki.fleet_id(pki.load_certificate_pem(ca))


def test_a_deployment_that_cannot_be_recorded_says_the_stages_are_released(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], full_disk: None) -> None:
    # the deploy's last step: an OSError traceback after every shard was sent and every stage assigned
    from deskfleet.controller.fleet_deploy import DeployError, DeployReport, DeploySettings, _save_deployment
    from deskfleet.controller.fleet_store import FleetStore

    report = DeployReport("m-123", (), {}, {})
    with pytest.raises(DeployError) as raised:
        _save_deployment(FleetStore(tmp_path / "ctl"), tmp_path / "model", report, DeploySettings())
    assert "every stage was sent and assigned, but the deployment could not be recorded: cannot write" in \
        str(raised.value)
    assert "deployments.json: No space left on device" in str(raised.value)
    assert "the PCs were told to release the stages again" in str(raised.value)  # deploy() does: it said "assigned"


def test_an_init_force_that_fails_halfway_leaves_the_old_fleet_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # `fleet init --force` wrote its files one by one: killed (or out of disk) after the CA key, every command then
    # said the CA did not match its key, "copy state/ca.pem from the data dir of any enrolled agent", which no agent
    # could mend: the old key was gone. The files are staged first now, and none is replaced until all are.
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0
    before = _contents(tmp_path / "ctl")
    calls = []
    real = atomic_file.os.fsync

    def full_after_three(descriptor: int) -> None:
        calls.append(descriptor)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(descriptor)

    monkeypatch.setattr(atomic_file.os, "fsync", full_after_three)
    capsys.readouterr()
    assert main(["fleet", "init", "--force", "--address", "10.0.0.6:7341", *data]) == 2
    err = capsys.readouterr().err
    assert f"the fleet in {tmp_path / 'ctl'} was not replaced: cannot write the files of" in err, err
    monkeypatch.setattr(atomic_file.os, "fsync", real)
    assert _contents(tmp_path / "ctl") == before
    assert not [path.name for path in (tmp_path / "ctl").iterdir() if path.name.endswith(".tmp")]
    assert main(["fleet", "ls", "--discover-seconds", "0", *data]) == 0  # the old fleet, whole
