"""A shard cache whose disk refused a write is named in the agent's status (fleet ls, the plan's left-out lines)
until the trouble has passed: before, only the deploy it failed said so, and `fleet ls` listed the PC as
available with nothing to say."""

from __future__ import annotations

import errno
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent.cache_health import CacheHealth
from deskfleet.agent.core import AgentCore, CommandError
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.wire import ReleaseStage, Role, ShardChunk, StatusReport, StatusRequest
from tests.agent.test_core import _host_tiny_stage, core, handle  # noqa: F401 (the core fixture)

FULL = OSError(errno.ENOSPC, "No space left on device")


class FakeDisk:
    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, folder: Path) -> int:
        return self.free


def test_a_full_disk_is_noted_until_it_has_room_for_what_was_refused(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    disk = FakeDisk(3_000_000)
    health = CacheHealth(cache, disk)
    assert health.note() == ""
    health.refused(FULL, 250_000_000)
    assert health.note() == (f"shard cache disk full: 3.00 MB free at {cache.root}, a shard being received needed "
                             "0.25 GB more (free space there, or lower cache_limit_bytes)")
    disk.free = 249_999_999
    assert health.note().startswith("shard cache disk full: 0.25 GB free")
    disk.free = 250_000_000  # freed: the note goes, and stays gone
    assert health.note() == ""
    disk.free = 0
    assert health.note() == ""


def test_a_write_that_goes_through_ends_the_note(tmp_path: Path) -> None:
    # a lowered cache_limit_bytes makes room by eviction: the disk's free space alone never says so
    health = CacheHealth(ShardCache(tmp_path / "cache", 1 << 30), FakeDisk(0))
    health.refused(FULL, 10)
    assert health.note()
    health.stored()
    assert health.note() == ""


def test_an_unwritable_cache_is_noted_from_the_start_and_until_it_can_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    why: list[str | None] = ["Read-only file system"]
    monkeypatch.setattr(cache, "unwritable", lambda: why[0])
    health = CacheHealth(cache, FakeDisk(1 << 40))
    assert health.note() == f"shard cache {cache.root} not writable (Read-only file system): it takes no new stage"
    why[0] = None  # remounted read-write
    assert health.note() == ""
    health.refused(OSError(errno.EACCES, "Permission denied"), 10)  # a permission taken away later
    why[0] = "Permission denied"
    assert "not writable (Permission denied)" in health.note()


def test_another_os_error_is_not_taken_for_disk_trouble(tmp_path: Path) -> None:
    health = CacheHealth(ShardCache(tmp_path / "cache", 1 << 30), FakeDisk(0))
    health.refused(OSError(errno.EIO, "Input/output error"), 10)
    assert health.note() == ""


def _status(agent: AgentCore) -> StatusReport:
    report = handle(agent, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport)
    return report


def test_the_agent_reports_a_shard_the_disk_could_not_take_in_its_status_detail(
        core: AgentCore, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    disk = FakeDisk(2_000)
    core.cache_health = CacheHealth(core.cache, disk)
    data = bytes(range(256)) * 40
    digest = hashlib.sha256(data).hexdigest()
    handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data[:4000]))
    write = core.cache.write

    def disk_full(*args: object) -> int:
        raise FULL

    monkeypatch.setattr(core.cache, "write", disk_full)
    with pytest.raises(CommandError):
        handle(core, Role.CONTROLLER, ShardChunk(digest, 4000, len(data), data[4000:]))
    assert _status(core).detail == (f"shard cache disk full: 0.00 MB free at {core.cache.root}, a shard being "
                                    "received needed 0.01 MB more (free space there, or lower cache_limit_bytes)")
    monkeypatch.setattr(core.cache, "write", write)  # the next deploy's chunk goes through: the note goes
    disk.free = 0
    handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data))  # from 0: what arrived was given back
    assert _status(core).detail == ""


def test_a_stage_the_disk_could_not_take_is_noted_and_paused_comes_first(
        core: AgentCore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    assignment = _host_tiny_stage(core, tiny_export)
    handle(core, Role.CONTROLLER, ReleaseStage(assignment.stage))
    core.cache_health = CacheHealth(core.cache, FakeDisk(0))

    def disk_full(*args: object) -> Path:
        raise FULL

    monkeypatch.setattr(core.cache, "materialize_manifest", disk_full)
    with pytest.raises(CommandError):
        handle(core, Role.CONTROLLER, assignment)
    detail = _status(core).detail
    assert detail.startswith("shard cache disk full: 0.00 MB free") and "a shard being received needed" in detail
    core.settings = replace(core.settings, paused=True)
    assert _status(core).detail.startswith("paused in its settings (paused: true); shard cache disk full")
