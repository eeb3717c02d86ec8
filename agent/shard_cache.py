"""The agent's shard cache: files stored by sha256, received in resumable chunks, verified before use.

Layout under the cache root (AgentPaths.shard_dir):
    blobs/<sha256>                 complete, verified shards (read-only to everyone else; not on Windows,
                                   whose read-only attribute refuses deleting a file and its hard links)
    partial/<sha256>-<size>.part   shards being received; their length is the resume offset
    views/<name>/                  a model folder for agent/stage.py: the files a stage needs, named as
                                   the manifest names them (hard links to blobs, copies where links
                                   fail), plus manifest.json and .view.json (name -> sha256)

How the agent core drives it, for one shard the controller pushes:
    have(sha256s)            -> ShardHave: what the controller may skip, and where to resume the rest
    receive(chunk) ...       -> bytes held so far; chunks must arrive in order, starting at that offset
    complete(sha256)         -> verifies the sha256 and publishes the blob (atomic rename)
then `materialize(...)` for the stage's files and `pin(owner, ...)` while a stage uses them.

Disk use is bounded by `limit_bytes`, and by the disk itself: the cache never leaves its disk with less than
DISK_FLOOR_BYTES free (DISK_FLOOR_SHARE of a small disk). Before a shard is received, least recently used unpinned
shards (and stale partial files) are evicted to make room; when pinned shards alone leave no room, CacheFull.
Eviction never removes what is held: shards pinned by an owner, the shards a `materialize` or `complete` in
progress is using (held for the call's duration), or a view folder being built. The agent calls
`complete` and `materialize` in a worker thread (they hash or copy whole files) while chunks of another
deploy arrive on the event loop and evict: a lock orders every change of the cache's files and pins, and
is not held while files are hashed, linked or copied. An eviction that ran while a view was being built
removed the half-built folder (it had no index yet), and the stage being assigned failed with a bare
"No such file or directory".
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from deskfleet.common.atomic_file import cannot_make_file_in
from deskfleet.common.model_spec import MANIFEST_NAME, Manifest, sha256_of
from deskfleet.common.wire import ShardChunk, ShardHave, ShardOffset

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_VIEW_INDEX = ".view.json"
_HOLDERS = "hosted stages, deploys and stage builds in progress"
# What the shard cache leaves free on its disk, whatever cache_limit_bytes allows (50 GiB by default): the PC is an
# employee's. A deploy of a stage larger than the disk had free filled it to its last byte and left it full (the
# shards received so far stayed), and every later plan chose the PC again.
DISK_FLOOR_BYTES = 2 * 1024**3
DISK_FLOOR_SHARE = 0.05  # of the disk's size, where that is less (a small disk, or a test's)


class ShardCacheError(Exception):
    """A request the cache cannot honour; the message says which shard and why."""


class ShardMismatch(ShardCacheError):
    """A received shard's bytes do not hash to its sha256; the partial file was deleted (resend from 0)."""


class CacheFull(ShardCacheError):
    """Pinned or held shards leave no room for this one under the cache limit, or under what its disk has free
    (`by_disk`: the disk's floor, not cache_limit_bytes, bounded it)."""

    def __init__(self, message: str, by_disk: bool = False) -> None:
        super().__init__(message)
        self.by_disk = by_disk


@dataclass(frozen=True)
class _Room:
    """What the cache may hold now: `bytes`, and in words what bounds it (its limit, or its disk's free space)."""

    bytes: int
    bound: str
    by_disk: bool


def disk_space(folder: Path) -> tuple[int, int]:
    """The size of the disk under `folder`, and the bytes it has free for this process."""
    usage = shutil.disk_usage(folder)
    return usage.total, usage.free


@dataclass(frozen=True)
class CacheUsage:
    """Disk the cache uses now, in bytes (complete shards + partial files + view copies)."""

    used_bytes: int
    limit_bytes: int
    shard_count: int
    partial_count: int
    pinned_bytes: int


