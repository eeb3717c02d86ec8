"""What an idle agent costs the employee's PC: the monitor read it makes every 2 s while it hosts a stage (and
at every status, every 10 s for mDNS) must not walk every file handle of every process.

Measured on a VM with 378 processes holding ~20,000 file handles (an employee's desktop: browser, IDE, chat)
and no GPU at all: one HostMonitor.read() took 79 ms, nearly all of it readlink() over /proc/*/fd looking for
i915/xe clients, and an agent hosting the demo model's stage with no generation running used 5.0% of a core.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deskfleet.agent import monitor as monitor_module
from deskfleet.agent.monitor import HostMonitor, HostProbes
from tests.fake_clock import FakeClock

PROCESSES = 150
FDS_EACH = 20
CLIENT = "drm-driver:\ti915\ndrm-pdev:\t0000:00:02.0\ndrm-client-id:\t{client}\ndrm-engine-render:\t{busy} ns\n"


def desktop_processes(proc: Path) -> None:
    """PROCESSES processes with FDS_EACH handles each, none of them a GPU's."""
    for pid in range(1000, 1000 + PROCESSES):
        fd_dir = proc / str(pid) / "fd"
        fd_dir.mkdir(parents=True)
        (proc / str(pid) / "fdinfo").mkdir()
        for fd in range(FDS_EACH):
            os.symlink("/dev/null", fd_dir / str(fd))


def gpu_client(proc: Path, pid: int, client: int, busy_ns: int) -> None:
    fd_dir = proc / str(pid) / "fd"
    fd_dir.mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "fdinfo").mkdir(exist_ok=True)
    if not (fd_dir / "99").is_symlink():
        os.symlink("/dev/dri/renderD128", fd_dir / "99")
    (proc / str(pid) / "fdinfo" / "99").write_text(CLIENT.format(client=client, busy=busy_ns))


def intel_gpu(sysfs: Path, driver: str = "i915") -> None:
    device = sysfs / "class" / "drm" / "card0" / "device"
    device.mkdir(parents=True)
    (sysfs / "bus" / "pci" / "drivers" / driver).mkdir(parents=True)
    os.symlink(sysfs / "bus" / "pci" / "drivers" / driver, device / "driver")


def count_readlinks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = os.readlink

    def counting(path: str | os.PathLike[str], *args: object, **kwargs: object) -> str:
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(monitor_module.os, "readlink", counting)
    return calls


def monitor(tmp_path: Path, clock: FakeClock) -> HostMonitor:
    return HostMonitor(sysfs_root=tmp_path / "sys", proc_root=tmp_path / "proc", platform="linux",
                       probes=HostProbes(cpu_load=lambda: 0.1, memory=lambda: (8 << 30, 16 << 30),
                                         battery=lambda: None), clock=clock)


def test_a_pc_without_an_intel_gpu_reads_no_process_file_handles(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    desktop_processes(tmp_path / "proc")
    (tmp_path / "sys").mkdir()
    calls = count_readlinks(monkeypatch)
    clock = FakeClock(1000.0)
    host = monitor(tmp_path, clock)
    for _ in range(30):  # a minute of limits checks while serving
        clock.now += 2.0
        assert host.read().igpu_busy is None
    assert len(calls) == 0, f"{len(calls)} readlink calls for a GPU that is not there"


def test_an_intel_gpu_client_is_measured_without_walking_every_handle_every_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    desktop_processes(proc)
    intel_gpu(sysfs)
    gpu_client(proc, 500, client=7, busy_ns=10_000_000_000)
    calls = count_readlinks(monkeypatch)
    clock = FakeClock(1000.0)
    host = monitor(tmp_path, clock)
    busy = 10_000_000_000
    readings = []
    for _ in range(30):  # 60 s of reads, 2 s apart; the client's render engine busy half the time
        clock.now += 2.0
        busy += 1_000_000_000
        gpu_client(proc, 500, client=7, busy_ns=busy)
        readings.append(host.read().igpu_busy)
    assert readings[0] is None and all(value == pytest.approx(0.5) for value in readings[1:]), readings
    every_handle = PROCESSES * FDS_EACH + 1
    assert len(calls) <= 3 * every_handle, f"{len(calls)} readlinks in 30 reads ({every_handle} handles)"


def test_a_gpu_client_first_seen_late_is_not_counted_busy_for_its_whole_life(tmp_path: Path) -> None:
    # Handles are walked again only every so often, so a client can be first seen long after it opened its
    # GPU: its counters then hold all its past work, which must not read as work done since the last read.
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    intel_gpu(sysfs, driver="xe")
    (proc / "1").mkdir(parents=True)
    clock = FakeClock(1000.0)
    host = monitor(tmp_path, clock)
    readings = []
    for step in range(40):
        clock.now += 2.0
        if step >= 3:  # a client with an hour of render time behind it, idle now
            gpu_client(proc, 600, client=3, busy_ns=3600 * 10**9)
        readings.append(host.read().igpu_busy)
    assert all(value is None or value == 0.0 for value in readings), readings
