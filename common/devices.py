"""OpenVINO device names, as deskfleet settings and messages carry them.

A name may carry an index ("GPU.1") or a list of targets ("HETERO:GPU,CPU"); what the code decides on
(compile properties, a stage's warm-up and huge pages, the planner's cost model) is the kind before them.
"""

from __future__ import annotations

import re

VIRTUAL = frozenset({"AUTO", "MULTI", "HETERO", "BATCH"})  # devices that pick, combine or batch real ones
_DEVICE_NAME = re.compile(r"[A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*")  # "GPU", "GPU.1", a tile "GPU.1.0"
_DEVICE_NAME_CHARS = 32  # the longest name a discovery record carries
_DEVICE_TARGET = re.compile(r"(?P<excluded>-?)(?P<name>" + _DEVICE_NAME.pattern + r")(?:\([0-9]{1,4}\))?")


def device_kind(device: str) -> str:
    """ "CPU" for "CPU", "cpu" or "CPU.0"; "GPU" for "GPU.1"; "HETERO" for "HETERO:GPU,CPU"."""
    return device.split(":")[0].split(".")[0].strip().upper()


def lists_device(device: str, available: tuple[str, ...] | list[str]) -> bool:
    """Whether a host whose OpenVINO lists `available` has `device`: "GPU" when any GPU is listed ("GPU.0",
    "GPU.1"), "GPU.1" only when it is, and "GPU.0" also for a lone GPU listed as "GPU". A virtual device with
    targets ("AUTO:GPU,CPU", "MULTI:GPU,NPU") when every one of them is listed: OpenVINO's AUTO:GPU,CPU on a PC
    without a GPU driver failed to compile with the GPU plugin's library error rather than fall back on the CPU,
    and the agent refuses it by name (agent/stage.py); a bare one ("AUTO", "AUTO:-NPU") picks among what there
    is: True. `device` in OpenVINO's syntax (device_targets)."""
    kind = device_kind(device)
    if kind in VIRTUAL:
        targets = device_targets(device)
        return targets == (kind,) or all(lists_device(target, available) for target in targets)
    return device in available or (device == kind and any(device_kind(found) == kind for found in available)) \
        or (device == f"{kind}.0" and kind in available)


def device_targets(device: str) -> tuple[str, ...]:
    """The devices an OpenVINO device name runs on, as the discovery record lists them: "GPU.1" ->
    ("GPU.1",); a virtual device's list -> its targets ("AUTO:GPU,CPU" and "HETERO:GPU,CPU" -> ("GPU",
    "CPU")), those excluded with "-" ("AUTO:-NPU") and request counts ("MULTI:GPU(4),CPU") left out, and
    the virtual device itself when none is left ("AUTO", "AUTO:-NPU" -> ("AUTO",)).

    ValueError when `device` is not OpenVINO's syntax: an upper-case name with optional ".index"es, or
    AUTO, MULTI, HETERO or BATCH with an optional ":" and a comma-separated list of such names.
    """
    kind, colon, listed = device.partition(":")
    if not colon:
        if not _is_device_name(device) or (device_kind(device) in VIRTUAL and device not in VIRTUAL):
            upper = f" (names are upper case: {device.upper()})" if _is_device_name(device.upper()) else ""
            raise ValueError(f"{device!r} is not an OpenVINO device name such as CPU, GPU.1 or AUTO:GPU,CPU{upper}")
        return (device,)
    if kind not in VIRTUAL:
        upper = f" (names are upper case: {device.upper()})" if kind.upper() in VIRTUAL else ""
        raise ValueError(f"{device!r}: only {', '.join(sorted(VIRTUAL))} take a list of devices after ':'{upper}")
    targets: list[str] = []
    for item in listed.split(","):
        target = _DEVICE_TARGET.fullmatch(item)
        if target is None or not _is_device_name(target["name"]) or device_kind(target["name"]) in VIRTUAL:
            raise ValueError(f"{device!r}: {item!r} is not a device name such as CPU or GPU.1")
        if not target["excluded"] and target["name"] not in targets:
            targets.append(target["name"])
    return tuple(targets) or (kind,)


def _is_device_name(name: str) -> bool:
    return len(name) <= _DEVICE_NAME_CHARS and _DEVICE_NAME.fullmatch(name) is not None
