"""ShardCache: resumable in-order chunks, verification, views for stages, LRU eviction under a limit."""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

import pytest

from deskfleet.agent.shard_cache import CacheFull, ShardCache, ShardCacheError, ShardMismatch
from deskfleet.common.model_spec import Manifest, load_manifest
from deskfleet.common.wire import ShardChunk, ShardOffset
from tests.fake_clock import FakeClock


def blob(seed: int, size: int) -> tuple[bytes, str]:
    data = random.Random(seed).randbytes(size)
    return data, hashlib.sha256(data).hexdigest()


def fill(cache: ShardCache, data: bytes, sha: str, chunk: int = 100) -> None:
    for offset in range(0, len(data), chunk):
        cache.receive(ShardChunk(sha, offset, len(data), data[offset:offset + chunk]))
    cache.complete(sha)


def test_chunks_resume_and_verify(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 10_000, FakeClock(1_000_000.0, tick=1.0))
    data, sha = blob(1, 1000)
    assert cache.begin(sha, 1000) == 0
    assert cache.write(sha, 0, data[:300]) == 300
    assert cache.have([sha]).partial == (ShardOffset(sha, 300),)
    # A new cache over the same dir (agent restart) resumes at the same offset.
    cache = ShardCache(tmp_path, 10_000, FakeClock(1_000_000.0, tick=1.0))
    assert cache.partial_offset(sha) == 300 and cache.begin(sha, 1000) == 300
    assert cache.write(sha, 300, data[300:]) == 1000
    path = cache.complete(sha)
    assert path.read_bytes() == data and cache.has(sha) and cache.path(sha) == path
    assert cache.have([sha]).complete == (sha,) and cache.partial_offset(sha) is None
    assert cache.begin(sha, 1000) == 1000  # held: nothing to send


def test_out_of_order_overflow_and_unbegun_chunks_are_rejected(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 10_000, FakeClock(1_000_000.0, tick=1.0))
    data, sha = blob(2, 500)
    with pytest.raises(ShardCacheError, match="not begun"):
        cache.write(sha, 0, data)
    cache.begin(sha, 500)
    cache.write(sha, 0, data[:100])
    with pytest.raises(ShardCacheError, match="out of order; 100 bytes are held"):
        cache.write(sha, 200, data[200:300])
    with pytest.raises(ShardCacheError, match="out of order"):
        cache.write(sha, 0, data[:100])  # a resend
    with pytest.raises(ShardCacheError, match="past the shard's size 500"):
        cache.write(sha, 100, data[100:] + b"extra")
    with pytest.raises(ShardCacheError, match="incomplete: 100 of 500"):
        cache.complete(sha)
    assert cache.partial_offset(sha) == 100  # nothing rejected was written
    with pytest.raises(ShardCacheError, match="not a sha256"):
        cache.has("../etc/passwd")


def test_corrupted_shard_is_discarded(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 10_000, FakeClock(1_000_000.0, tick=1.0))
    data, sha = blob(3, 200)
    cache.begin(sha, 200)
    cache.write(sha, 0, bytes(200))
    with pytest.raises(ShardMismatch, match="as received does not match its sha256"):
        cache.complete(sha)
    assert not cache.has(sha) and cache.partial_offset(sha) is None
    fill(cache, data, sha)
    assert cache.has(sha)


def test_size_change_restarts_the_partial(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 10_000, FakeClock(1_000_000.0, tick=1.0))
    _, sha = blob(4, 100)
    cache.begin(sha, 100)
    cache.write(sha, 0, b"x" * 50)
    assert cache.receive(ShardChunk(sha, 0, 80, b"y" * 10)) == 10


