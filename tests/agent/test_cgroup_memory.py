"""The agent reports the memory its control groups leave it: a service capped with systemd's MemoryMax= reported the
whole PC's free memory, and the planner could give it a stage the kernel kills it for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deskfleet.agent.cgroup_memory import MemoryLimit, read_memory_limit
from deskfleet.agent.monitor import HostMonitor, HostProbes, available_memory_reader

GIB = 1 << 30
V1_NO_LIMIT = "9223372036854771712"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_group(sysfs: Path, path: str, limit: str, current: int, inactive_file: int = 0) -> None:
    folder = sysfs / "fs/cgroup" / path.strip("/")
    write(folder / "memory.max", f"{limit}\n")
    write(folder / "memory.current", f"{current}\n")
    write(folder / "memory.stat", f"anon 1\nfile 9\ninactive_file {inactive_file}\nactive_file 5\n")


def test_a_v2_service_capped_by_its_unit_reads_its_limit_less_its_working_set(tmp_path: Path) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    unit = "user.slice/user-1000.slice/user@1000.service/app.slice/deskfleet-agent.service"
    write(proc / "self/cgroup", f"0::/{unit}\n")
    v2_group(sysfs, "", "max", 20 * GIB)  # the root group: no limit
    v2_group(sysfs, "user.slice", "max", 6 * GIB)
    v2_group(sysfs, unit, str(4 * GIB), 3 * GIB, inactive_file=GIB)  # 2 GiB in use, the rest droppable cache
    assert read_memory_limit(proc, sysfs) == MemoryLimit(4 * GIB, 2 * GIB)


def test_the_tightest_group_above_the_agent_counts(tmp_path: Path) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    write(proc / "self/cgroup", "0::/office.slice/deskfleet.service\n")
    v2_group(sysfs, "office.slice", str(3 * GIB), int(2.5 * GIB))  # the slice: 0.5 GiB left for all of it
    v2_group(sysfs, "office.slice/deskfleet.service", str(8 * GIB), GIB)
    assert read_memory_limit(proc, sysfs) == MemoryLimit(3 * GIB, GIB // 2)


def test_a_v1_memory_controller_is_read_and_its_no_limit_is_none(tmp_path: Path) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    write(proc / "self/cgroup", "9:name=systemd:/\n4:memory:/docker/abc\n1:cpu:/\n0::/\n")
    folder = sysfs / "fs/cgroup/memory/docker/abc"
    write(folder / "memory.limit_in_bytes", f"{2 * GIB}\n")
    write(folder / "memory.usage_in_bytes", f"{GIB + 100}\n")
    write(folder / "memory.stat", "cache 5\ntotal_inactive_file 100\n")
    write(sysfs / "fs/cgroup/memory/memory.limit_in_bytes", f"{V1_NO_LIMIT}\n")
    write(sysfs / "fs/cgroup/memory/memory.usage_in_bytes", "1\n")
    assert read_memory_limit(proc, sysfs) == MemoryLimit(2 * GIB, GIB)
    write(folder / "memory.limit_in_bytes", f"{V1_NO_LIMIT}\n")
    assert read_memory_limit(proc, sysfs) is None


def mountinfo(proc: Path, *mounts: tuple[str, str, str, str]) -> None:
    """/proc/self/mountinfo with a line per (root, mount point, fstype, super options)."""
    write(proc / "self/mountinfo", "".join(
        f"{30 + index} 25 0:{26 + index} {root} {point} rw,nosuid shared:{index} - {fstype} cgroup {options}\n"
        for index, (root, point, fstype, options) in enumerate(mounts)))


def test_a_v1_memory_controller_mounted_with_others_or_elsewhere_is_found_by_mountinfo(tmp_path: Path) -> None:
    # /sys/fs/cgroup/memory was assumed: a memory controller co-mounted with cpu, or under /cgroup, read as no limit
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    write(proc / "self/cgroup", "5:cpu,memory:/office/agent\n")
    mountinfo(proc, ("/", "/sys/fs/cgroup/cpu,memory", "cgroup", "rw,cpu,memory"),
              ("/", "/sys/fs/cgroup/pids", "cgroup", "rw,pids"))
    folder = sysfs / "fs/cgroup/cpu,memory/office/agent"
    write(folder / "memory.limit_in_bytes", f"{2 * GIB}\n")
    write(folder / "memory.usage_in_bytes", f"{GIB}\n")
    assert read_memory_limit(proc, sysfs) == MemoryLimit(2 * GIB, GIB)


def test_a_container_s_mount_of_its_own_subtree_reads_the_mount_s_root(tmp_path: Path) -> None:
    # the container sees its group's own subtree mounted as the whole tree (a mount whose root is /docker/abc)
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    write(proc / "self/cgroup", "0::/docker/abc\n")
    mountinfo(proc, ("/docker/abc", "/sys/fs/cgroup", "cgroup2", "rw,nsdelegate"))
    v2_group(sysfs, "", str(3 * GIB), GIB)  # the mount point is the group itself
    assert read_memory_limit(proc, sysfs) == MemoryLimit(3 * GIB, 2 * GIB)


def test_no_limit_or_nothing_to_read_leaves_the_machine_s_figures(tmp_path: Path) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    assert read_memory_limit(proc, sysfs) is None  # no /proc/self/cgroup: not Linux
    write(proc / "self/cgroup", "0::/a\n")
    assert read_memory_limit(proc, sysfs) is None  # no cgroup file system
    v2_group(sysfs, "a", "max", GIB)
    assert read_memory_limit(proc, sysfs) is None
    write(sysfs / "fs/cgroup/a/memory.max", "garbage\n")
    assert read_memory_limit(proc, sysfs) is None


def test_a_group_the_agent_may_not_look_into_or_cannot_name_is_no_limit(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # is_dir() raises PermissionError (AppArmor, SELinux, even as root), and a group name that is not UTF-8 raises
    # UnicodeDecodeError: either broke the monitor's every reading, and through the KV guard every step
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "self/cgroup").write_bytes(b"0::/caf\xe9\n")
    assert read_memory_limit(proc, sysfs) is None
    write(proc / "self/cgroup", "0::/capped\n")
    v2_group(sysfs, "capped", str(GIB), 0)

    def denied(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_dir", denied)
    assert read_memory_limit(proc, sysfs) is None


def test_the_monitor_and_the_kv_guard_report_what_the_limit_leaves(tmp_path: Path) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    write(proc / "self/cgroup", "0::/capped\n")
    v2_group(sysfs, "capped", str(4 * GIB), 3 * GIB)
    monitor = HostMonitor(sysfs_root=sysfs, proc_root=proc, platform="linux",
                          probes=HostProbes(cpu_load=lambda: 0.0, memory=lambda: (20 * GIB, 32 * GIB)))
    reading = monitor.read()
    assert (reading.memory_free_bytes, reading.memory_total_bytes) == (GIB, 4 * GIB)
    assert available_memory_reader(monitor)() == (GIB, 4 * GIB)
    roomy = HostMonitor(sysfs_root=sysfs, proc_root=proc, platform="linux",
                        probes=HostProbes(cpu_load=lambda: 0.0, memory=lambda: (GIB // 2, 32 * GIB)))
    assert roomy.read().memory_free_bytes == GIB // 2  # the machine has less left than the limit: that counts


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="makes a real control group: Linux, root")
def test_a_real_control_group_s_limit_is_read(tmp_path: Path) -> None:
    # a memory group of its own, capped at 1 GiB, with a child process in it (v1 or v2, whichever this host has)
    line = next((line for line in Path("/proc/self/cgroup").read_text().splitlines()
                 if line.split(":", 2)[1] in ("", "memory") or "memory" in line.split(":", 2)[1].split(",")), None)
    if line is None:
        pytest.skip("no memory control group here")
    _, controllers, path = line.split(":", 2)
    base = Path("/sys/fs/cgroup") / ("" if controllers == "" else "memory") / path.strip("/")
    group = base / f"deskfleet-test-{os.getpid()}"
    limit_file = "memory.max" if controllers == "" else "memory.limit_in_bytes"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(GIB))
    except OSError as error:
        pytest.skip(f"cannot make a memory control group here: {error}")
    try:
        probe = (f"import os, sys\ntry:\n    open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
                 "except OSError as error:\n    sys.exit(f'cannot move a process into the group: {error}')\n"
                 "from deskfleet.agent.monitor import HostMonitor\nprint(*HostMonitor().memory())")
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        if done.returncode == 1 and done.stderr.startswith("cannot move a process into the group"):
            pytest.skip(done.stderr.strip())
        assert done.returncode == 0, done.stderr
        free, total = map(int, done.stdout.split())
        assert total == GIB and 0 < free <= GIB
    finally:
        group.rmdir()
