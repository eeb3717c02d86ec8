"""OpenVINO device names, as deskfleet settings and messages carry them.

A name may carry an index ("GPU.1") or a list of targets ("HETERO:GPU,CPU"); what the code decides on
(compile properties, a stage's warm-up and huge pages, the planner's cost model) is the kind before them.
"""

from __future__ import annotations

VIRTUAL = frozenset({"AUTO", "MULTI", "HETERO", "BATCH"})  # devices that pick, combine or batch real ones


def device_kind(device: str) -> str:
    """ "CPU" for "CPU", "cpu" or "CPU.0"; "GPU" for "GPU.1"; "HETERO" for "HETERO:GPU,CPU"."""
    return device.split(":")[0].split(".")[0].strip().upper()


def lists_device(device: str, available: tuple[str, ...] | list[str]) -> bool:
    """Whether a host whose OpenVINO lists `available` has `device`: "GPU" when any GPU is listed ("GPU.0",
    "GPU.1"), "GPU.1" only when it is, and "GPU.0" also for a lone GPU listed as "GPU". A virtual device
    (AUTO, MULTI, ...) picks among what there is: True."""
    kind = device_kind(device)
    if kind in VIRTUAL:
        return True
    return device in available or (device == kind and any(device_kind(found) == kind for found in available)) \
        or (device == f"{kind}.0" and kind in available)