def test_a_chunk_that_would_begin_a_shard_past_offset_0_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    # beginning the 800-byte shard would evict the one held: a chunk at offset 5 is refused before that
    cache = ShardCache(tmp_path, 1000, FakeClock(1_000_000.0, tick=1.0))
    held, held_sha = blob(6, 400)
    fill(cache, held, held_sha)
    before = cache.usage()
    _, sha = blob(7, 800)
    with pytest.raises(ShardCacheError, match="chunk at offset 5 is out of order; none of it is held, send from 0"):
        cache.receive(ShardChunk(sha, 5, 800, b"z" * 10))
    assert cache.has(held_sha) and cache.partial_offset(sha) is None and cache.usage() == before
    # a shard held so far at another size: refused the same, and its partial kept
    cache.begin(sha, 500)
    cache.write(sha, 0, b"y" * 50)
    with pytest.raises(ShardCacheError, match="the 500-byte shard held so far is another size than 800, send from 0"):
        cache.receive(ShardChunk(sha, 50, 800, b"z" * 10))
    assert cache.partial_offset(sha) == 50 and cache.has(held_sha)


def test_lru_eviction_skips_pinned_and_recently_used(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 3000, FakeClock(1_000_000.0, tick=1.0))
    shards = [blob(10 + index, 1000) for index in range(3)]
    for data, sha in shards:
        fill(cache, data, sha)
    assert cache.usage().used_bytes == 3000 and cache.usage().shard_count == 3
    cache.pin("stage-a", [shards[0][1]])
    view = cache.materialize("uses-2", {"w.bin": shards[2][1]})  # a use: shard 2 is now the newest...
    cache.path(shards[1][1])  # ...until shard 1 is used after it
    data, sha = blob(20, 1000)
    fill(cache, data, sha)
    assert not cache.has(shards[2][1]) and cache.has(shards[0][1]) and cache.has(shards[1][1])
    assert not view.exists()  # a view over an evicted shard goes with it
    assert cache.usage().pinned_bytes == 1000
    cache.pin("stage-a", [shards[0][1], shards[1][1], sha])
    with pytest.raises(CacheFull, match="3000 pinned"):
        cache.begin(blob(21, 10)[1], 10)
    cache.unpin("stage-a")
    assert cache.begin(blob(21, 10)[1], 10) == 0


def test_limit_smaller_than_a_shard(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 100, FakeClock(1_000_000.0, tick=1.0))
    with pytest.raises(CacheFull, match="limit is 100"):
        cache.begin(blob(5, 101)[1], 101)


def test_materialize_names_files_as_the_manifest_does(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 10_000, FakeClock(1_000_000.0, tick=1.0))
    xml, xml_sha = blob(30, 300)
    weights, bin_sha = blob(31, 400)
    fill(cache, xml, xml_sha)
    fill(cache, weights, bin_sha)
    view = cache.materialize("tiny-0-2", {"layer_000.xml": xml_sha, "layer_000.bin": bin_sha})
    assert (view / "layer_000.xml").read_bytes() == xml and (view / "layer_000.bin").read_bytes() == weights
    assert (view / "layer_000.bin").stat().st_ino == cache.path(bin_sha).stat().st_ino  # a link, no copy
    assert cache.usage().used_bytes == 700
    view = cache.materialize("tiny-0-2", {"layer_000.xml": xml_sha})  # rebuilt from scratch
    assert not (view / "layer_000.bin").exists()
    with pytest.raises(ShardCacheError, match="plain file name"):
        cache.materialize("v", {"../x": xml_sha})
    with pytest.raises(ShardCacheError, match="not in the cache"):
        cache.materialize("v", {"a": blob(32, 1)[1]})
    cache.remove_view("tiny-0-2")
    assert not view.exists()


def test_materialize_manifest_gives_a_folder_the_stage_can_load(tmp_path: Path) -> None:
    from deskfleet.common.model_spec import FileEntry, ModelSpec, WeightFormat

    cache = ShardCache(tmp_path / "cache", 10_000, FakeClock(1_000_000.0, tick=1.0))
    files = {}
    for index, name in enumerate(("rope.xml", "rope.bin", "embed.xml", "embed.bin")):
        data, sha = blob(40 + index, 50)
        fill(cache, data, sha)
        files[name] = FileEntry(sha, 50)
    spec = ModelSpec("llama", 1, 8, 2, 1, 4, 16, 32, 64, None, (1,), "default", False)
    files |= {"layer_000.bin": FileEntry("0" * 64, 0), "head.bin": FileEntry("0" * 64, 0)}  # planned as empty
    manifest = Manifest("toy", spec, WeightFormat.F32, files, (), (0,), 50, 0)
    view = cache.materialize_manifest("toy-0-1", manifest, ["rope.xml", "rope.bin"])
    assert load_manifest(view) == manifest
    assert sorted(path.name for path in view.iterdir()) == [".view.json", "manifest.json", "rope.bin", "rope.xml"]
    with pytest.raises(ShardCacheError, match=r"head\.xml is not listed"):
        cache.materialize_manifest("toy-0-1", manifest, ["head.xml"])