class ShardCache:
    """Content-addressed shard store in `root`. `clock` (wall seconds) orders the LRU; tests inject one."""

    def __init__(self, root: Path, limit_bytes: int, clock: Callable[[], float] = time.time,
                 disk: Callable[[Path], tuple[int, int]] = disk_space) -> None:
        """`disk` (the disk's size and free bytes under a folder) is injectable for tests."""
        if limit_bytes <= 0:
            raise ValueError(f"cache limit must be positive, got {limit_bytes}")
        self.root = root
        self.limit_bytes = limit_bytes
        self._clock = clock
        self._disk = disk
        self._pins: dict[str, frozenset[str]] = {}
        # what each deploy in progress reserved (owner -> sha256 -> size): a stage's shards not yet begun take no
        # disk, but the room they need is promised to that deploy, so another deploy's reservation counts it
        self._reserved: dict[str, dict[str, int]] = {}
        self._lock = threading.RLock()  # see the module's docstring: eviction against builds in worker threads
        self._building: set[str] = set()  # view staging folders being filled: eviction leaves them alone
        self._hold_ids = itertools.count(1)
        self._last_mark: float | None = None  # the time _touch last marked a file used (see _newest_mark)
        for folder in (self._blobs, self._partials, self._views):
            folder.mkdir(parents=True, exist_ok=True)

    # Public methods: queries

    def has(self, sha256: str) -> bool:
        """True when the shard is held whole and verified."""
        return (self._blobs / _checked_sha(sha256)).is_file()

    def path(self, sha256: str) -> Path:
        """The verified blob's path (do not write to it); marks it used. ShardCacheError if absent."""
        blob = self._blobs / _checked_sha(sha256)
        if not blob.is_file():
            raise ShardCacheError(f"shard {sha256[:12]}… is not in the cache")
        self._touch(blob)
        return blob

    def partial_offset(self, sha256: str) -> int | None:
        """Bytes held of a shard being received, or None when none are."""
        part = self._find_partial(_checked_sha(sha256))
        return part.stat().st_size if part is not None else None

    def reserve(self, owner: str, sizes: Mapping[str, int]) -> None:
        """Keep these shards (sha256 -> size: a stage about to be received) from eviction for `owner`, and
        CacheFull before anything is evicted when the ones not yet held could not fit even by evicting every
        other unpinned shard: a stage too big for the cache is refused whole, not after evicting its own
        first files and other models' shards."""
        with self._lock:
            missing = self._not_begun(sizes)
            promised = self._not_begun({sha256: size for other, reserved in self._reserved.items() if other != owner
                                        for sha256, size in reserved.items() if sha256 not in sizes})
            self.pin(owner, sizes)
            room = self._room()
            try:
                self._refuse_if_eviction_cannot_fit(missing + promised, "the stage", room)
            except CacheFull:
                self.unpin(owner)
                others = f", and {promised} more bytes promised to other deploys in progress" if promised else ""
                raise CacheFull(f"the stage's {len(sizes)} files need {missing} bytes more, which the cache cannot "
                                f"hold ({room.bound}; {self.usage().pinned_bytes} bytes are pinned by "
                                f"{_HOLDERS}{others}): nothing was evicted", room.by_disk) from None
            self._reserved[owner] = dict(sizes)

    def drop_corrupted(self, sha256s: Iterable[str]) -> list[str]:
        """Re-hash the named blobs (the disk may have changed them since they were verified) and delete those
        whose bytes no longer match their name, so that the next ShardQuery reports them missing and the
        controller sends them again; returns the ones deleted. Slow: for a stage that failed to load."""
        dropped = []
        for sha256 in sha256s:
            blob = self._blobs / _checked_sha(sha256)
            if blob.is_file() and sha256_of(blob) != sha256:
                with self._lock:
                    _delete(blob, missing_ok=True)
                dropped.append(sha256)
                logger.warning("dropped shard %s… from the cache: its bytes changed on disk", sha256[:12])
        return dropped

    def have(self, sha256s: Iterable[str]) -> ShardHave:
        """The answer to a ShardQuery: which shards are complete, and resume offsets of partial ones."""
        complete, partial = [], []
        for sha256 in sha256s:
            if self.has(sha256):
                complete.append(sha256)
            elif (offset := self.partial_offset(sha256)) is not None:
                partial.append(ShardOffset(sha256, offset))
        return ShardHave(tuple(complete), tuple(partial))

    def usage(self) -> CacheUsage:
        with self._lock:
            return self._usage()

    def _usage(self) -> CacheUsage:
        pinned = self._pinned()
        blobs = [(entry.name, entry.stat().st_size) for entry in os.scandir(self._blobs)]
        # a partial shard holds its whole declared size (_reserved_bytes), pinned while its deploy runs
        partials = [(entry.name[:64], _reserved_bytes(Path(entry.path))) for entry in os.scandir(self._partials)]
        return CacheUsage(
            used_bytes=sum(size for _, size in blobs) + sum(size for _, size in partials) + self._view_copy_bytes(),
            limit_bytes=self.limit_bytes,
            shard_count=len(blobs),
            partial_count=len(partials),
            pinned_bytes=sum(size for name, size in (*blobs, *partials) if name in pinned),
        )

    def room_for_new_bytes(self) -> int:
        """The bytes of new shards the cache could take now: its room (its limit, or its disk's free space less
        what it keeps for the PC's user) less what it holds that no eviction frees (the shards of hosted stages,
        deploys and builds in progress) and what deploys in progress were promised and have not begun. The agent
        reports it, so that a plan leaves out a PC whose disk has no room for a stage instead of sending it shards
        it must refuse. Shards held but unpinned count as room: a stage that needs them keeps them, and evicting
        them makes room for one that does not."""
        with self._lock:
            promised = self._not_begun({sha256: size for reserved in self._reserved.values()
                                        for sha256, size in reserved.items()})
            return max(0, self._room().bytes - self._held_past_eviction() - promised)

    def _not_begun(self, sizes: Mapping[str, int]) -> int:
        """The bytes of the shards in `sizes` (sha256 -> size) neither held nor begun (call with the lock held)."""
        return sum(size for sha256, size in sizes.items()
                   if not self.has(sha256) and self._find_partial(sha256) is None)

    # Public methods: receiving

    def begin(self, sha256: str, total_size: int) -> int:
        """Start or resume receiving a shard; returns the offset the sender must send from.

        Makes room for the rest of the shard first (evicting LRU unpinned shards), or raises CacheFull.
        """
        _checked_sha(sha256)
        if total_size < 0:
            raise ShardCacheError(f"shard {sha256[:12]}…: negative size {total_size}")
        with self._lock:
            return self._begin(sha256, total_size)

    def _begin(self, sha256: str, total_size: int) -> int:
        if self.has(sha256):
            return total_size
        part = self._find_partial(sha256)
        if part is not None and not part.name.endswith(f"-{total_size}.part"):
            logger.warning("shard %s… restarted with a new size %d; dropping %s", sha256[:12], total_size, part)
            part.unlink()
            part = None
        offset = part.stat().st_size if part is not None else 0
        # a partial shard holds its whole declared size from its first byte (usage counts it so): a shard
        # begun now needs room for all of it, a resumed one has it already. Counting only the bytes held let
        # interleaved uploads of several shards fill the disk past the limit (4 shards: 4x).
        self._make_room(total_size if part is None else 0, keep=sha256)
        if part is None:
            part = self._partials / f"{sha256}-{total_size}.part"
            part.touch()
        self._touch(part)
        return offset

    def drop_partial(self, sha256: str) -> int:
        """Delete what was received of a shard (its disk filled as it came: the bytes are given back to the PC,
        and the next deploy sends it from 0); returns the bytes dropped."""
        with self._lock:
            part = self._find_partial(_checked_sha(sha256))
            if part is None:
                return 0
            held = part.stat().st_size
            _delete(part, missing_ok=True)
            return held

    def write(self, sha256: str, offset: int, data: bytes) -> int:
        """Append `data` at `offset` to a shard begun with `begin`; returns the bytes now held.

        `offset` must equal the bytes already held (chunks in order, no gaps, no resends), and the chunk
        must not run past the size given to `begin`; otherwise ShardCacheError and nothing is written.
        """
        _checked_sha(sha256)
        with self._lock:
            return self._write(sha256, offset, data)

    def _write(self, sha256: str, offset: int, data: bytes) -> int:
        part = self._find_partial(sha256)
        if part is None:
            raise ShardCacheError(f"shard {sha256[:12]}… was not begun (call begin first)")
        held = part.stat().st_size
        total = _partial_size(part)
        if offset != held:
            raise ShardCacheError(f"shard {sha256[:12]}…: chunk at offset {offset} is out of order; "
                                  f"{held} bytes are held, send from there")
        if offset + len(data) > total:
            raise ShardCacheError(f"shard {sha256[:12]}…: chunk ends at {offset + len(data)}, "
                                  f"past the shard's size {total}")
        with part.open("r+b") as stream:
            stream.seek(offset)
            stream.write(data)
        self._touch(part)
        return held + len(data)

    def receive(self, chunk: ShardChunk) -> int:
        """`begin` (if needed) then `write` one wire chunk; returns the bytes now held. A chunk that would begin the
        shard (none of it held, or held at another size) must start at offset 0; one that does not is refused
        before `begin`, which evicts to make room and reserves the shard's whole size: a refused chunk changes
        nothing (before, one out of order evicted other shards and left an empty partial counted at full size)."""
        with self._lock:
            if self.has(chunk.sha256):
                return chunk.total_size
            part = self._find_partial(chunk.sha256)
            if part is None or _partial_size(part) != chunk.total_size:
                if chunk.offset != 0:
                    held = "none of it is held" if part is None else \
                        f"the {_partial_size(part)}-byte shard held so far is another size than {chunk.total_size}"
                    raise ShardCacheError(f"shard {chunk.sha256[:12]}…: chunk at offset {chunk.offset} is out of "
                                          f"order; {held}, send from 0")
                self.begin(chunk.sha256, chunk.total_size)
            return self.write(chunk.sha256, chunk.offset, chunk.data)

    def complete(self, sha256: str) -> Path:
        """Verify a fully received shard and publish it; returns the blob's path.

        ShardCacheError if bytes are missing; ShardMismatch (partial deleted) if the hash differs.
        """
        with self._hold((sha256,), "completing"):  # not evicted while it is hashed, outside the lock
            with self._lock:
                if self.has(sha256):
                    return self.path(sha256)
                part = self._find_partial(sha256)
                if part is None:
                    raise ShardCacheError(f"shard {sha256[:12]}… was never begun")
                held, total = part.stat().st_size, _partial_size(part)
                if held != total:
                    raise ShardCacheError(f"shard {sha256[:12]}… is incomplete: {held} of {total} bytes held")
            with part.open("rb") as stream:
                os.fsync(stream.fileno())
            digest = sha256_of(part)
            with self._lock:
                if digest != sha256:
                    part.unlink(missing_ok=True)
                    # what was received before a restart is part of it: the damage may be this PC's disk's
                    raise ShardMismatch(f"shard {sha256[:12]}… as received does not match its sha256 (its bytes hash "
                                        f"to {digest[:12]}…: damaged on the way, or on this PC's disk while it was "
                                        "received); it was discarded, send it again from offset 0")
                blob = self._blobs / sha256
                os.replace(part, blob)
                if sys.platform != "win32":  # there the read-only attribute refuses deleting it and its views' links
                    blob.chmod(0o444)
                self._touch(blob)
        logger.info("shard %s… verified (%d bytes)", sha256[:12], total)
        return blob

    def import_file(self, source: Path) -> str:
        """Copy a local file into the cache (hashing it); returns its sha256."""
        digest = sha256_of(source)
        with self._hold((digest,), "importing"):
            if not self.has(digest):
                size = source.stat().st_size
                self.begin(digest, size)
                part = self._find_partial(digest)
                assert part is not None  # begin made it, and the hold keeps it
                shutil.copyfile(source, part)
                self.complete(digest)
        return digest

    # Public methods: using

    def pin(self, owner: str, sha256s: Iterable[str]) -> None:
        """Protect these shards from eviction for `owner` (e.g. a stage id), replacing owner's pins (and any room
        `reserve` promised it)."""
        pinned = frozenset(_checked_sha(sha256) for sha256 in sha256s)
        with self._lock:
            self._pins[owner] = pinned
            self._reserved.pop(owner, None)

    def unpin(self, owner: str) -> None:
        with self._lock:
            self._pins.pop(owner, None)
            self._reserved.pop(owner, None)

    def materialize(self, view_name: str, files: Mapping[str, str], manifest: Manifest | None = None) -> Path:
        """A folder named `view_name` holding `files` (file name -> sha256), for agent/stage.py.

        Every shard must be complete (ShardCacheError names the first missing one). With `manifest`, its
        manifest.json is written too. The folder is rebuilt from scratch each call. While it is built, its
        shards and the folder are held (eviction leaves them alone); once it returns, only pins keep them:
        call `pin` first so eviction cannot remove the shards (and the view) under a stage that compiles them.
        """
        _check_plain_name("view name", view_name)
        for name in sorted(files):
            _check_plain_name("file name", name)
            if name in (MANIFEST_NAME, _VIEW_INDEX):
                raise ShardCacheError(f"file name {name!r} is reserved in a model view")
        with self._hold(files.values(), f"view {view_name}"):
            with self._lock:
                blobs = {name: self.path(sha256) for name, sha256 in sorted(files.items())}
                staging = Path(tempfile.mkdtemp(prefix=f".{view_name}.", dir=self._views))
                self._building.add(staging.name)
            try:
                for name, blob in blobs.items():
                    try:
                        os.link(blob, staging / name)
                    except OSError:
                        logger.warning("cannot hard-link %s into a view; copying it", blob)
                        shutil.copyfile(blob, staging / name)
                if manifest is not None:
                    (staging / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
                (staging / _VIEW_INDEX).write_text(json.dumps(dict(files), sort_keys=True), encoding="utf-8")
                with self._lock:
                    target = self._views / view_name
                    if target.exists():
                        _delete_tree(target)
                    os.replace(staging, target)
            except BaseException:
                with self._lock:
                    _delete_tree(staging, ignore_errors=True)
                raise
            finally:
                with self._lock:
                    self._building.discard(staging.name)
        return target

    def materialize_manifest(self, view_name: str, manifest: Manifest, names: Iterable[str]) -> Path:
        """`materialize` the manifest's files `names` (e.g. a stage's xml+bin pairs) with its manifest.json."""
        files = {}
        for name in names:
            entry = manifest.files.get(name)
            if entry is None:
                raise ShardCacheError(f"{name} is not listed in the manifest of {manifest.model_name}")
            files[name] = entry.sha256
        return self.materialize(view_name, files, manifest)

    def remove_view(self, view_name: str) -> None:
        with self._lock:
            _delete_tree(self._views / view_name, ignore_errors=True)

    def unwritable(self) -> str | None:
        """Why nothing can be written into the cache (a read-only disk, no permission), or None when a file can."""
        return cannot_make_file_in(self._partials)

    def tidy(self) -> list[str]:
        """For an agent that starts, holding no stage yet: remove every view folder (a previous run's stages,
        which this run does not hold; an assignment builds its view again) and evict least recently used
        shards down to the limit (an admin may have lowered it; eviction otherwise runs only to make room for a
        shard received, which a PC the plans leave out never is). Returns the shards evicted. Call it with the
        data dir's lock held: another agent's hosted stages would lose their files."""
        with self._lock:
            for view in list(self._views.iterdir()):
                if view.name in self._building:
                    continue
                if view.is_dir() and not view.is_symlink():
                    _delete_tree(view, ignore_errors=True)
                else:
                    _delete(view, missing_ok=True)
            used = self._usage().used_bytes
            if used <= self.limit_bytes:
                return []
            evicted = self._evict(self.limit_bytes)
            logger.info("the shard cache held %d bytes, over its limit of %d: evicted %d shard(s)", used,
                        self.limit_bytes, len(evicted))
            return evicted

    def evict(self, target_bytes: int) -> list[str]:
        """Evict LRU unpinned shards until usage <= target_bytes (or nothing evictable is left).

        Returns the evicted shards' sha256s; views that used them are removed (never one being built).
        """
        with self._lock:
            return self._evict(target_bytes)

    def _evict(self, target_bytes: int) -> list[str]:
        pinned = self._pinned()
        candidates = [entry for entry in (*self._blobs.iterdir(), *self._partials.iterdir())
                      if entry.name[:64] not in pinned]
        candidates.sort(key=lambda entry: entry.stat().st_mtime)
        used = self._usage().used_bytes
        evicted = []
        for entry in candidates:
            if used <= target_bytes:
                break
            used -= _reserved_bytes(entry)
            _delete(entry)
            evicted.append(entry.name[:64])
            logger.info("evicted shard %s… from the cache", entry.name[:12])
        self._remove_views_using(set(evicted))
        return evicted

    # Private methods

    @property
    def _blobs(self) -> Path:
        return self.root / "blobs"

    @property
    def _partials(self) -> Path:
        return self.root / "partial"

    @property
    def _views(self) -> Path:
        return self.root / "views"

    def _pinned(self) -> set[str]:
        """Every shard some owner pins, or a call in progress holds (call with the lock held)."""
        return set().union(*self._pins.values()) if self._pins else set()

    @contextmanager
    def _hold(self, sha256s: Iterable[str], what: str) -> Iterator[None]:
        """Pin `sha256s` for the duration of a call that uses them outside the lock (hashing, linking)."""
        owner = f"\0{what}#{next(self._hold_ids)}"
        self.pin(owner, sha256s)
        try:
            yield
        finally:
            self.unpin(owner)

    def _find_partial(self, sha256: str) -> Path | None:
        return next(self._partials.glob(f"{sha256}-*.part"), None)

    def _touch(self, path: Path) -> None:
        """Mark a file used now (eviction takes the least recently used first). Best effort: on a cache that cannot
        be written (a read-only disk) this failed first, with a bare errno; what must write there (a shard
        received, a stage's folder) is refused instead, naming the cache and its fix."""
        # newer than every mark before, whatever the clock did: a clock stepped back an hour made the shard in use
        # the oldest, and the next eviction took it instead of one unused for an hour (a clock that ran ahead and was
        # set right, the other way round)
        now = max(self._clock(), self._newest_mark() + 0.001)
        self._last_mark = now
        try:
            os.utime(path, (now, now))
        except OSError as error:
            logger.debug("cannot mark %s used: %s", path, error)

    def _newest_mark(self) -> float:
        """The latest time a file was marked used: this process's last mark, or at first the newest file's."""
        if self._last_mark is None:
            self._last_mark = max((entry.stat().st_mtime for entry in (*os.scandir(self._blobs),
                                                                        *os.scandir(self._partials))), default=0.0)
        return self._last_mark

    def _make_room(self, needed: int, keep: str) -> None:
        room = self._room()
        if self.usage().used_bytes + needed <= room.bytes:
            return
        self.pin("\0receiving", (keep,))
        try:
            # before evicting anything: refusing loses nothing
            self._refuse_if_eviction_cannot_fit(needed, f"shard {keep[:12]}…", room)
            self.evict(room.bytes - needed)
        finally:
            self.unpin("\0receiving")
        usage = self._usage()
        if usage.used_bytes + needed > room.bytes:
            raise CacheFull(f"shard {keep[:12]}… needs {needed} more bytes; {room.bound}, and {usage.used_bytes} are "
                            f"held ({usage.pinned_bytes} pinned by {_HOLDERS})", room.by_disk)

    def _room(self) -> _Room:
        """What the cache may hold now: its limit, or less where its disk has less free than the limit leaves
        room for (the cache's own files count as room: evicting them frees the disk). A disk whose space cannot
        be read bounds nothing."""
        limit = _Room(self.limit_bytes, f"the cache's limit is {self.limit_bytes} bytes (cache_limit_bytes)", False)
        try:
            size, free = self._disk(self.root)
        except OSError as error:
            logger.debug("cannot read the free space under the shard cache %s: %s", self.root, error)
            return limit
        floor = min(DISK_FLOOR_BYTES, int(size * DISK_FLOOR_SHARE))
        on_disk = self._bytes_on_disk()
        if on_disk + free - floor >= self.limit_bytes:
            return limit
        return _Room(max(on_disk + free - floor, 0), f"the disk under the cache ({self.root}) has {free} bytes free "
                     f"and keeps {floor} of them for this PC's user", True)

    def _bytes_on_disk(self) -> int:
        """What the cache's files take on its disk now: its shards, the bytes received of partial ones (which
        usage counts at their whole size), and the view files that are copies."""
        return sum(entry.stat().st_size for entry in (*os.scandir(self._blobs), *os.scandir(self._partials))) + \
            self._view_copy_bytes()

    def _held_past_eviction(self) -> int:
        """What the cache would still hold after evicting every unpinned shard and the view copies that would go
        with them: the copies in views of pinned shards or views being built stay, so they count."""
        pinned = self._pinned()
        evictable = sum(_reserved_bytes(entry) for entry in (*self._blobs.iterdir(), *self._partials.iterdir())
                        if entry.name[:64] not in pinned)
        return self._usage().used_bytes - evictable - self._view_copy_bytes(pinned)

    def _refuse_if_eviction_cannot_fit(self, needed: int, what: str, room: _Room) -> None:
        """CacheFull when even evicting every unpinned shard leaves too little (_held_past_eviction)."""
        usage = self._usage()
        if self._held_past_eviction() + needed > room.bytes:
            raise CacheFull(f"{what} needs {needed} more bytes; {room.bound}, {usage.pinned_bytes} pinned by "
                            f"{_HOLDERS}, so even evicting every other shard would not make room: nothing was "
                            "evicted", room.by_disk)

    def _remove_views_using(self, evicted: set[str]) -> None:
        if not evicted:
            return
        for view in self._views.iterdir():
            if view.name in self._building:  # its index is written last: a folder being built has none yet
                continue
            index = _view_index(view)
            if not index or evicted.intersection(index.values()):
                _delete_tree(view, ignore_errors=True)

    def _goes_with_unpinned_shards(self, view: Path, pinned: set[str]) -> bool:
        """Whether evicting every shard not in `pinned` would remove `view` (as _remove_views_using does)."""
        if view.name in self._building:
            return False
        index = _view_index(view)
        return not index or not pinned.issuperset(index.values())

    def _view_copy_bytes(self, pinned: set[str] | None = None) -> int:
        """Bytes of view files that are copies, not links (links cost nothing beyond their blob); with
        `pinned`, only those of views that evicting every shard not in `pinned` would remove."""
        total = 0
        for view in self._views.iterdir():
            if pinned is not None and not self._goes_with_unpinned_shards(view, pinned):
                continue
            try:
                entries = list(view.iterdir()) if view.is_dir() else []
                for entry in entries:
                    status = entry.stat()
                    if status.st_nlink == 1 and entry.name not in (MANIFEST_NAME, _VIEW_INDEX):
                        total += status.st_size
            except FileNotFoundError:  # a file of a view being built went while this looked (a failed build)
                continue
        return total


def _delete(path: Path, missing_ok: bool = False) -> None:
    """Delete a cache file, also one Windows refuses to delete because its read-only attribute is set (a blob
    that an earlier deskfleet marked read-only with chmod 0o444, or a view's hard link to one)."""
    try:
        path.unlink(missing_ok=missing_ok)
    except PermissionError:
        if sys.platform != "win32" or not _clear_read_only(path):
            raise
        path.unlink(missing_ok=missing_ok)


def _delete_tree(folder: Path, ignore_errors: bool = False) -> None:
    """shutil.rmtree, with the read-only attribute of the files in `folder` cleared first on Windows (see _delete):
    rmtree left a view of read-only blobs where it was, and the next materialize of that view failed."""
    if sys.platform == "win32":
        for parent, _, names in os.walk(folder):
            for name in names:
                _clear_read_only(Path(parent) / name)
    shutil.rmtree(folder, ignore_errors=ignore_errors)


def _clear_read_only(path: Path) -> bool:
    """Make a file writable where it is not (on Windows: clear its read-only attribute); whether it was changed."""
    try:
        if os.lstat(path).st_mode & stat.S_IWRITE:
            return False
        os.chmod(path, stat.S_IREAD | stat.S_IWRITE)
    except OSError:
        return False
    return True


def _view_index(view: Path) -> dict[str, str]:
    """A view's file name -> sha256, or {} when unreadable (a stale folder eviction may remove)."""
    try:
        index = json.loads((view / _VIEW_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict) or not all(isinstance(sha256, str) for sha256 in index.values()):
        return {}
    return index


def _checked_sha(sha256: str) -> str:
    if _SHA256.fullmatch(sha256) is None:
        raise ShardCacheError(f"{sha256!r} is not a sha256 (64 lowercase hex characters)")
    return sha256


def _check_plain_name(what: str, name: str) -> None:
    if _PLAIN_NAME.fullmatch(name) is None or ".." in name:
        raise ShardCacheError(f"{what} {name!r} must be a plain file name (letters, digits, . _ -)")


def _partial_size(part: Path) -> int:
    return int(part.name[65:-len(".part")])


def _reserved_bytes(entry: Path) -> int:
    """What a cache file counts against the limit: a complete shard its size, a partial one its declared size."""
    return _partial_size(entry) if entry.suffix == ".part" else entry.stat().st_size
