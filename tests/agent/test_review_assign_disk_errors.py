"""An assignment that fails on a disk error (the shard cache's disk full, a folder it may not write) is
answered like any other failed assignment: refused naming the stage, its files unpinned and its view
removed, and a stage being served left as it was."""

from __future__ import annotations

import errno
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent.core import AgentCore, CommandError
from deskfleet.common.model_spec import Manifest
from deskfleet.common.wire import AssignStage, ErrorCode, ReleaseStage, Role, ShardChunk, ShardComplete, StageReady
from tests.agent.test_core import _host_tiny_stage, core, handle  # noqa: F401 (the core fixture)


def _disk_full(view_name: str, manifest: Manifest, names: object) -> Path:
    raise OSError(errno.ENOSPC, "No space left on device")


def _unpinned(agent: AgentCore, assignment: AssignStage) -> bool:
    agent.cache.evict(0)
    return not any(agent.cache.has(entry.sha256) for entry in assignment.manifest)


def test_a_disk_error_while_preparing_a_stage_is_refused_and_unpins_its_files(
        core: AgentCore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    assignment = _host_tiny_stage(core, tiny_export)
    handle(core, Role.CONTROLLER, ReleaseStage(assignment.stage))  # its files stay cached, unpinned
    monkeypatch.setattr(core.cache, "materialize_manifest", _disk_full)
    with pytest.raises(CommandError, match=r"cannot host tiny_1-0-\d+: the disk of this PC's shard cache .* is "
                                           r"full \(No space left on device\): free space there") as refused:
        handle(core, Role.CONTROLLER, assignment)
    assert refused.value.code is ErrorCode.DISK_FULL
    assert assignment.stage not in core.stages
    assert _unpinned(core, assignment)  # nothing hosted keeps them: the next deploy may evict them


def test_a_disk_error_during_a_rebuild_leaves_the_hosted_stage_as_it_was(
        core: AgentCore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    assignment = _host_tiny_stage(core, tiny_export)
    hosted = core.stages[assignment.stage]
    monkeypatch.setattr(core.cache, "materialize_manifest", _disk_full)
    with pytest.raises(CommandError, match="No space left on device"):
        handle(core, Role.CONTROLLER, replace(assignment, kv_cache="f32"))
    assert core.stages[assignment.stage] is hosted
    assert set(core.cache._pins) == {hosted.cache_key}
    monkeypatch.undo()
    assert isinstance(handle(core, Role.CONTROLLER, replace(assignment, kv_cache="f32")), StageReady)


def test_a_shard_that_the_disk_cannot_take_is_refused_naming_it_and_what_arrived_is_given_back(
        core: AgentCore, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # what had arrived stayed, and kept the employee's disk full until the next deploy of that stage, if any
    data = bytes(range(256)) * 40
    digest = hashlib.sha256(data).hexdigest()
    handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data[:4000]))
    write = core.cache.write

    def disk_full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core.cache, "write", disk_full)
    with pytest.raises(CommandError, match=rf"cannot store shard {digest[:12]}… \(bytes 4000 to 10240 of 10240\): "
                                           r"the disk of this PC's shard cache .* is full \(No space left on device\)"
                                           r".*pause this PC.*\. The 4000 bytes received of the shard were "
                                           "deleted, to give the disk back: the next deploy sends it whole") as refused:
        handle(core, Role.CONTROLLER, ShardChunk(digest, 4000, len(data), data[4000:]))
    assert refused.value.code is ErrorCode.DISK_FULL
    assert core.cache.partial_offset(digest) is None and core.cache.usage().used_bytes == 0
    monkeypatch.setattr(core.cache, "write", write)  # space freed: the next deploy sends it from the start
    handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data))
    handle(core, Role.CONTROLLER, ShardComplete(digest))
    assert core.cache.has(digest)