def test_import_file(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 10_000, FakeClock(1_000_000.0, tick=1.0))
    source = tmp_path / "f.bin"
    data, sha = blob(50, 123)
    source.write_bytes(data)
    assert cache.import_file(source) == sha and cache.path(sha).read_bytes() == data


def test_a_shard_that_cannot_fit_is_refused_before_anything_is_evicted(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, 3000, FakeClock(1_000_000.0, tick=1.0))
    shards = [blob(30 + index, 1000) for index in range(3)]
    for data, sha in shards:
        fill(cache, data, sha)
    cache.pin("stage-a", [shards[0][1]])
    with pytest.raises(CacheFull, match="nothing was evicted"):
        cache.begin(blob(40, 2500)[1], 2500)  # 2500 + the 1000 pinned > 3000, however much is evicted
    with pytest.raises(CacheFull, match="nothing was evicted"):
        cache.receive(ShardChunk(blob(41, 10)[1], 0, 2**62, b"x"))  # an absurd announced size
    assert all(cache.has(sha) for _, sha in shards)
    assert cache.begin(blob(42, 2000)[1], 2000) == 0  # what can fit still evicts the unpinned shards it needs
    assert cache.has(shards[0][1]) and not (cache.has(shards[1][1]) and cache.has(shards[2][1]))


def test_interleaved_shards_reserve_their_whole_size_and_cannot_pass_the_limit(tmp_path: Path) -> None:
    # Begun with a first byte each, then filled: counting only the bytes held let 4 shards of the limit's size
    # each land on disk (4x the limit). A partial shard now holds room for all of itself from the start.
    limit = 4000
    cache = ShardCache(tmp_path, limit, FakeClock(1_000_000.0, tick=1.0))
    first, first_sha = blob(1, 3000)
    second, second_sha = blob(2, 3000)
    assert cache.begin(first_sha, len(first)) == 0
    cache.write(first_sha, 0, first[:1])
    assert cache.usage().used_bytes == 3000
    assert cache.begin(second_sha, len(second)) == 0  # the first (unpinned, older) partial is evicted for it
    assert cache.partial_offset(first_sha) is None
    cache.pin("stage", (second_sha,))
    third, third_sha = blob(3, 3000)
    with pytest.raises(CacheFull):
        cache.begin(third_sha, len(third))
    cache.write(second_sha, 0, second)
    cache.complete(second_sha)
    assert cache.usage().used_bytes == 3000 <= limit
    assert cache.begin(second_sha, len(second)) == len(second)  # resuming a complete shard needs no room


def test_a_stage_too_big_for_the_cache_is_refused_whole_before_anything_is_evicted(tmp_path: Path) -> None:
    # Pushed file by file, such a stage evicted another model's shard and its own first files, then failed
    # with "did not keep ...". Reserved whole, it is refused at once; one that fits keeps its files.
    cache = ShardCache(tmp_path, 1000, FakeClock(1_000_000.0, tick=1.0))
    other, other_sha = blob(1, 300)
    fill(cache, other, other_sha)
    stage = [blob(10 + index, 400) for index in range(3)]
    with pytest.raises(CacheFull, match=r"need 1200 bytes more.*nothing was evicted"):
        cache.reserve("deploy", {sha: len(data) for data, sha in stage})
    assert cache.has(other_sha)
    fitting = stage[:2]
    cache.reserve("deploy", {sha: len(data) for data, sha in fitting})  # 800 bytes: the other shard must go
    for data, sha in fitting:
        fill(cache, data, sha)
    assert all(cache.has(sha) for _, sha in fitting) and not cache.has(other_sha)
    cache.unpin("deploy")


