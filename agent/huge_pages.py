"""Transparent huge pages for a compiled model's weights (Linux; elsewhere nothing happens).

A decode step reads every weight of the stage once, and on the CPU those reads walk hundreds of MB of
memory that the CPU plugin allocated with plain 4 KB pages: most distributions ship THP in `madvise`
mode, and OpenVINO never asks for huge pages. Backing those buffers with 2 MB pages cuts the TLB misses
of every step: a 1.1B INT4 stage decoded 1-4% faster on the 2-core development VM (19.85 -> 20.58 tok/s
in 4 alternating processes each; 1.021x and 1.008x in two `bench parity --huge-pages-ablation` runs).

The CPU plugin repacks the weights lazily, at the first inference (after compile_model only ~90 of the
~450 MB exist), so the caller warms the model up first and then collapses the new anonymous memory: MADV_COLLAPSE
(Linux 6.1+) moves what is there into huge pages now. Only the 2 MB ranges that are nearly all in memory already
(7/8 of their 4 KB pages, read from /proc/self/pagemap) are collapsed, in the regions that appeared since a
snapshot taken before the compile. A collapse fills its whole 2 MB with memory, and most new ranges are not
weights: of the 80 MB of new ranges after loading the demo target, 6 ranges held weights (3 whole, 3 at 320-448
pages in memory), 29 none, and 5 held 1-6 pages (the allocator's reserve, the plugin's small buffers), which the
collapse turned into 2 MB each. A region the kernel refuses (EINVAL: a guard page, a special mapping) is skipped.

The ranges are not marked MADV_HUGEPAGE. A marked range keeps asking for huge pages after the stage is gone:
the allocator hands its freed pages out again, a fault there takes a whole 2 MB page, and khugepaged (its
max_ptes_none is 511 by default) fills any 2 MB range with one page in use. An agent in-process, on jemalloc,
assigned the demo target, fed a 900-token prompt and released 6 times, 20 s apart: 78 -> 123 MB, then 135 MB
after 150 s idle, with every new range marked and collapsed; 62 -> 79 MB and 75 idle as it is now; 61 -> 79 and
76 with huge pages off. In a 2-PC soak, the PC that took over its peer's layers at each failover had held 164 MB
of huge pages against a fresh agent's 60. A kernel without MADV_COLLAPSE
(before 6.1, unless backported; asked of the kernel, not read from its version): with THP in `madvise` mode the
ranges are marked (khugepaged collapses them in its own time) and the stage takes the mark back when it is
released (`take_back_hints`: MADV_NOHUGEPAGE, which in that mode leaves them as unmarked memory is); in `always`
mode nothing is done, as the kernel gives huge pages unasked.

Only the ranges that hold this process's own pages count (pagemap's present and exclusive bits): memory that was
only read maps the shared zero page, which a collapse would turn into 2 MB of real memory. Where the pagemap
cannot be read, nothing is collapsed.

DESKFLEET_HUGE_PAGES=0 turns it off (it costs about 1 s per 450 MB at load: the copy into huge pages).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

ENV_VAR = "DESKFLEET_HUGE_PAGES"
_OFF = frozenset({"0", "no", "off", "false"})
_ON = frozenset({"1", "yes", "on", "true"})
_warned: set[str] = set()  # the unknown settings already warned of
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KB base pages) PMD size
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_COLLAPSE = 25
MIN_PRESENT = 7 / 8  # of a huge page's base pages in memory already, for it to be collapsed
BASE_PAGE = 4096  # the only base page size this module works with (enabled() checks it)
PAGEMAP = Path("/proc/self/pagemap")  # 8 bytes a base page, in the machine's byte order (readable unprivileged)
PAGEMAP_PRESENT = 1 << 63
PAGEMAP_EXCLUSIVE = 1 << 56  # mapped by this process alone: not the shared zero page of memory only read
PAGEMAP_CHUNK = 256  # huge pages' entries read at a time (1 MB)
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
PROC_MAPS = Path("/proc/self/maps")  # read with read_maps(): it names mapped files in their bytes

Region = tuple[int, int]  # [start, end) addresses


@dataclass(frozen=True)
class CollapseReport:
    regions: int  # 2 MB-aligned ranges advised
    bytes: int
    collapsed: bool  # MADV_COLLAPSE worked (else only the MADV_HUGEPAGE hint was given)
    seconds: float
    hinted: tuple[Region, ...] = ()  # the ranges marked MADV_HUGEPAGE (no MADV_COLLAPSE): take_back_hints


def enabled(environ: Mapping[str, str] | None = None, platform: str | None = None,
            thp_mode: str | None = None, page_sizes: tuple[int, int] | None = None) -> bool:
    """Whether to back new model memory with huge pages: Linux with 4 KB base pages and 2 MB huge ones (an arm64
    kernel of 16 or 64 KB pages has huge pages of 32 or 512 MB: not these ranges), THP not `never`, not turned
    off. `page_sizes`: (base, huge), read from the system when None."""
    environ = os.environ if environ is None else environ
    setting = environ.get(ENV_VAR, "1").strip().lower()
    if setting in _OFF:
        return False
    if setting not in _ON and setting not in _warned:  # a typo of "off" was taken as on without a word
        _warned.add(setting)
        log.warning("%s=%s is neither on (1, yes, on, true) nor off (0, no, off, false): huge pages stay on",
                    ENV_VAR, setting[:40])
    if (platform or sys.platform) != "linux":
        return False
    try:
        if thp_mode is None:
            thp_mode = THP_ENABLED.read_text()
        if page_sizes is None:
            page_sizes = (mmap.PAGESIZE, int(THP_PMD_SIZE.read_text()))
    except (OSError, ValueError):
        return False
    return "[never]" not in thp_mode and page_sizes == (BASE_PAGE, HUGE_PAGE)


def anonymous_regions(maps_text: str) -> set[Region]:
    """The writable private anonymous mappings of a /proc/PID/maps text (no path, no [heap]/[stack])."""
    regions: set[Region] = set()
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) != 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
            continue  # a path (file, [stack], [heap], [vvar]) is a sixth field
        start, end = (int(value, 16) for value in fields[0].split("-"))
        regions.add((start, end))
    return regions


def huge_page_ranges(regions: Iterable[Region], page: int = HUGE_PAGE) -> list[Region]:
    """The whole huge pages inside each region, sorted; regions smaller than one page give none."""
    ranges = []
    for start, end in sorted(regions):
        low = (start + page - 1) // page * page
        high = end // page * page
        if high - low >= page:
            ranges.append((low, high))
    return ranges


def populated_huge_pages(ranges: Iterable[Region], read_pagemap: Callable[[int, int], bytes],
                         min_present: float = MIN_PRESENT) -> list[Region]:
    """The huge pages of `ranges` (huge_page_ranges) with at least `min_present` of their base pages in memory and
    this process's own (written: memory only read maps the shared zero page, which a collapse would make real),
    adjacent ones merged within a range (a merged call that one region refuses would leave its neighbour out too).
    `read_pagemap(offset, size)` reads the pagemap. Where it cannot give a range's entries, the rest of that range
    is left out."""
    per_page = HUGE_PAGE // BASE_PAGE
    needed = math.ceil(per_page * min_present)
    wanted = np.uint64(PAGEMAP_PRESENT | PAGEMAP_EXCLUSIVE)
    dense: list[Region] = []
    for low, high in ranges:
        merging = False
        for chunk in range(low, high, PAGEMAP_CHUNK * HUGE_PAGE):
            count = min(PAGEMAP_CHUNK, (high - chunk) // HUGE_PAGE)
            try:
                data = read_pagemap(chunk // BASE_PAGE * 8, count * per_page * 8)
            except OSError as error:
                log.debug("the page map of %#x-%#x cannot be read (%s): left in small pages", chunk, high, error)
                break
            if len(data) != count * per_page * 8:
                log.debug("the page map gave %d of %d bytes for %#x-%#x: left in small pages", len(data),
                          count * per_page * 8, chunk, high)
                break
            entries = np.frombuffer(data, dtype=np.uint64).reshape(count, per_page)
            present = ((entries & wanted) == wanted).sum(axis=1)
            for index, dense_enough in enumerate((present >= needed).tolist()):
                start = chunk + index * HUGE_PAGE
                if dense_enough and merging:
                    dense[-1] = (dense[-1][0], start + HUGE_PAGE)
                elif dense_enough:
                    dense.append((start, start + HUGE_PAGE))
                merging = dense_enough
    return dense


def read_maps(path: Path) -> str:
    """A /proc/PID/maps file as text. The paths of mapped files are bytes, not always UTF-8: a model's weights
    mapped from a folder named in Latin-1 made reading it as UTF-8 fail, and with it every stage's load."""
    return path.read_text(encoding="utf-8", errors="surrogateescape")


