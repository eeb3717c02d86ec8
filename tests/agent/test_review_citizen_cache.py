"""The shard cache on an employee's disk over weeks: an admin who lowers `cache_limit_bytes` to give the disk
back got it back only when a deploy next sent this PC a shard (eviction ran only to make room for one), which
for a PC the plans leave out is never; and view folders left by a stopped agent (whose stages a restarted
agent does not hold) stayed, counting against the limit where they hold copies."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentService
from deskfleet.agent.shard_cache import ShardCache
from tests.agent.test_service_certificates import joined

SHARD = 4000


def _fill(data_dir: Path, count: int) -> list[str]:
    cache = ShardCache(AgentPaths.resolve(data_dir).shard_dir, 1 << 30)
    shas = []
    for index in range(count):
        source = data_dir / f"shard{index}.bin"
        source.write_bytes(bytes([index]) * SHARD)
        shas.append(cache.import_file(source))
        os.utime(cache.path(shas[-1]), (1000.0 + index, 1000.0 + index))  # the first the least recently used
    return shas


def _start_briefly(service: AgentService) -> None:
    async def briefly() -> None:
        asyncio.get_running_loop().call_later(0.2, service.stop)
        await service.run()

    asyncio.run(briefly())


def _set_cache_limit(data_dir: Path, limit: int) -> None:
    settings = AgentPaths.resolve(data_dir).settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"format_version": 1, "cache_limit_bytes": limit}))


def test_a_lowered_cache_limit_is_met_when_the_agent_starts(tmp_path: Path) -> None:
    joined(tmp_path)
    shas = _fill(tmp_path, 5)
    _set_cache_limit(tmp_path, 2 * SHARD + 100)
    service = joined(tmp_path)  # the agent restarted with the admin's new limit
    _start_briefly(service)
    usage = service.core.cache.usage()
    assert usage.used_bytes <= 2 * SHARD + 100, usage
    assert [service.core.cache.has(sha) for sha in shas] == [False, False, False, True, True]  # LRU went first


def test_view_folders_of_a_previous_run_are_removed_at_start(tmp_path: Path) -> None:
    joined(tmp_path)
    shas = _fill(tmp_path, 2)
    views = AgentPaths.resolve(tmp_path).shard_dir / "views"
    ShardCache(AgentPaths.resolve(tmp_path).shard_dir, 1 << 30).materialize("model-0-4", {"a.bin": shas[0]})
    copied = views / "model-4-8"  # a copy (a file system without hard links), and a build a crash cut short
    copied.mkdir()
    (copied / "b.bin").write_bytes(b"x" * SHARD)
    (copied / ".view.json").write_text(json.dumps({"b.bin": shas[1]}))
    (views / ".model-8-12.k2j4").mkdir()
    (views / ".model-8-12.k2j4" / "c.bin").write_bytes(b"y" * SHARD)
    service = joined(tmp_path)
    _start_briefly(service)
    assert sorted(os.listdir(views)) == []
    assert service.core.cache.usage().used_bytes == 2 * SHARD  # the shards themselves stay