def test_two_deploys_reservations_count_each_others_and_pinned_partials_count_as_pinned(tmp_path: Path) -> None:
    # two deploys of 400 bytes each into a 600-byte cache were both accepted, and the second refused only at its
    # first chunk, saying "0 pinned" beside the first deploy's partial shard
    cache = ShardCache(tmp_path, 600, FakeClock(1_000_000.0, tick=1.0))
    first, first_sha = blob(1, 400)
    second, second_sha = blob(2, 400)
    cache.reserve("deploy-1", {first_sha: len(first)})
    with pytest.raises(CacheFull, match=r"need 400 bytes more.*and 400 more bytes promised to other deploys in "
                                        r"progress\): nothing was evicted"):
        cache.reserve("deploy-2", {second_sha: len(second)})
    cache.receive(ShardChunk(first_sha, 0, len(first), first[:10]))
    assert cache.usage().pinned_bytes == 400  # the partial, at its whole size
    cache.unpin("deploy-1")  # that deploy ended (its partial stays, unpinned, to resume from)
    assert cache.usage().pinned_bytes == 0
    cache.reserve("deploy-2", {second_sha: len(second)})  # room now: the first's partial may be evicted
    fill(cache, second, second_sha)
    assert cache.has(second_sha)


class FakeDisk:
    """A disk of `size` bytes with `free` of them free besides what the cache's files take (they count as used)."""

    def __init__(self, size: int, free: int) -> None:
        self.size, self.free = size, free

    def __call__(self, folder: Path) -> tuple[int, int]:
        return self.size, self.free


def test_the_cache_leaves_its_disk_a_floor_free_whatever_its_limit(tmp_path: Path) -> None:
    # A deploy of a stage larger than the disk had free filled it to its last byte (cache_limit_bytes is 50 GiB by
    # default), and left it full. A 100 kB disk keeps 5% (5 kB) for the PC's user: 3 kB free leaves no room.
    disk = FakeDisk(100_000, 8_000)
    cache = ShardCache(tmp_path, 50 * 2**30, FakeClock(1_000_000.0, tick=1.0), disk)
    data, sha = blob(40, 2_000)
    cache.reserve("deploy", {sha: 2_000})  # 8 kB free - 5 kB kept: 3 kB of room
    fill(cache, data, sha)
    cache.unpin("deploy")
    disk.free = 6_000  # the 2 kB shard took its share of it
    big, big_sha = blob(41, 4_000)
    # its own shard counts as room (evicting it frees the disk): 2 + 6 - 5 = 3 kB, less than 4 kB
    with pytest.raises(CacheFull, match=re.escape(f"the stage's 1 files need 4000 bytes more, which the cache cannot "
                                                  f"hold (the disk under the cache ({tmp_path}) has 6000 bytes free "
                                                  "and keeps 5000 of them for this PC's user; 0 bytes are pinned")
                       ) as refused:
        cache.reserve("deploy", {big_sha: 4_000})
    assert refused.value.by_disk and cache.has(sha)  # nothing was evicted
    with pytest.raises(CacheFull, match="has 6000 bytes free and keeps 5000"):
        cache.begin(big_sha, 4_000)
    assert cache.partial_offset(big_sha) is None and cache.has(sha)
    disk.free = 7_000  # 2 + 7 - 5 = 4 kB: room, once the old shard is evicted
    cache.reserve("deploy", {big_sha: 4_000})
    fill(cache, big, big_sha)
    assert cache.has(big_sha) and not cache.has(sha)


def test_a_large_disk_keeps_two_gib_and_the_limit_bounds_first(tmp_path: Path) -> None:
    disk = FakeDisk(10**12, 2 * 2**30 + 1_500)  # 5% of a TB is 50 GB: the floor is 2 GiB
    cache = ShardCache(tmp_path, 1_000, FakeClock(1_000_000.0, tick=1.0), disk)
    _, sha = blob(42, 1_200)
    with pytest.raises(CacheFull, match=r"the cache's limit is 1000 bytes \(cache_limit_bytes\)") as refused:
        cache.reserve("deploy", {sha: 1_200})  # the limit is the tighter bound
    assert not refused.value.by_disk
    cache = ShardCache(tmp_path, 50 * 2**30, FakeClock(1_000_000.0, tick=1.0), disk)
    with pytest.raises(CacheFull, match="keeps 2147483648 of them") as refused:
        cache.reserve("deploy", {blob(43, 1_600)[1]: 1_600})
    assert refused.value.by_disk
    cache.reserve("deploy", {sha: 1_200})


