"""Keeps the KV caches of an agent's stages from taking the PC's last memory.

A stage's KV cache grows with every step: rows (streams) times slots (tokens) times what a slot holds in the
stage's layers. The planner reserves room for a deployment's `--streams` at full context, but nothing held a
driver to that: more streams than planned, or a step from a faulty or hostile previous hop claiming thousands
of rows (a step's header may list 50,000 new rows), grew the cache until the PC swapped or the kernel's
out-of-memory killer ended a process, perhaps the employee's own. So every step that would grow a stage's cache
asks this guard first, and a step that would leave the PC less than a floor of available memory (an eighth of
the memory the agent may use, at most 512 MiB: an agent capped at 640 MiB by its service kept 512 of them free and
could run nothing) is refused before anything is allocated: the driver hears OUT_OF_MEMORY naming the
micro-batch, and re-plans without this PC.

What a step may grow a cache by is bounded from the step alone (KvGrowth), with no replay of its deltas: its
rows, times the micro-batch's slots plus the step's new ones, less what the micro-batch held; a step that admits a
row or compacts is rehearsed on a copy of the mirror anyway, and its rows and slots after are taken from there (an
admitted row pads every row to its slots). The CPU plugin
grows a cache by reallocating it at twice the tokens it must hold when it is full, so a slot is counted twice.
Available memory is read at most once a `recheck_s` while the estimates fit in what the last reading left
(one read of /proc/meminfo, ~30 us); memory that released micro-batches gave back counts from the next reading.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIB = 1 << 20
# a step that would leave the PC less available memory than this is refused: at most this, at most a FLOOR_SHARE
# of the memory the agent may use (the PC's, or its control groups' limit: agent/cgroup_memory.py)
KV_MEMORY_FLOOR_BYTES = 512 * MIB
FLOOR_SHARE = 1 / 8
RECHECK_S = 1.0
# the CPU plugin reallocates a full cache at twice the tokens it must hold (controller/fleet_deploy.py, KV_GROWTH)
SLOT_GROWTH = 2


class KvMemoryRefused(Exception):
    """A step whose KV cache growth the PC has no memory for; its text says how much, and what to do."""


@dataclass(frozen=True)
class KvGrowth:
    """What one step may add to a micro-batch's KV cache, in slots summed over rows: the `rows` x `slots` it may
    hold after the step, less the `held_rows` x `held_slots` before it; never below 0 (a step that drops rows or
    compacts frees memory, counted at the next reading)."""

    rows: int
    slots: int
    held_rows: int
    held_slots: int

    @property
    def slot_count(self) -> int:
        return max(0, self.rows * self.slots - self.held_rows * self.held_slots)


class KvMemoryGuard:
    """One per agent (the memory is the PC's, shared by its stages); thread-safe: stages' steps run on worker
    threads. `free_memory` reads (the bytes available to new allocations without swapping, the total the agent
    may use) (agent/monitor.py, available_memory_reader), None where that is unknown: nothing is refused then, as
    an unknown sensor makes no agent unavailable. The floor kept free is `floor_bytes`, or a FLOOR_SHARE of the
    total where that is less."""

    def __init__(self, free_memory: Callable[[], tuple[int, int] | None], floor_bytes: int = KV_MEMORY_FLOOR_BYTES,
                 recheck_s: float = RECHECK_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.free_memory = free_memory
        self.floor_bytes = floor_bytes
        self.recheck_s = recheck_s
        self.clock = clock
        self._lock = threading.Lock()
        self._headroom = 0  # what the last reading left above the floor, less what steps were let grow since
        self._read_at: float | None = None
        self._failure_logged = False

    def admit(self, growth_bytes: int, what: Callable[[], str]) -> None:
        """Let a step grow a cache by `growth_bytes`, or raise KvMemoryRefused naming the step as `what()` says
        (called only then: this runs every step)."""
        if growth_bytes <= 0:
            return
        with self._lock:
            now = self.clock()
            if growth_bytes > self._headroom or self._read_at is None or now - self._read_at >= self.recheck_s:
                try:
                    reading = self.free_memory()
                except Exception:  # a sensor that fails is unknown, and unknown refuses nothing
                    if not self._failure_logged:
                        log.exception("cannot read the memory available (logged once): no step is refused for it")
                        self._failure_logged = True
                    reading = None
                self._read_at = now
                if reading is None:
                    self._headroom = sys.maxsize  # nothing refused; read again a recheck_s on
                    return
                free, total = reading
                floor = min(self.floor_bytes, int(total * FLOOR_SHARE))
                self._headroom = free - floor
                if growth_bytes > self._headroom:
                    raise KvMemoryRefused(
                        f"{what()} would grow this PC's KV cache and call buffers by up to "
                        f"{_mib(growth_bytes)} with {free / MIB:,.0f} MiB of the {total / MIB:,.0f} MiB "
                        f"it may use available, leaving less than the {floor / MIB:,.0f} MiB this agent keeps free: "
                        "run fewer or shorter streams (generate --max-rows, fewer prompts, a smaller "
                        "--max-new-tokens; serve --max-rows and --rows-when-busy), or deploy over more PCs or PCs "
                        "with more memory")
            self._headroom -= growth_bytes


def _mib(size: int) -> str:
    """A size in MiB, or in KiB below one (a refused step of a few KiB read "by up to 0 MiB")."""
    return f"{size / MIB:,.0f} MiB" if size >= MIB else f"{max(1, round(size / 1024))} KiB"
