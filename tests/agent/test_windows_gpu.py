"""The Windows GPU sampler over a fake PDH: English counter path, rate priming, per-adapter sums, failures."""

from __future__ import annotations

from typing import Any

import pytest

from deskfleet.agent import windows_gpu
from deskfleet.agent.monitor import HostMonitor, HostProbes
from deskfleet.agent.windows_gpu import (
    GPU_ENGINE_COUNTER,
    CounterItem,
    PdhError,
    PdhSampler,
    busiest_engine,
    windows_pdh,
)

A = "luid_0x00000000_0x0000D1A2"
B = "luid_0x00000000_0x0000BEEF"
VALID, NEW, INVALID = 0x0, 0x1, 0xC0000BBA  # PDH_CSTATUS_VALID_DATA, _NEW_DATA, _INVALID_DATA


def engine(pid: int, adapter: str, kind: str = "3D", value: float = 0.0, status: int = VALID) -> CounterItem:
    return CounterItem(f"pid_{pid}_{adapter}_phys_0_eng_0_engtype_{kind}", status, value)


class FakePdh:
    """Records the calls; `samples` are what successive collections yield; `fail` names a call to fail."""

    def __init__(self, samples: list[list[CounterItem]]) -> None:
        self.samples = samples
        self.calls: list[tuple[str, Any]] = []
        self.fail: str | None = None
        self.open_queries = 0
        self._collected = -1

    def _call(self, name: str, argument: Any = None) -> None:
        self.calls.append((name, argument))
        if self.fail == name:
            raise PdhError(name, 0xC0000BB8)

    def open_query(self) -> Any:
        self._call("open_query")
        self.open_queries += 1
        return f"query{self.open_queries}"

    def add_english_counter(self, query: Any, path: str) -> Any:
        self._call("add_english_counter", path)
        return f"counter of {query}"

    def collect(self, query: Any) -> None:
        self._call("collect", query)
        self._collected += 1

    def counter_items(self, counter: Any) -> list[CounterItem]:
        self._call("counter_items", counter)
        return self.samples[min(self._collected, len(self.samples) - 1)]

    def close_query(self, query: Any) -> None:
        self._call("close_query", query)
        self.open_queries -= 1


def test_instances_of_one_adapter_add_up_and_the_busiest_adapter_answers() -> None:
    items = [engine(1, A, value=30.5), engine(2, A, value=12.0), engine(3, B, value=40.0),
             engine(4, A, kind="VideoDecode", value=90.0), engine(5, B, value=80.0, status=INVALID)]
    assert busiest_engine(items) == pytest.approx(0.425)  # A's 3D: 30.5 + 12; B's valid 3D: 40


def test_compute_engines_count_each_type_on_its_own_and_video_does_not() -> None:
    # Only 3D counted: OpenCL work (an OpenVINO GPU stage, a renderer), which Intel's driver may put on the
    # Compute engines, read as an idle GPU
    assert busiest_engine([engine(1, A, kind="Compute", value=64.0)]) == pytest.approx(0.64)
    items = [engine(1, A, value=30.0), engine(2, A, kind="Compute", value=50.0), engine(3, A, kind="Compute",
             value=20.0), engine(4, A, kind="VideoEncode", value=95.0)]
    assert busiest_engine(items) == pytest.approx(0.70)  # Compute 50 + 20, the busiest type; not 3D + Compute
    assert busiest_engine([engine(1, A, kind="VideoDecode", value=90.0)]) is None  # a video call does not count


def test_no_valid_counted_instance_is_unknown_and_sums_are_clamped() -> None:
    assert busiest_engine([]) is None
    assert busiest_engine([engine(1, A, kind="Copy", value=50.0)]) is None
    assert busiest_engine([engine(1, A, value=float("nan"))]) is None
    assert busiest_engine([engine(1, A, value=70.0), engine(2, A, value=60.0, status=NEW)]) == 1.0
    assert busiest_engine([engine(1, A, value=-5.0)]) == 0.0


def test_the_counter_is_added_by_its_english_path_and_the_first_sample_only_primes_the_rate() -> None:
    pdh = FakePdh([[engine(1, A, value=99.0)], [engine(1, A, value=25.0)], [engine(1, A, value=50.0)]])
    sampler = PdhSampler(pdh)
    assert sampler.sample() is None  # one collection: a rate has nothing to compare with yet
    assert sampler.sample() == 0.25
    assert sampler.sample() == 0.5
    assert ("add_english_counter", GPU_ENGINE_COUNTER) in pdh.calls
    assert GPU_ENGINE_COUNTER == r"\GPU Engine(*)\Utilization Percentage"
    assert [name for name, _ in pdh.calls].count("open_query") == 1  # one query kept open


def test_a_failing_collection_is_unknown_logged_once_and_the_query_is_rebuilt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    monkeypatch.setattr(windows_gpu.logger, "warning", lambda text, *args: warnings.append(text % args))
    pdh = FakePdh([[engine(1, A, value=10.0)]])
    sampler = PdhSampler(pdh)
    sampler.sample()
    assert sampler.sample() == 0.1
    pdh.fail = "collect"
    assert sampler.sample() is None
    assert sampler.sample() is None
    assert len(warnings) == 1 and "0xC0000BB8" in warnings[0] and "GPU Engine" in warnings[0]
    assert pdh.open_queries == 0  # the failed query was closed, not leaked
    pdh.fail = None
    assert sampler.sample() is None  # a rebuilt query primes its rate again
    assert sampler.sample() == 0.1
    assert pdh.open_queries == 1


def test_a_counter_windows_does_not_have_closes_the_query_it_opened() -> None:
    pdh = FakePdh([[]])
    pdh.fail = "add_english_counter"  # e.g. a Windows without WDDM 2.4 GPU counters
    sampler = PdhSampler(pdh)
    assert sampler.sample() is None
    assert pdh.open_queries == 0


def test_host_monitor_on_windows_reads_the_gpu_through_pdh() -> None:
    pdh = FakePdh([[engine(1, A, value=5.0)], [engine(1, A, value=75.0)]])
    probes = HostProbes(cpu_load=lambda: 0.1, memory=lambda: (1, 2), battery=lambda: None, temperatures=lambda: ())
    monitor = HostMonitor(platform="win32", probes=probes, pdh=pdh)
    assert monitor.read().igpu_busy is None
    assert monitor.read().igpu_busy == 0.75


def test_off_windows_there_is_no_pdh() -> None:
    assert windows_pdh() is None
    assert HostMonitor(platform="darwin", probes=HostProbes(battery=lambda: None)).read().igpu_busy is None