def test_a_disk_whose_space_cannot_be_read_bounds_nothing(tmp_path: Path) -> None:
    def unreadable(folder: Path) -> tuple[int, int]:
        raise OSError(5, "Input/output error")

    cache = ShardCache(tmp_path, 10_000, FakeClock(1_000_000.0, tick=1.0), unreadable)
    data, sha = blob(44, 3_000)
    cache.reserve("deploy", {sha: 3_000})
    fill(cache, data, sha)
    assert cache.has(sha)


def test_the_room_for_new_shards_counts_unpinned_shards_as_room_and_takes_off_pinned_and_promised(
        tmp_path: Path) -> None:
    # What the agent reports for a plan to leave out a PC without room (StatusReport.shard_room_bytes): a plan sent
    # such a PC a stage, and the deploy failed whole at its start on that PC's refusal.
    disk = FakeDisk(100_000, 20_000)  # keeps 5 kB: 15 kB of room beside the limit's 12 kB
    cache = ShardCache(tmp_path, 12_000, FakeClock(1_000_000.0, tick=1.0), disk)
    assert cache.room_for_new_bytes() == 12_000  # the limit bounds
    data, sha = blob(45, 3_000)
    cache.reserve("deploy", {sha: 3_000})
    assert cache.room_for_new_bytes() == 9_000  # promised to the deploy, not begun
    fill(cache, data, sha)
    assert cache.room_for_new_bytes() == 9_000  # held and pinned: no eviction frees it
    cache.unpin("deploy")
    assert cache.room_for_new_bytes() == 12_000  # unpinned: evicting it makes room
    cache.pin("stage", (sha,))
    disk.free = 8_000  # another program filled the disk: 3 (its own) + 8 - 5 = 6 kB, 3 of them pinned
    assert cache.room_for_new_bytes() == 3_000
    disk.free = 1_000
    assert cache.room_for_new_bytes() == 0  # never negative
    # what it says is what reserve takes: 3 kB fits, 3 kB and a byte does not
    disk.free = 8_000
    cache.reserve("next", {blob(46, 3_000)[1]: 3_000})
    cache.unpin("next")
    with pytest.raises(CacheFull):
        cache.reserve("next", {blob(47, 3_001)[1]: 3_001})


@pytest.mark.parametrize("step", [-3600.0, 86_400.0])
def test_a_stepped_clock_leaves_the_least_recently_used_order_as_the_uses_were(tmp_path: Path, step: float) -> None:
    # A clock stepped back an hour marked the shard used now older than one unused for an hour, and the next eviction
    # took the shard in use (from an exploratory test of clocks); a clock that ran a day ahead, the other way round.
    clock = FakeClock(1_000_000.0, tick=1.0)
    cache = ShardCache(tmp_path, 3000, clock)
    shards = [blob(30 + index, 1000) for index in range(3)]
    for data, sha in shards:
        fill(cache, data, sha)
    if step > 0:
        clock.now += step  # shard 0 used while the clock runs ahead...
        cache.path(shards[0][1])
        clock.now -= step  # ...then the clock is set right, and shard 1 used
        cache.path(shards[1][1])
    else:
        cache.path(shards[1][1])  # shard 1 used, then the clock steps back, and shard 0 used
        clock.now += step
        cache.path(shards[0][1])
    used_last = shards[1][1] if step > 0 else shards[0][1]
    data, sha = blob(40, 1000)
    fill(cache, data, sha)  # evicts one: shard 2, the least recently used, whatever the clock said
    assert not cache.has(shards[2][1]) and cache.has(shards[0][1]) and cache.has(shards[1][1])
    fill(cache, *blob(41, 1000))  # and next the one used first of the two
    assert cache.has(used_last) and cache.has(sha)
    # a cache opened again goes on from its newest file's mark
    again = ShardCache(tmp_path, 3000, FakeClock(1_000_000.0 - 7200, tick=1.0))
    again.path(used_last)
    fill(again, *blob(42, 1000))
    assert again.has(used_last)