def snapshot() -> set[Region] | None:
    """The anonymous regions now, to compare against after loading a model; None when not enabled."""
    if not enabled():
        return None
    try:
        return anonymous_regions(read_maps(PROC_MAPS))
    except OSError:
        return None


def collapse_new_regions(before: set[Region] | None) -> CollapseReport | None:
    """Back every anonymous region that appeared since `before` (a snapshot()) with huge pages."""
    if before is None:
        return None
    started = time.perf_counter()
    try:
        ranges = huge_page_ranges(anonymous_regions(read_maps(PROC_MAPS)) - before)
    except OSError:
        return None
    try:
        with PAGEMAP.open("rb", buffering=0) as pagemap:
            ranges = populated_huge_pages(ranges, lambda offset, size: os.pread(pagemap.fileno(), size, offset))
    except OSError as error:  # no page map: which ranges hold the weights is not known, and a guess costs memory
        log.info("huge pages not used: /proc/self/pagemap cannot be read (%s)", error)
        return None
    madvise = _madvise()
    if madvise is None:
        return None
    collapse = _collapse_supported(madvise)
    if not collapse and "[madvise]" not in _thp_mode():
        return None  # `always`: the kernel gives huge pages without a hint (and a hint's take-back would forbid them)
    advised = 0
    total = 0
    hinted: list[Region] = []
    for low, high in ranges:
        if madvise(low, high - low, MADV_COLLAPSE if collapse else MADV_HUGEPAGE) != 0:
            code = ctypes.get_errno()  # EINVAL: not a mapping THP can back (changed under us, or special); EAGAIN,
            if code not in {errno.EINVAL, errno.EAGAIN, errno.ENOMEM}:  # ENOMEM: no huge page free, or unmapped
                log.debug("madvise on %#x-%#x failed: %s", low, high, os.strerror(code))
            continue
        if not collapse:
            hinted.append((low, high))
        advised += 1
        total += high - low
    report = CollapseReport(advised, total, collapse and advised > 0, time.perf_counter() - started, tuple(hinted))
    log.info("huge pages for %d MB of new model memory in %d ranges (%s) in %.2f s", total >> 20, advised,
             "collapsed now" if collapse else "hinted", report.seconds)
    return report


def take_back_hints(report: CollapseReport | None) -> None:
    """Unmark the ranges a kernel without MADV_COLLAPSE was only hinted for, in `madvise` mode (see the module's
    docstring), once the memory in them is being freed. A range unmapped since is skipped (ENOMEM)."""
    if report is None or not report.hinted:
        return
    madvise = _madvise()
    if madvise is None:
        return
    for low, high in report.hinted:
        madvise(low, high - low, MADV_NOHUGEPAGE)


# Private functions

def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    madvise: Callable[[int, int, int], int] = function
    return madvise


def _collapse_supported(madvise: Callable[[int, int, int], int]) -> bool:
    """Whether the kernel knows MADV_COLLAPSE (Linux 6.1+, or a backport): asked of an empty range, it says EINVAL
    for an advice it does not know and nothing else."""
    return madvise(0, 0, MADV_COLLAPSE) == 0


def _thp_mode() -> str:
    try:
        return THP_ENABLED.read_text()
    except OSError:
        return ""
