"""What a benchmark ran on: every bench report carries `host_report()` under "host".

The same code measures differently on different CPUs, not only faster or slower: OpenVINO's CPU plugin picks
its kernels by the vector extensions it finds. On the 2-core AMX Xeon of earlier runs 8 rows of a decode step
cost ~1.5x one row; on a 2-core AMD EPYC (Zen 3, AVX2 only) they cost 2.5x, so batching and pipelining
ratios move with the CPU (see README, Benchmarks). A report that names the CPU and its extensions says which
of those it is.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import openvino as ov

from deskfleet.agent import allocator

# The extensions that choose the CPU plugin's kernels for INT4/INT8 weights and f32/bf16 arithmetic.
KERNEL_EXTENSIONS = ("avx2", "avx512f", "avx_vnni", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def host_report() -> dict[str, Any]:
    """The CPU, its kernel extensions, cores, allocator, versions and the load when called (call it last)."""
    cpuinfo = _read_cpuinfo()
    return {"cpu": cpu_name(cpuinfo) or platform.processor() or platform.machine(),
            "cpu_extensions": cpu_extensions(cpuinfo),
            "logical_cores": os.cpu_count(),
            "allocator": allocator.in_use(),
            "openvino": ov.get_version(),
            "python": platform.python_version(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def cpu_name(cpuinfo: str) -> str | None:
    """The first processor's model name in /proc/cpuinfo's text, or None."""
    return _first_field(cpuinfo, "model name")


def cpu_extensions(cpuinfo: str) -> list[str]:
    """Which of KERNEL_EXTENSIONS the first processor's flags in /proc/cpuinfo's text list, in that order."""
    flags = set((_first_field(cpuinfo, "flags") or "").split())
    return [name for name in KERNEL_EXTENSIONS if name in flags]


def _first_field(cpuinfo: str, name: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""
