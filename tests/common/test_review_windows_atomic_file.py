"""write_atomic on Windows, simulated: the rename onto a file that another process has open fails with
PermissionError (WinError 5 or 32) until that process closes it. `deskfleet-agent pause` failed so when the running
agent was reading opt_out.json at that moment (it does every couple of seconds), and `fleet remove` when `fleet
serve` was reading revoked.json."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from deskfleet.common import atomic_file
from deskfleet.common.atomic_file import write_atomic


def replace_refused(times: int, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """os.replace refused `times` times (the target open elsewhere), then done; returns the calls."""
    calls: list[str] = []
    real_replace = os.replace

    def replace(source: str, target: str | os.PathLike[str]) -> None:
        calls.append(os.fspath(target))
        if len(calls) <= times:
            raise PermissionError(13, "The process cannot access the file because it is being used by another "
                                      "process", os.fspath(target))
        real_replace(source, target)

    monkeypatch.setattr(atomic_file.os, "replace", replace)
    return calls


def test_a_target_a_reader_holds_open_is_replaced_once_it_is_closed_on_windows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    target = tmp_path / "opt_out.json"
    target.write_bytes(b"old")
    calls = replace_refused(3, monkeypatch)
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and len(calls) == 4
    assert [path.name for path in tmp_path.iterdir()] == ["opt_out.json"]


def test_a_target_held_open_for_good_fails_and_keeps_the_old_file_on_windows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(atomic_file, "REPLACE_RETRY_S", 0.05, raising=False)
    target = tmp_path / "opt_out.json"
    target.write_bytes(b"old")
    replace_refused(10**6, monkeypatch)
    with pytest.raises(PermissionError):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert [path.name for path in tmp_path.iterdir()] == ["opt_out.json"]


def test_a_refused_rename_is_not_tried_again_off_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    target = tmp_path / "file.json"
    calls = replace_refused(1, monkeypatch)
    with pytest.raises(PermissionError):
        write_atomic(target, b"new")
    assert len(calls) == 1
