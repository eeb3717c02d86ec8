"""How busy a Windows PC's GPU is, from the "GPU Engine" performance counters, on any display language.

Windows publishes `\\GPU Engine(<instance>)\\Utilization Percentage` per process and engine (instance
names like `pid_1234_luid_0x00000000_0x0000D1A2_phys_0_eng_0_engtype_3D`). Counter paths are localized:
on a Japanese or German Windows the English path is unknown to `typeperf` and to PdhAddCounter, which is
why this module asks PDH for the English path with PdhAddEnglishCounterW (Windows Vista and later), and
keeps one query open instead of starting `typeperf` every few seconds.

The counter is a rate: the first collection of a query has nothing to compare with, so the first sample
after start (or after the query was rebuilt) is None, like the Linux fdinfo sampler's. Instances of one engine
type of one adapter (one luid) add up, and the busiest of the counted types (3D: games, the desktop's rendering;
Compute: OpenCL and oneAPI work such as OpenVINO's GPU plugin or a renderer) on the busiest adapter is the
answer, as Task Manager shows a GPU's load; video decode and encode (a video call) and copies do not count.

PdhSampler takes any `PdhApi`; `windows_pdh()` gives the ctypes one (None off Windows), and tests drive the
sampler with a fake.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# Every engine of every process: the counted ones are picked by name below, which does not depend on how PDH
# expands a partial wildcard.
GPU_ENGINE_COUNTER = r"\GPU Engine(*)\Utilization Percentage"
# Intel's driver may put an OpenVINO GPU stage's work (OpenCL) on the Compute engines rather than 3D: counting
# 3D alone missed it, and a renderer's (`max_igpu_busy` is for the employee who games, renders or edits video).
COUNTED_ENGINE_TYPES = ("3D", "Compute")
PDH_CSTATUS_VALID_DATA = 0x0
PDH_CSTATUS_NEW_DATA = 0x1
_ADAPTER = re.compile(r"luid_0x[0-9A-Fa-f]+_0x[0-9A-Fa-f]+")
_ENGINE_TYPE = re.compile(r"engtype_([A-Za-z0-9]+)")


class PdhError(OSError):
    """A PDH call failed; `status` is its PDH_STATUS (e.g. 0xC0000BB8, PDH_CSTATUS_NO_OBJECT)."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} failed with PDH status 0x{status & 0xFFFFFFFF:08X}")
        self.status = status


@dataclass(frozen=True)
class CounterItem:
    """One instance of a wildcard counter: its name, its PDH_CSTATUS and its value."""

    name: str
    status: int
    value: float


class PdhApi(Protocol):
    """The PDH calls the sampler makes (each raises PdhError on a failing status)."""

    def open_query(self) -> Any: ...

    def add_english_counter(self, query: Any, path: str) -> Any: ...

    def collect(self, query: Any) -> None: ...

    def counter_items(self, counter: Any) -> list[CounterItem]: ...

    def close_query(self, query: Any) -> None: ...


def busiest_engine(items: Iterable[CounterItem]) -> float | None:
    """How busy the GPU is as a fraction in [0, 1]: the valid instances of each counted engine type
    (COUNTED_ENGINE_TYPES) of one adapter added up, the busiest type of the busiest adapter. None when no such
    instance has a valid value (no GPU, or nothing to compare yet)."""
    per_engine: dict[tuple[str, str], float] = {}
    for item in items:
        kind = _ENGINE_TYPE.search(item.name)
        if kind is None or kind.group(1) not in COUNTED_ENGINE_TYPES:
            continue
        if item.status not in (PDH_CSTATUS_VALID_DATA, PDH_CSTATUS_NEW_DATA):
            continue
        if item.value != item.value:  # NaN: a counter that vanished mid-sample
            continue
        adapter = _ADAPTER.search(item.name)
        key = (adapter.group() if adapter else item.name, kind.group(1))
        per_engine[key] = per_engine.get(key, 0.0) + item.value
    if not per_engine:
        return None
    return min(1.0, max(0.0, max(per_engine.values()) / 100.0))


