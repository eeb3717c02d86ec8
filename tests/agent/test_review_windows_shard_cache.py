"""The shard cache on Windows, simulated: `sys.platform` is "win32" and deleting a file whose read-only attribute is set
fails with PermissionError (WinError 5, as DeleteFileW does; chmod 0o444 sets that attribute there), also through a
hard link to it. The cache marked every blob so, and then could not evict a shard, drop a corrupted one, or remove
a view: a released stage's view stayed, and the next assignment of that stage failed rebuilding it."""

from __future__ import annotations

import hashlib
import os
import random
import stat
import sys
from pathlib import Path

import pytest

from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.wire import ShardChunk
from tests.fake_clock import FakeClock

_real_unlink = os.unlink


def _windows_unlink(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    if not os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode & stat.S_IWRITE:
        raise PermissionError(13, "Access is denied", os.fspath(path))
    _real_unlink(path, dir_fd=dir_fd)


@pytest.fixture
def windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(os, "unlink", _windows_unlink)
    monkeypatch.setattr(os, "remove", _windows_unlink)


def shard(cache: ShardCache, seed: int, size: int = 1000) -> str:
    data = random.Random(seed).randbytes(size)
    sha = hashlib.sha256(data).hexdigest()
    cache.receive(ShardChunk(sha, 0, size, data))
    cache.complete(sha)
    return sha


def test_a_full_cache_evicts_its_oldest_shard_on_windows(tmp_path: Path, windows: None) -> None:
    cache = ShardCache(tmp_path, 2500, FakeClock(1_000_000.0, tick=1.0))
    first, second = shard(cache, 1), shard(cache, 2)
    third = shard(cache, 3)  # room for it: the first goes
    assert not cache.has(first) and cache.has(second) and cache.has(third)


def test_a_released_stages_view_goes_and_the_stage_can_be_built_again_on_windows(tmp_path: Path,
                                                                                  windows: None) -> None:
    cache = ShardCache(tmp_path, 1 << 20, FakeClock(1_000_000.0, tick=1.0))
    sha = shard(cache, 1)
    view = cache.materialize("model-0-2", {"layer_0.bin": sha})
    cache.remove_view("model-0-2")  # the stage released
    assert not view.exists()
    assert cache.materialize("model-0-2", {"layer_0.bin": sha}) == view
    cache.materialize("model-0-2", {"layer_0.bin": sha})  # rebuilt over the one there
    assert (view / "layer_0.bin").read_bytes() == cache.path(sha).read_bytes()


def test_a_cache_an_earlier_version_marked_read_only_is_tidied_and_evicted_on_windows(tmp_path: Path,
                                                                                       windows: None) -> None:
    cache = ShardCache(tmp_path, 1 << 20, FakeClock(1_000_000.0, tick=1.0))
    old, corrupted = shard(cache, 1), shard(cache, 2)
    view = cache.materialize("model-0-2", {"layer_0.bin": old})
    for sha in (old, corrupted):
        cache.path(sha).chmod(0o444)  # as blobs were published before
    cache.tidy()  # the last run's views go
    assert not view.exists()
    cache.path(corrupted).chmod(0o644)
    cache.path(corrupted).write_bytes(b"changed on disk")
    cache.path(corrupted).chmod(0o444)
    assert cache.drop_corrupted([corrupted]) == [corrupted]
    assert cache.evict(0) == [old]
    assert not any((tmp_path / "blobs").iterdir())


def test_blobs_stay_read_only_off_windows(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 1 << 20, FakeClock(1_000_000.0, tick=1.0))
    assert stat.S_IMODE(cache.path(shard(cache, 1)).stat().st_mode) == 0o444
