"""common/file_lock.py's Windows branch, loaded with a fake msvcrt: msvcrt.locking(LK_LOCK) tries 10 times a second
apart and then raises OSError(EDEADLOCK); lock_file ("wait for the lock", as flock does on Linux) gave up there,
and a store command whose lock another one held for longer failed with "Resource deadlock avoided"."""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

from deskfleet.common import file_lock


class FakeMsvcrt(types.ModuleType):
    LK_UNLCK, LK_LOCK, LK_NBLCK = 0, 1, 2

    def __init__(self, busy_for: int) -> None:
        super().__init__("msvcrt")
        self.busy_for = busy_for  # LK_LOCK calls that find the byte held (each: 10 s on Windows)
        self.calls: list[tuple[int, int]] = []  # (mode, position)
        self.held = False

    def locking(self, descriptor: int, mode: int, count: int) -> None:
        assert count == 1
        self.calls.append((mode, os.lseek(descriptor, 0, os.SEEK_CUR)))
        if mode == self.LK_UNLCK:
            self.held = False
            return
        if self.busy_for > 0:
            self.busy_for -= 1
            if mode == self.LK_NBLCK:
                raise PermissionError(errno.EACCES, "Permission denied")
            raise OSError(errno.EDEADLOCK, "Resource deadlock avoided")
        self.held = True


def windows_file_lock(msvcrt: FakeMsvcrt, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A copy of common/file_lock.py as it loads on Windows."""
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setitem(sys.modules, "msvcrt", msvcrt)
    assert file_lock.__file__ is not None
    spec = importlib.util.spec_from_file_location("file_lock_on_windows", file_lock.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lock_file_waits_past_msvcrts_ten_tries_on_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    msvcrt = FakeMsvcrt(busy_for=3)  # another process holds the lock for some 30 s
    module = windows_file_lock(msvcrt, monkeypatch)
    with open(tmp_path / ".lock", "a+b") as handle:
        handle.write(b"\n42")
        handle.flush()
        module.lock_file(handle.fileno())
        assert msvcrt.held
        assert msvcrt.calls == [(FakeMsvcrt.LK_LOCK, 0)] * 4  # always the first byte
        module.unlock_file(handle.fileno())
        assert not msvcrt.held


def test_try_lock_file_still_answers_at_once_on_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    msvcrt = FakeMsvcrt(busy_for=1)
    module = windows_file_lock(msvcrt, monkeypatch)
    with open(tmp_path / ".lock", "a+b") as handle:
        assert not module.try_lock_file(handle.fileno())
        assert module.try_lock_file(handle.fileno())


def test_another_locking_failure_is_raised_on_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    msvcrt = FakeMsvcrt(busy_for=0)

    def bad_descriptor(descriptor: int, mode: int, count: int) -> None:
        raise OSError(errno.EBADF, "Bad file descriptor")

    msvcrt.locking = bad_descriptor  # type: ignore[method-assign]
    module = windows_file_lock(msvcrt, monkeypatch)
    with open(tmp_path / ".lock", "a+b") as handle, pytest.raises(OSError, match="Bad file descriptor"):
        module.lock_file(handle.fileno())
