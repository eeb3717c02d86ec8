"""The monitor is read from one thread at a time (agent/monitor.py says so: its GPU samplers keep the previous
reading to make a rate, and Windows' PDH query is not shared between threads). The core read it from a worker
thread for every status request and every limits check, so a status that came while a check read (the mDNS
refresh, a `fleet ls`, two controllers) read it in a second thread at once."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from deskfleet.agent.core import AgentCore
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.availability import MonitorReading
from tests.fleet_pki import make_ca, make_member


class OneAtATimeMonitor:
    """Counts the threads inside read() at once."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.reads = 0

    def read(self) -> MonitorReading:
        with self._guard:
            self.inside += 1
            self.reads += 1
            self.most_inside = max(self.most_inside, self.inside)
        time.sleep(0.05)  # a sysfs walk, a PDH collection
        with self._guard:
            self.inside -= 1
        return MonitorReading(cpu_load=0.1, memory_free_bytes=8 << 30, memory_total_bytes=16 << 30,
                              battery_percent=None, on_ac_power=None, temperatures=(), igpu_busy=None)


def test_status_requests_at_once_read_the_monitor_one_at_a_time(tmp_path: Path) -> None:
    files = make_member(make_ca(tmp_path / "ca"), tmp_path / "agent", "agent")
    monitor = OneAtATimeMonitor()
    core = AgentCore(files, AgentSettings(thresholds=Thresholds(require_ac_power=False)),
                     ShardCache(tmp_path / "cache", 1 << 30), monitor)

    async def at_once() -> None:
        await asyncio.gather(*(core.status() for _ in range(4)))

    asyncio.run(at_once())
    assert monitor.reads == 4 and monitor.most_inside == 1, f"{monitor.most_inside} threads read the monitor at once"
