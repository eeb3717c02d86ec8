"""A short measurement of how fast this PC decodes, for the planner.

Decoding one token reads every weight once, so a stage's decode time is about its weight bytes divided by
the rate at which the device streams weights through a MatVec. The probe compiles a MatVec over
`weight_bytes` of f16 weights on the configured device, times it, and reports weight GB/s. Layers are
then planned in proportion to this figure. The result is cached per (device, software version, hardware:
CPU model, cores, installed memory) in the agent's state folder: the probe costs about a second, not at
every start, and a memory upgrade or a state folder copied to another PC is measured again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import psutil

from deskfleet.common.atomic_file import write_atomic

from .openvino_core import openvino_core

log = logging.getLogger(__name__)

CACHE_NAME = "speed_probe.json"
MAX_GB_PER_S = 1e5  # what a StatusReport takes (weight_gb_per_s); a cached figure outside is measured over


@dataclass(frozen=True)
class SpeedMeasurement:
    device: str
    version: str
    weight_gb_per_s: float  # f16 weight bytes a MatVec streams per second
    seconds_per_call: float


def measure_speed(device: str = "CPU", weight_bytes: int = 64 << 20, calls: int = 20,
                  clock: Callable[[], float] = time.perf_counter, num_threads: int | None = None) -> SpeedMeasurement:
    """Time `calls` MatVecs over `weight_bytes` of f16 weights on `device`; median seconds per call."""
    rows = 4096
    columns = max(1, weight_bytes // (2 * rows))
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((columns, rows), dtype=np.float32).astype(np.float16)  # [in, out]
    vector = ops.parameter(ov.PartialShape([1, columns]), ov.Type.f32, name="x")
    product = ops.matmul(vector, ops.convert(ops.constant(weights), ov.Type.f32), False, False)
    model = ov.Model([ops.result(product)], [vector], "speed-probe")
    core = openvino_core()
    config = {"PERFORMANCE_HINT": "LATENCY"}
    if num_threads:
        config["INFERENCE_NUM_THREADS"] = str(num_threads)
    request = core.compile_model(model, device, config).create_infer_request()
    inputs = {"x": np.ones((1, columns), dtype=np.float32)}
    request.infer(inputs)  # warm-up: first call allocates
    timings = []
    for _ in range(calls):
        started = clock()
        request.infer(inputs)
        timings.append(clock() - started)
    seconds = float(np.median(timings))
    measured_bytes = columns * rows * 2
    return SpeedMeasurement(device=device, version=ov.get_version(), weight_gb_per_s=measured_bytes / seconds / 1e9,
                            seconds_per_call=seconds)


def cached_speed(state_dir: Path, device: str, measure: Callable[[str], SpeedMeasurement] = measure_speed
                 ) -> SpeedMeasurement:
    """The cached measurement for this device and OpenVINO version, measuring (and caching) when absent.

    A cache file that cannot be read is measured over, never trusted.
    """
    path = state_dir / CACHE_NAME
    hardware = hardware_fingerprint()
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        measured_on = body.pop("hardware", None) if isinstance(body, dict) else None
        cached = SpeedMeasurement(**body)
        speed = cached.weight_gb_per_s
        if (cached.device == device and cached.version == ov.get_version() and measured_on == hardware
                and type(speed) in (int, float) and 0 < speed < MAX_GB_PER_S):  # json reads Infinity and 1e999
            return cached
    except (OSError, ValueError, TypeError, RecursionError):
        pass
    measured = measure(device)
    log.info("measured %.1f GB/s of weights on %s", measured.weight_gb_per_s, device)
    try:
        write_atomic(path, json.dumps({**asdict(measured), "hardware": hardware}).encode("utf-8"))
    except OSError as error:  # a read-only state folder: the measurement still counts, for this run
        log.warning("cannot keep the speed measurement in %s (%s): it is measured again at the next start",
                    path, error.strerror or error)
    return measured


def hardware_fingerprint() -> str:
    """What a measured rate depends on besides the device and OpenVINO: the CPU model, its logical cores and
    the installed memory in GiB."""
    return f"{_cpu_model()} | {os.cpu_count()} cores | {psutil.virtual_memory().total >> 30} GiB"


def _cpu_model() -> str:
    try:  # Linux names the model here; platform.processor() is often empty there
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
