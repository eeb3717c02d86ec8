"""Eviction against builds in progress: the agent builds a stage's view (`materialize`, in a worker thread)
while another deploy's chunks arrive on the event loop and evict to make room. That eviction removed the
half-built view folder (its index is written last) or the shards being linked into it, and the stage being
assigned failed with a bare "No such file or directory". Now what a build or a hosted stage holds is never
evicted; a shard that could only fit by evicting it is refused as the cache being full, naming the holders.

The two operations are interleaved deterministically: the build is stopped inside its first hard link
(a gate on os.link) until the test has run the eviction, then let go.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

import pytest

from deskfleet.agent import shard_cache
from deskfleet.agent.core import AgentCore, CommandError
from deskfleet.agent.link import Link
from deskfleet.agent.shard_cache import CacheFull, ShardCache
from deskfleet.common.model_spec import MANIFEST_NAME, load_manifest
from deskfleet.common.wire import (
    AssignStage,
    ErrorCode,
    ManifestEntry,
    Precision,
    Role,
    ShardChunk,
    ShardComplete,
    StageReady,
    StageRef,
)
from tests.agent.test_core import FakeLink, core, handle  # noqa: F401 (the core fixture)
from tests.fake_clock import FakeClock

WAIT_S = 30.0  # only a bound for a broken run: the events, not this, order the two operations


class LinkGate:
    """os.link that stops its first call (the build's first file) until the test opens the gate."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real = real
        self.reached = threading.Event()
        self.opened = threading.Event()
        self._stopped = False

    def __call__(self, *args: object, **kwargs: object) -> None:
        if not self._stopped:
            self._stopped = True
            self.reached.set()
            if not self.opened.wait(WAIT_S):
                raise AssertionError("the test never opened the gate")
        self.real(*args, **kwargs)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[LinkGate]:
    gate = LinkGate(os.link)
    monkeypatch.setattr(shard_cache.os, "link", gate)
    yield gate
    gate.opened.set()  # a failed test must not leave the build's thread waiting


@pytest.fixture
def worker() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as pool:
        yield pool


def blob(seed: int, size: int) -> tuple[bytes, str]:
    data = random.Random(seed).randbytes(size)
    return data, hashlib.sha256(data).hexdigest()


def fill(cache: ShardCache, data: bytes, sha: str) -> None:
    cache.receive(ShardChunk(sha, 0, len(data), data))
    cache.complete(sha)


def build_stopped_in_its_first_link(pool: ThreadPoolExecutor, gate: LinkGate, cache: ShardCache, view: str,
                                    files: dict[str, str]) -> Future[Path]:
    building = pool.submit(cache.materialize, view, files)
    assert gate.reached.wait(WAIT_S), "the build never reached its first link"
    return building


def test_an_eviction_while_a_view_is_built_leaves_the_half_built_folder_alone(
        tmp_path: Path, gate: LinkGate, worker: ThreadPoolExecutor) -> None:
    cache = ShardCache(tmp_path, 3000, FakeClock(1_000_000.0, tick=1.0))
    (weights, weights_sha), (old, old_sha) = blob(1, 1000), blob(2, 1000)
    fill(cache, old, old_sha)  # another model's shard, unpinned and least recently used
    fill(cache, weights, weights_sha)
    cache.pin("stage-0-2", [weights_sha])  # as the agent core does before it builds the view
    building = build_stopped_in_its_first_link(worker, gate, cache, "stage-0-2", {"w.bin": weights_sha})

    new, new_sha = blob(3, 1500)
    fill(cache, new, new_sha)  # another deploy: makes room by evicting the old shard (and views using it)
    gate.opened.set()

    view = building.result(WAIT_S)  # the eviction removed the staging folder: FileNotFoundError here
    assert (view / "w.bin").read_bytes() == weights
    assert cache.has(new_sha) and cache.has(weights_sha) and not cache.has(old_sha)
    assert sorted(path.name for path in (tmp_path / "views").iterdir()) == ["stage-0-2"]  # no staging left


def test_the_shards_a_build_links_are_held_and_a_shard_needing_their_room_is_refused_naming_why(
        tmp_path: Path, gate: LinkGate, worker: ThreadPoolExecutor) -> None:
    cache = ShardCache(tmp_path, 2000, FakeClock(1_000_000.0, tick=1.0))
    weights, weights_sha = blob(4, 1000)
    fill(cache, weights, weights_sha)  # nobody pins it: only the build in progress uses it
    building = build_stopped_in_its_first_link(worker, gate, cache, "stage-0-2", {"w.bin": weights_sha})

    new, new_sha = blob(5, 1500)
    with pytest.raises(CacheFull, match=r"1000 pinned by .*stage builds in progress.*nothing was evicted"):
        cache.begin(new_sha, len(new))
    assert cache.has(weights_sha)
    gate.opened.set()
    view = building.result(WAIT_S)  # the shard was evicted under it: FileNotFoundError here
    assert (view / "w.bin").read_bytes() == weights

    # the build done and nothing pinning them, the shard and its view make room as before
    assert cache.begin(new_sha, len(new)) == 0
    assert not cache.has(weights_sha) and not view.exists()


def test_copies_in_a_held_view_count_as_held_and_nothing_is_evicted_for_a_shard_that_cannot_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A view whose files are copies (no hard links on that disk) of pinned shards stays with them; counting
    # its copies as room that eviction makes evicted other shards first, then refused anyway.
    def no_links(*args: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    cache = ShardCache(tmp_path, 3000, FakeClock(1_000_000.0, tick=1.0))
    (weights, weights_sha), (old, old_sha) = blob(6, 1000), blob(7, 500)
    fill(cache, weights, weights_sha)
    fill(cache, old, old_sha)
    cache.pin("stage-0-2", [weights_sha])
    monkeypatch.setattr(shard_cache.os, "link", no_links)
    view = cache.materialize("stage-0-2", {"w.bin": weights_sha})
    assert cache.usage().used_bytes == 2500  # the shard, its copy, the other shard
    with pytest.raises(CacheFull, match="nothing was evicted"):
        cache.begin(blob(8, 1200)[1], 1200)
    assert cache.has(old_sha) and cache.has(weights_sha) and (view / "w.bin").read_bytes() == weights
    assert cache.begin(blob(9, 600)[1], 600) == 0  # what fits still evicts the unpinned shard it needs
    assert not cache.has(old_sha) and (view / "w.bin").read_bytes() == weights


def _push_tiny_stage(core: AgentCore, tiny_export: Path) -> AssignStage:  # noqa: F811
    """Send the tiny model's shards (the whole model, one stage) and return its assignment, not yet sent."""
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    names = [MANIFEST_NAME, *(name for stem in manifest.stage_ir_stems(0, layers) for name in manifest.ir_files(stem))]
    entries = []
    for name in names:
        data = (tiny_export / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data))
        handle(core, Role.CONTROLLER, ShardComplete(digest))
        entries.append(ManifestEntry(name, digest, len(data)))
    return AssignStage(StageRef("tiny@1", 0, layers), True, True, "CPU", Precision.DEVICE_DEFAULT, None,
                       tuple(entries), None)


def test_a_deploy_that_evicts_while_the_agent_builds_a_stage_does_not_break_the_build(
        core: AgentCore, tiny_export: Path, gate: LinkGate) -> None:  # noqa: F811
    assignment = _push_tiny_stage(core, tiny_export)
    old, old_sha = blob(10, 4000)
    fill(core.cache, old, old_sha)
    os.utime(core.cache.path(old_sha), (1, 1))  # another model's shard, the least recently used
    new, new_sha = blob(11, 5000)
    core.cache.limit_bytes = core.cache.usage().used_bytes - len(old) + len(new)  # the new one needs its room
    assigning, deploying = FakeLink(Role.CONTROLLER), FakeLink(Role.CONTROLLER)

    async def interleaved() -> object:
        assigned = asyncio.create_task(core.handle(cast(Link, assigning), assignment))
        assert await asyncio.to_thread(gate.reached.wait, WAIT_S), "the assignment never built its view"
        await core.handle(cast(Link, deploying), ShardChunk(new_sha, 0, len(new), new[:1000]))
        gate.opened.set()
        return await assigned

    assert isinstance(asyncio.run(interleaved()), StageReady)  # was: cannot host ...: No such file or directory
    assert assignment.stage in core.stages and not core.cache.has(old_sha)
    assert core.cache.partial_offset(new_sha) == 1000


def test_a_chunk_that_held_shards_leave_no_room_for_is_refused_as_a_full_cache(
        core: AgentCore, tiny_export: Path) -> None:  # noqa: F811
    assignment = _push_tiny_stage(core, tiny_export)
    assert isinstance(handle(core, Role.CONTROLLER, assignment), StageReady)
    core.cache.limit_bytes = core.cache.usage().used_bytes + 100
    data, digest = blob(12, 1000)
    with pytest.raises(CommandError, match=r"pinned by hosted stages.*nothing was evicted; raise cache_limit_bytes in "
                                           r"the agent's settings \(and restart it\), or pause this PC") as refused:
        handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data))
    # was shard_mismatch ("send it again"), then out_of_memory (the PC's memory is not what is short)
    assert refused.value.code is ErrorCode.DISK_FULL
    assert all(core.cache.has(entry.sha256) for entry in assignment.manifest)
    view = core.cache.root / "views" / core.stages[assignment.stage].cache_key
    assert view.is_dir() and not core.cache.have([digest]).partial