def test_a_shard_cache_that_cannot_be_written_is_named_with_the_fix(
        core: AgentCore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # a read-only cache: the refusal was "internal: [Errno 30] Read-only file system", naming no folder, from an
    # unhandled error where a cached shard was marked used, with a traceback in the agent's log
    import deskfleet.agent.shard_cache as shard_cache

    assignment = _host_tiny_stage(core, tiny_export)
    handle(core, Role.CONTROLLER, ReleaseStage(assignment.stage))

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    assert core.cache.unwritable() is None
    monkeypatch.setattr(shard_cache.os, "utime", read_only)  # marking a shard used: best effort, never a refusal
    monkeypatch.setattr(shard_cache.tempfile, "NamedTemporaryFile", read_only)
    assert core.cache.unwritable() == "Read-only file system"  # what the agent warns of when it starts
    monkeypatch.setattr(core.cache, "materialize_manifest", read_only)
    with pytest.raises(CommandError, match=r"cannot host tiny_1-0-\d+: this PC's shard cache .* is not writable "
                                           r"\(Read-only file system\): make it writable, or start the agent with a "
                                           r"--data-dir on a writable disk"):
        handle(core, Role.CONTROLLER, assignment)


def test_an_agent_that_starts_on_a_cache_it_cannot_write_says_so(
        core: AgentCore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    # it started without a word, and the first deploy failed with an unnamed "Read-only file system"
    from deskfleet.agent.service import AgentService

    service = AgentService.__new__(AgentService)
    service.core = core
    service._prepare_cache()
    assert not any("cannot be written" in record.getMessage() for record in caplog.records)
    monkeypatch.setattr(core.cache, "unwritable", lambda: "Read-only file system")
    service._prepare_cache()
    assert any(f"the shard cache {core.cache.root} cannot be written (Read-only file system)" in record.getMessage()
               for record in caplog.records)


def test_the_chunks_after_a_refused_one_are_dropped_unanswered_until_the_stream_resumes(
        core: AgentCore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    # a deploy sends a shard's chunks without waiting: on a full disk each later chunk was refused again ("out of
    # order"), one warning in the agent's log and one Error back per megabyte
    from typing import cast

    from deskfleet.agent.link import Link
    from deskfleet.common.wire import ShardHave, ShardQuery
    from tests.agent.test_core import RecordingLink

    data = bytes(range(256)) * 40
    digest = hashlib.sha256(data).hexdigest()
    chunks = [ShardChunk(digest, offset, len(data), data[offset:offset + 2048]) for offset in range(0, len(data), 2048)]
    write = core.cache.write

    def disk_full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    link = RecordingLink(Role.CONTROLLER)  # one deploy's link, both rounds
    core._controller_links.append(cast(Link, link))

    async def deploy(sends: list[object]) -> RecordingLink:
        link.sent.clear()
        for message in sends:
            try:
                reply = await core.handle(cast(Link, link), message)  # type: ignore[arg-type]
            except CommandError as refusal:
                reply = refusal.code
            if reply is not None:
                link.sent.append(reply)  # type: ignore[arg-type]
        return link

    import asyncio

    handle(core, Role.CONTROLLER, chunks[0])
    monkeypatch.setattr(core.cache, "write", disk_full)
    asyncio.run(deploy([*chunks[1:], ShardComplete(digest)]))
    assert link.sent == [ErrorCode.DISK_FULL]  # once, for the first chunk the disk refused
    assert not any("out of order" in record.getMessage() for record in caplog.records)
    monkeypatch.setattr(core.cache, "write", write)  # space freed: the deploy's next round sends it from the start
    asyncio.run(deploy([ShardQuery((digest,)), *chunks, ShardComplete(digest)]))  # (what arrived was given back)
    assert core.cache.has(digest) and link.sent == [ShardHave((), ())]


def test_a_stage_larger_than_the_disk_has_room_for_is_refused_before_a_byte_arrives(
        core: AgentCore) -> None:  # noqa: F811
    # it was received until the disk was full, and the fix said was to raise cache_limit_bytes
    from deskfleet.common.wire import ShardQuery
    from tests.agent.test_shard_cache import FakeDisk

    core.cache._disk = FakeDisk(100_000_000, 6_000_000)  # 5 MB kept for the PC's user: 1 MB of room
    digest = "ab" * 32
    with pytest.raises(CommandError, match=r"the stage's 1 files need 2000000 bytes more, which the cache cannot hold "
                                           r"\(the disk under the cache .* has 6000000 bytes free and keeps 5000000 of "
                                           r"them for this PC's user; .*\): nothing was evicted; free space on that "
                                           r"disk, or pause this PC") as refused:
        handle(core, Role.CONTROLLER, ShardQuery((digest,), (2_000_000,)))
    assert refused.value.code is ErrorCode.DISK_FULL and core.cache.usage().used_bytes == 0
