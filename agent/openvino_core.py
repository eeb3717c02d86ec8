"""The process's one OpenVINO Core: every stage, probe and device query of deskfleet goes through it.

Why one, kept until the process exits: OpenVINO's CPU plugin (intel_cpu's sigstack_manager, seen with 2026.x)
gives the thread that loads it an alternate signal stack of its own (mmap) and, when the plugin is destroyed,
unmaps that stack, putting back the thread's previous one only where the destroying thread is the loading thread
and the plugin's stack is still that thread's current one. Every ov.Core loads a plugin of its own, so Cores
released on another thread than the one that loaded them, or out of the order they were made in, leave a
thread's alternate stack pointing at unmapped memory. Python runs its signal handlers on the alternate stack:
the next Ctrl-C or SIGTERM delivered to that thread kills the process with a segmentation fault and no
traceback (the fault handler runs on the same stack). Reproduced here: a 3-stage LocalPipeline closed and
released, then a Ctrl-C (exit 139); a Core made on the main thread and released on another, then a Ctrl-C;
and twice in CI, at the first test that sent the test process a SIGINT after tests that had built stages.

With one Core its CPU plugin is loaded once and never destroyed while Python runs, so no thread's stack is
unmapped under it. Reading a model needs no plugin, but goes through it too (per-read properties, such as
ENABLE_MMAP, are passed to read_model, never set on the shared Core). The Core is safe to use from several
threads (OpenVINO's Core and CompiledModel are; an InferRequest is not).
"""

from __future__ import annotations

import threading

import openvino as ov

_lock = threading.Lock()
_core: ov.Core | None = None


def openvino_core() -> ov.Core:
    """The process's Core, made at the first call (from any thread) and kept until the process exits."""
    global _core
    with _lock:
        if _core is None:
            _core = ov.Core()
        return _core