class PdhSampler:
    """One open PDH query on the GPU Engine counter; `sample()` collects it and says how busy the GPU was
    since the previous sample. A PDH failure is logged (at WARNING the first time), answers None, and the
    query is rebuilt at the next sample."""

    def __init__(self, api: PdhApi) -> None:
        self.api = api
        self._query: Any = None
        self._counter: Any = None
        self._primed = False
        self._warned = False

    def sample(self) -> float | None:
        try:
            if self._query is None:
                self._open()
            self.api.collect(self._query)
            if not self._primed:  # a rate needs two collections
                self._primed = True
                return None
            return busiest_engine(self.api.counter_items(self._counter))
        except PdhError as error:
            log = logger.debug if self._warned else logger.warning
            log("cannot read the GPU Engine counters, the GPU's load is reported as unknown%s: %s",
                "" if self._warned else " (logged once)", error)
            self._warned = True
            self.close()
            return None

    def close(self) -> None:
        query, self._query, self._counter, self._primed = self._query, None, None, False
        if query is not None:
            try:
                self.api.close_query(query)
            except PdhError as error:
                logger.debug("closing the PDH query: %s", error)

    def _open(self) -> None:
        query = self.api.open_query()
        try:
            self._counter = self.api.add_english_counter(query, GPU_ENGINE_COUNTER)
        except PdhError:
            self.api.close_query(query)
            raise
        self._query = query


def windows_pdh() -> PdhApi | None:
    """The ctypes PDH of this Windows; None on another OS."""
    if sys.platform == "win32":  # pragma: no cover - needs Windows
        return _CtypesPdh()
    return None


if sys.platform == "win32":  # pragma: no cover - needs Windows
    import ctypes
    from ctypes import wintypes

    _PDH_FMT_DOUBLE = 0x00000200
    _PDH_FMT_NOCAP100 = 0x00008000  # the instances of one adapter are summed: no cap at 100 per instance
    _PDH_MORE_DATA = 0x800007D2

    class _FmtCounterValueDouble(ctypes.Structure):
        # PDH_FMT_COUNTERVALUE with the union read as its double: CStatus, 4 bytes of padding, the value
        _fields_ = [("CStatus", wintypes.DWORD), ("doubleValue", ctypes.c_double)]

    class _FmtCounterValueItem(ctypes.Structure):
        _fields_ = [("szName", wintypes.LPWSTR), ("FmtValue", _FmtCounterValueDouble)]

    class _CtypesPdh:
        def __init__(self) -> None:
            pdh = ctypes.WinDLL("pdh")
            self._open = pdh.PdhOpenQueryW
            self._open.argtypes = [wintypes.LPCWSTR, ctypes.c_size_t, ctypes.POINTER(wintypes.HANDLE)]
            self._add = pdh.PdhAddEnglishCounterW
            self._add.argtypes = [wintypes.HANDLE, wintypes.LPCWSTR, ctypes.c_size_t,
                                  ctypes.POINTER(wintypes.HANDLE)]
            self._collect = pdh.PdhCollectQueryData
            self._collect.argtypes = [wintypes.HANDLE]
            self._array = pdh.PdhGetFormattedCounterArrayW
            self._array.argtypes = [wintypes.HANDLE, wintypes.DWORD, ctypes.POINTER(wintypes.DWORD),
                                    ctypes.POINTER(wintypes.DWORD), ctypes.c_void_p]
            self._close = pdh.PdhCloseQuery
            self._close.argtypes = [wintypes.HANDLE]
            for function in (self._open, self._add, self._collect, self._array, self._close):
                function.restype = wintypes.LONG

        def open_query(self) -> Any:
            query = wintypes.HANDLE()
            _check("PdhOpenQueryW", self._open(None, 0, ctypes.byref(query)))
            return query

        def add_english_counter(self, query: Any, path: str) -> Any:
            counter = wintypes.HANDLE()
            _check("PdhAddEnglishCounterW", self._add(query, path, 0, ctypes.byref(counter)))
            return counter

        def collect(self, query: Any) -> None:
            _check("PdhCollectQueryData", self._collect(query))

        def counter_items(self, counter: Any) -> list[CounterItem]:
            form = _PDH_FMT_DOUBLE | _PDH_FMT_NOCAP100
            size, count = wintypes.DWORD(0), wintypes.DWORD(0)
            status = self._array(counter, form, ctypes.byref(size), ctypes.byref(count), None)
            if status & 0xFFFFFFFF != _PDH_MORE_DATA:
                _check("PdhGetFormattedCounterArrayW", status)
                return []  # no instance at all
            buffer = ctypes.create_string_buffer(size.value)
            _check("PdhGetFormattedCounterArrayW",
                   self._array(counter, form, ctypes.byref(size), ctypes.byref(count), buffer))
            items = ctypes.cast(buffer, ctypes.POINTER(_FmtCounterValueItem))
            return [CounterItem(items[index].szName or "", int(items[index].FmtValue.CStatus),
                                float(items[index].FmtValue.doubleValue)) for index in range(count.value)]

        def close_query(self, query: Any) -> None:
            _check("PdhCloseQuery", self._close(query))

    def _check(call: str, status: int) -> None:
        if status != 0:
            raise PdhError(call, status)
