"""The memory limit the agent's control groups put on it (Linux), so that what it reports free is what it may use.

An IT department that runs the agent as a service may cap its memory (systemd's `MemoryMax=` on the unit, or a
slice's, a container's limit). psutil reads the whole machine's memory, so an agent capped at 4 GiB on a 32 GiB PC
would report the PC's 20 GiB free, be given a stage of 10 GiB, and be killed by the kernel at its first prompt.

Every control group from the agent's own up to the root may hold a limit; the tightest counts. What is left under
a limit is the limit less the group's working set: its usage less the page cache the kernel can drop
(`inactive_file`), as the kernel itself reclaims that before it kills. Both cgroup versions are read: v2 (the
unified tree: `memory.max`, `memory.current`, `memory.stat`) and v1 (the memory controller's own tree:
`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat`'s `total_inactive_file`). Anything that cannot be
read is no limit: the machine's own figures stand.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

NO_LIMIT_FROM = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned int64, 9223372036854771712


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest limit over the agent's control groups: `limit_bytes`, and `available_bytes` left under it."""

    limit_bytes: int
    available_bytes: int


def read_memory_limit(proc_root: Path = Path("/proc"), sysfs_root: Path = Path("/sys")) -> MemoryLimit | None:
    """The tightest memory limit on this process's control groups, or None where there is none (or none can be
    read: not Linux, no cgroup file system, a file the agent may not read, a group name that is not UTF-8)."""
    try:
        return _read_memory_limit(proc_root, sysfs_root)
    except (OSError, ValueError):  # is_dir() raises PermissionError (AppArmor, SELinux); a name UnicodeDecodeError
        return None


def _read_memory_limit(proc_root: Path, sysfs_root: Path) -> MemoryLimit | None:
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits: list[MemoryLimit] = []
    mounts = _cgroup_mounts(proc_root, sysfs_root)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: "0::/user.slice/..."
            root, mounted_at = mounts.get(_V2, ("/", sysfs_root / "fs" / "cgroup"))
            found = _tightest(mounted_at, _below(path, root), _v2_limit)
        elif "memory" in controllers.split(","):  # v1: "4:memory:/..."
            root, mounted_at = mounts.get(_V1_MEMORY, ("/", sysfs_root / "fs" / "cgroup" / "memory"))
            found = _tightest(mounted_at, _below(path, root), _v1_limit)
        else:
            continue
        if found is not None:
            limits.append(found)
    return min(limits, key=lambda limit: limit.available_bytes, default=None)


_V2, _V1_MEMORY = "cgroup2", "memory"


def _cgroup_mounts(proc_root: Path, sysfs_root: Path) -> dict[str, tuple[str, Path]]:
    """Where the cgroup v2 tree and the v1 memory controller are mounted, from /proc/self/mountinfo: kind -> (the
    part of the hierarchy mounted, the mount point). The v1 memory controller may be mounted with others
    (`/sys/fs/cgroup/cpu,memory`) or outside /sys (`/cgroup/memory` on old systems); a mount point under /sys is
    taken under `sysfs_root` (a test's tree). Empty where mountinfo cannot be read: the usual places are tried."""
    try:
        lines = (proc_root / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return {}
    mounts: dict[str, tuple[str, Path]] = {}
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if len(fields) < separator + 4 or len(fields) < 5:
            continue
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        kind = _V2 if fstype == "cgroup2" else _V1_MEMORY if fstype == "cgroup" and "memory" in options else None
        if kind is None or kind in mounts:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        mounted_at = sysfs_root / point.removeprefix("/sys/") if point.startswith("/sys/") else Path(point)
        mounts[kind] = (root, mounted_at)
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are written as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _below(path: str, root: str) -> str:
    """The group at `path` (as /proc/self/cgroup names it) within a mount of the hierarchy's `root` subtree."""
    if root in ("", "/"):
        return path
    inside = PurePosixPath(path)
    try:
        return "/" + str(inside.relative_to(root)).removeprefix(".")
    except ValueError:  # a group outside the mounted part (a container's view): the mount's own root
        return "/"


def _tightest(root: Path, path: str, read: Callable[[Path], MemoryLimit | None]) -> MemoryLimit | None:
    """The tightest limit of the group at `path` under `root` and of every group above it."""
    limits = []
    group = PurePosixPath(path)
    for level in [group, *group.parents]:
        folder = root.joinpath(*level.parts[1:])  # "/" itself: the root group
        if not folder.is_dir():
            continue
        limit = read(folder)
        if limit is not None:
            limits.append(limit)
    return min(limits, key=lambda limit: limit.available_bytes, default=None)


def _v2_limit(folder: Path) -> MemoryLimit | None:
    limit = _read_int(folder / "memory.max")  # "max": none
    current = _read_int(folder / "memory.current")
    if limit is None or current is None:
        return None
    return MemoryLimit(limit, _left(limit, current, _stat(folder / "memory.stat", "inactive_file")))


def _v1_limit(folder: Path) -> MemoryLimit | None:
    limit = _read_int(folder / "memory.limit_in_bytes")
    usage = _read_int(folder / "memory.usage_in_bytes")
    if limit is None or usage is None or limit >= NO_LIMIT_FROM:
        return None
    return MemoryLimit(limit, _left(limit, usage, _stat(folder / "memory.stat", "total_inactive_file")))


def _left(limit: int, usage: int, reclaimable: int) -> int:
    return max(0, limit - max(0, usage - reclaimable))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0
