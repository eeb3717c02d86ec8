"""Huge pages for a compiled stage's weights: which memory is picked, when it is on, and that it works."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.agent import huge_pages
from deskfleet.agent import stage as stage_module
from deskfleet.agent.stage import CompileSettings, LayerRange, Stage
from deskfleet.common.model_spec import load_manifest

MB = 1 << 20
HUGE = huge_pages.HUGE_PAGE

MAPS = """\
55d4c1a00000-55d4c1a21000 r--p 00000000 fe:00 1234   /usr/bin/python3.11
55d4c2000000-55d4c2400000 rw-p 00000000 00:00 0      [heap]
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
7f0000a00000-7f0000a01000 ---p 00000000 00:00 0
7f0001000000-7f0001300000 rw-s 00000000 00:05 77     /dev/shm/x (deleted)
7f0002000000-7f0002100000 rw-s 00000000 00:01 9
7f0003000000-7f0003001000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
"""


def test_anonymous_regions_are_the_private_writable_mappings_without_a_path() -> None:
    assert huge_pages.anonymous_regions(MAPS) == {(0x7F0000000000, 0x7F0000A00000), (0x7F0003000000, 0x7F0003001000)}


def test_huge_page_ranges_keep_only_whole_aligned_pages() -> None:
    page = huge_pages.HUGE_PAGE
    regions = {(page + 4096, 4 * page + 100), (10 * page, 10 * page + page - 1), (20 * page, 21 * page)}
    assert huge_pages.huge_page_ranges(regions) == [(2 * page, 4 * page), (20 * page, 21 * page)]


@pytest.mark.parametrize(("environ", "platform", "mode", "expected"), [
    ({}, "linux", "always [madvise] never\n", True),
    ({}, "linux", "[always] madvise never\n", True),
    ({}, "linux", "always madvise [never]\n", False),
    ({"DESKFLEET_HUGE_PAGES": "0"}, "linux", "always [madvise] never\n", False),
    ({"DESKFLEET_HUGE_PAGES": "off"}, "linux", "always [madvise] never\n", False),
    ({"DESKFLEET_HUGE_PAGES": "1"}, "linux", "always [madvise] never\n", True),
    ({}, "win32", "always [madvise] never\n", False),
    ({}, "darwin", "always [madvise] never\n", False),
])
def test_enabled_on_linux_with_thp_unless_turned_off(environ: dict[str, str], platform: str, mode: str,
                                                     expected: bool) -> None:
    assert huge_pages.enabled(environ, platform, mode, (4096, 2 << 20)) is expected


@pytest.mark.parametrize("page_sizes", [(16384, 32 << 20), (65536, 512 << 20)])
def test_not_enabled_where_pages_are_not_4_kb_and_2_mb(page_sizes: tuple[int, int]) -> None:
    # an arm64 kernel of 16 or 64 KB pages: the pagemap offsets and the 2 MB ranges would be wrong
    assert not huge_pages.enabled({}, "linux", "always [madvise] never\n", page_sizes)


def _fake_pagemap(present_per_huge_page: dict[int, int], base: int = 0, shared: frozenset[int] = frozenset(),
                  unreadable: frozenset[int] = frozenset()) -> Callable[[int, int], bytes]:
    """A pagemap reader: huge page i (counted from `base`) has its first present_per_huge_page[i] pages in memory, its
    own (exclusive) but for the huge pages in `shared` (the zero page of memory only read); a read over a huge page
    of `unreadable` fails."""
    def read(offset: int, size: int) -> bytes:
        first, last = ((byte // 8 * huge_pages.BASE_PAGE - base) // huge_pages.HUGE_PAGE
                       for byte in (offset, offset + size - 8))
        if unreadable & set(range(first, last + 1)):
            raise OSError(5, "Input/output error")
        entries = []
        for page_number in range(offset // 8, (offset + size) // 8):
            huge, index = divmod(page_number * huge_pages.BASE_PAGE - base, huge_pages.HUGE_PAGE)
            present = index // huge_pages.BASE_PAGE < present_per_huge_page.get(huge, 0)
            flags = (huge_pages.PAGEMAP_PRESENT | (0 if huge in shared else huge_pages.PAGEMAP_EXCLUSIVE)) \
                if present else 0
            entries.append(flags | 12345)  # the rest of an entry: pfn bits, ignored
        return b"".join(entry.to_bytes(8, sys.byteorder) for entry in entries)
    return read


def test_only_huge_pages_nearly_all_in_memory_are_picked_and_runs_merge_within_a_range() -> None:
    base = 7 * HUGE
    ranges = [(base, base + 5 * HUGE), (base + 5 * HUGE, base + 6 * HUGE), (base + 7 * HUGE, base + 8 * HUGE)]
    read = _fake_pagemap({0: 512, 1: 448, 2: 447, 3: 1, 4: 512, 5: 512, 7: 500}, base)  # 448 = 7/8 of 512
    # 4 and 5 are adjacent but of two regions: one madvise call over both stops at the first that refuses it
    assert huge_pages.populated_huge_pages(ranges, read) == [
        (base, base + 2 * HUGE), (base + 4 * HUGE, base + 5 * HUGE), (base + 5 * HUGE, base + 6 * HUGE),
        (base + 7 * HUGE, base + 8 * HUGE)]
    assert huge_pages.populated_huge_pages([], read) == []


def test_memory_only_read_is_not_picked() -> None:
    # pages only read map the shared zero page: present, not exclusive; a collapse would make 2 MB of real memory
    read = _fake_pagemap({0: 512, 1: 512}, shared=frozenset({1}))
    assert huge_pages.populated_huge_pages([(0, 2 * HUGE)], read) == [(0, HUGE)]


def test_a_range_whose_pagemap_cannot_be_read_is_left_out_and_the_others_kept() -> None:
    read = _fake_pagemap({0: 512, 1: 512, 4: 512}, unreadable=frozenset({1}))
    assert huge_pages.populated_huge_pages([(0, 2 * HUGE), (4 * HUGE, 5 * HUGE)], read) == [(4 * HUGE, 5 * HUGE)]
    short = huge_pages.populated_huge_pages([(0, HUGE), (4 * HUGE, 5 * HUGE)],
                                            lambda offset, size: _fake_pagemap({0: 512, 4: 512})(offset, size)[:-8])
    assert short == []  # a read that gives less than asked counts for nothing


def test_a_long_range_is_read_a_chunk_at_a_time() -> None:
    reads: list[int] = []
    whole = _fake_pagemap(dict.fromkeys(range(600), 512))

    def read(offset: int, size: int) -> bytes:
        reads.append(size)
        return whole(offset, size)

    assert huge_pages.populated_huge_pages([(0, 600 * HUGE)], read) == [(0, 600 * HUGE)]
    per_huge_page = huge_pages.HUGE_PAGE // huge_pages.BASE_PAGE * 8
    assert reads == [256 * per_huge_page, 256 * per_huge_page, 88 * per_huge_page]


def test_disabled_means_no_snapshot_and_nothing_collapsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV_VAR, "0")
    assert huge_pages.snapshot() is None
    assert huge_pages.collapse_new_regions(None) is None


def _smaps_fields(start: int, size: int, field: str) -> list[list[str]]:
    """The values of `field` (e.g. "AnonHugePages:") of each mapping that overlaps [start, start + size), from
    /proc/self/smaps (advising part of a mapping splits it, so a buffer may span several)."""
    values = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and ":" not in fields[0]:
            low, high = (int(value, 16) for value in fields[0].split("-"))
            inside = low < start + size and start < high
        elif inside and fields[0] == field:
            values.append(fields[1:])
    return values


def _anon_huge_kb(start: int, size: int) -> int:
    return sum(int(value[0]) for value in _smaps_fields(start, size, "AnonHugePages:"))


@pytest.mark.skipif(sys.platform != "linux" or not huge_pages.enabled(environ={}),
                    reason="needs Linux with transparent huge pages not set to never")
def test_new_memory_is_backed_by_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(huge_pages.ENV_VAR, raising=False)
    if not _collapse_supported():
        pytest.skip(f"MADV_COLLAPSE is not available on {os.uname().release} (hinted only)")
    before = huge_pages.snapshot()
    assert before is not None
    # A fresh private anonymous mapping, touched page by page (not numpy: it asks for huge pages itself)
    size = 64 * MB
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.write(b"\x01" * size)
    view = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(view)
    assert _anon_huge_kb(address, size) == 0 or "[always]" in huge_pages.THP_ENABLED.read_text()
    report = huge_pages.collapse_new_regions(before)
    assert report is not None and report.bytes >= 60 * MB and report.collapsed
    assert _anon_huge_kb(address, size) >= 60 * 1024
    assert buffer[:] == b"\x01" * size  # the contents survive the move into huge pages
    del view
    buffer.close()


def _pages_in_memory(start: int, size: int) -> int:
    """How many 4 KB pages of [start, start + size) are in memory (/proc/self/pagemap's bit 63)."""
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        data = os.pread(pagemap.fileno(), size // 4096 * 8, start // 4096 * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", data))


def _vm_flags(start: int, size: int) -> set[str]:
    """The VmFlags of the mappings that overlap [start, start + size) (hg: MADV_HUGEPAGE, nh: MADV_NOHUGEPAGE)."""
    return {flag for flags in _smaps_fields(start, size, "VmFlags:") for flag in flags}


def _touched_mapping(size: int) -> tuple[mmap.mmap, int]:
    """A fresh private anonymous mapping, written page by page (not numpy: it asks for huge pages itself)."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.write(b"\x01" * size)
    view = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(view)
    del view
    return buffer, address


def _collapse_supported() -> bool:
    madvise = huge_pages._madvise()
    return madvise is not None and huge_pages._collapse_supported(madvise)


needs_thp = pytest.mark.skipif(sys.platform != "linux" or not huge_pages.enabled(environ={}),
                               reason="needs Linux with transparent huge pages not set to never")


@needs_thp
def test_collapsed_memory_is_not_marked_for_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Marked MADV_HUGEPAGE, a range would fill up with huge pages again once the stage freed it (khugepaged)."""
    monkeypatch.delenv(huge_pages.ENV_VAR, raising=False)
    if not _collapse_supported():
        pytest.skip(f"MADV_COLLAPSE is not available on {os.uname().release} (hinted only)")
    before = huge_pages.snapshot()
    buffer, address = _touched_mapping(16 * MB)
    report = huge_pages.collapse_new_regions(before)
    assert report is not None and report.collapsed and report.hinted == ()
    assert _anon_huge_kb(address, 16 * MB) >= 14 * 1024
    assert "hg" not in _vm_flags(address, 16 * MB)
    huge_pages.take_back_hints(report)  # nothing was hinted: nothing changes
    assert "nh" not in _vm_flags(address, 16 * MB)
    buffer.close()


@needs_thp
def test_sparse_new_memory_is_left_in_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collapse fills its whole 2 MB: a range with a page or two in use (the allocator's reserve, small buffers)
    would grow by up to 2 MB. Half a mapping written page by page, the other half one page in each 2 MB."""
    monkeypatch.delenv(huge_pages.ENV_VAR, raising=False)
    if "[madvise]" not in huge_pages.THP_ENABLED.read_text():
        pytest.skip("THP is not in madvise mode: a page written faults in a whole huge page")
    if not _collapse_supported():
        pytest.skip(f"MADV_COLLAPSE is not available on {os.uname().release} (hinted only)")
    before = huge_pages.snapshot()
    buffer = mmap.mmap(-1, 18 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(buffer)
    address = ctypes.addressof(view)
    del view
    offset = -address % HUGE  # the first whole huge page
    buffer[offset:offset + 8 * MB] = b"\x01" * (8 * MB)
    for sparse in range(offset + 8 * MB, 18 * MB - HUGE + 1, HUGE):  # every other whole huge page of it
        buffer[sparse] = 1
    sparse_pages = range(address + offset + 8 * MB, address + 18 * MB - HUGE + 1, HUGE)
    huge_before = _anon_huge_kb(address, 18 * MB)
    report = huge_pages.collapse_new_regions(before)
    assert report is not None and report.collapsed
    assert _anon_huge_kb(address, 18 * MB) - huge_before >= 8 * 1024  # the written half (neighbours may add)
    assert [_pages_in_memory(start, HUGE) for start in sparse_pages] == [1] * len(sparse_pages)  # not filled
    assert buffer[offset + 8 * MB] == 1 and buffer[offset:offset + 8 * MB] == b"\x01" * (8 * MB)
    buffer.close()


def _collapse_without_madv_collapse(monkeypatch: pytest.MonkeyPatch, thp_mode: str
                                    ) -> tuple[huge_pages.CollapseReport | None, mmap.mmap, int]:
    """collapse_new_regions over a new 16 MB mapping as a kernel without MADV_COLLAPSE, THP in `thp_mode`, runs it."""
    monkeypatch.delenv(huge_pages.ENV_VAR, raising=False)
    monkeypatch.setattr(huge_pages, "_collapse_supported", lambda madvise: False)
    monkeypatch.setattr(huge_pages, "_thp_mode", lambda: thp_mode)
    before = huge_pages.snapshot()
    buffer, address = _touched_mapping(16 * MB)
    return huge_pages.collapse_new_regions(before), buffer, address


@needs_thp
def test_a_kernel_without_collapse_gets_hints_that_the_release_takes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    report, buffer, address = _collapse_without_madv_collapse(monkeypatch, "always [madvise] never\n")
    assert report is not None and not report.collapsed
    assert any(low <= address + 2 * MB and address + 14 * MB <= high for low, high in report.hinted)
    assert "hg" in _vm_flags(address, 16 * MB)
    huge_pages.take_back_hints(report)
    flags = _vm_flags(address, 16 * MB)
    assert "hg" not in flags and "nh" in flags
    buffer.close()
    huge_pages.take_back_hints(report)  # the ranges are gone now: skipped without a word


@needs_thp
def test_a_kernel_without_collapse_in_always_mode_is_left_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # THP `always` gives huge pages unasked, and taking a hint back (MADV_NOHUGEPAGE) would forbid them there
    report, buffer, address = _collapse_without_madv_collapse(monkeypatch, "[always] madvise never\n")
    assert report is None
    assert not {"hg", "nh"} & _vm_flags(address, 16 * MB)
    buffer.close()


def test_without_a_pagemap_nothing_is_collapsed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(huge_pages, "PAGEMAP", tmp_path / "no-pagemap")
    monkeypatch.setattr(huge_pages, "_madvise", lambda: pytest.fail("nothing may be advised"))
    assert huge_pages.collapse_new_regions(set()) is None


def test_releasing_a_stage_takes_its_hints_back(tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = huge_pages.CollapseReport(1, 2 * MB, False, 0.0, ((4 * MB, 6 * MB),))
    monkeypatch.setattr(huge_pages, "collapse_new_regions", lambda before: report)
    taken_back: list[object] = []
    monkeypatch.setattr(huge_pages, "take_back_hints", taken_back.append)
    manifest = load_manifest(tiny_export)
    stage = Stage(tiny_export, manifest, LayerRange(0, 1, manifest.spec.num_layers), CompileSettings())
    assert taken_back == []
    stage.release_memory()
    assert taken_back == [report]


@pytest.mark.parametrize(("repacked", "expected"), [
    (True, ["snapshot", "warm_up", "collapse"]),
    (False, ["snapshot", "warm_up", "warm_up", "collapse"]),  # built again reading its weights, warmed up again
])
def test_a_cpu_stage_warms_up_then_collapses_what_its_compile_and_first_call_allocated(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, repacked: bool, expected: list[str]) -> None:
    calls: list[str] = []
    monkeypatch.setattr(huge_pages, "snapshot", lambda: calls.append("snapshot") or set())
    monkeypatch.setattr(huge_pages, "collapse_new_regions", lambda before: calls.append("collapse"))
    monkeypatch.setattr(Stage, "warm_up", lambda self: calls.append("warm_up"))
    monkeypatch.setattr(stage_module, "weights_were_repacked", lambda *measured: repacked)
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    Stage(tiny_export, manifest, LayerRange(0, 1, layers), CompileSettings())
    assert calls == expected


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
@pytest.mark.parametrize("repacked", [False, True])
def test_a_stage_maps_its_shard_files_only_where_the_plugin_repacked_the_weights(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repacked: bool) -> None:
    """Mapped weight files stay in 4 KB page-cache pages, out of huge_pages' reach: where the plugin runs the
    weights in place they are read, and become ours; where it repacks them, the files stay mapped (and cold)."""
    monkeypatch.setattr(stage_module, "weights_were_repacked", lambda *measured: repacked)
    export = tmp_path / "export"  # files of this test's own: other tests' stages of the shared export may live on
    shutil.copytree(tiny_export, export)
    manifest = load_manifest(export)
    stage = Stage(export, manifest, LayerRange(0, manifest.spec.num_layers, manifest.spec.num_layers),
                  CompileSettings())
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(export.resolve()) in line]
    assert stage.compiled is not None and bool(mapped) is repacked and stage.weights_mapped is repacked


def test_a_cpu_stage_warms_up_even_with_huge_pages_off(tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV_VAR, "0")
    calls: list[object] = []
    monkeypatch.setattr(huge_pages, "collapse_new_regions", lambda before: calls.append(("collapse", before)))
    monkeypatch.setattr(Stage, "warm_up", lambda self: calls.append("warm_up"))
    monkeypatch.setattr(stage_module, "weights_were_repacked", lambda *measured: True)
    manifest = load_manifest(tiny_export)
    Stage(tiny_export, manifest, LayerRange(0, 1, manifest.spec.num_layers), CompileSettings())
    assert calls == ["warm_up", ("collapse", None)]  # the repacked weights count from the start either way


def test_warm_up_leaves_sessions_untouched_for_first_middle_and_last_stages(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    for layer_range in (LayerRange(0, 1, layers), LayerRange(1, layers, layers)):
        stage = Stage(tiny_export, manifest, layer_range, CompileSettings())
        session = stage.open_session()
        stage.warm_up()
        assert all(state.shape[2] == 0 for state in session.query_state().values())


def test_a_setting_that_is_neither_on_nor_off_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.log_records import records_of

    monkeypatch.setattr(huge_pages, "_warned", set())
    with records_of(huge_pages.log.name, logging.WARNING) as warned:
        for _ in range(2):
            huge_pages.enabled({huge_pages.ENV_VAR: "of"}, "linux", "always [madvise] never", (4096, 2 << 20))
        huge_pages.enabled({huge_pages.ENV_VAR: "yes"}, "linux", "always [madvise] never", (4096, 2 << 20))
    assert warned.messages() == [
        "DESKFLEET_HUGE_PAGES=of is neither on (1, yes, on, true) nor off (0, no, off, false): huge pages stay on"]
