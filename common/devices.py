"""OpenVINO device names, as deskfleet settings and messages carry them.

A name may carry an index ("GPU.1") or a list of targets ("HETERO:GPU,CPU"); what the code decides on
(compile properties, a stage's warm-up and huge pages, the planner's cost model) is the kind before them.
"""

from __future__ import annotations

VIRTUAL = frozenset({"AUTO", "MULTI", "HETERO", "BATCH"})  # devices that pick, combine or batch real ones


def device_kind(device: str) -> str:
    """ "CPU" for "CPU", "cpu" or "CPU.0"; "GPU" for "GPU.1"; "HETERO" for "HETERO:GPU,CPU"."""
    return device.split(":")[0].split(".")[0].strip().upper()
