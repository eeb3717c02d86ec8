"""The process's memory allocator: jemalloc where it is installed, for CPU inference on Linux.

Every OpenVINO call on the CPU allocates and frees small objects (executors, memory descriptors, shape
vectors) around the kernels, and glibc's malloc/free are a visible part of a small stage's step: perf on
the demo target found _int_malloc/_int_free/malloc/free at twice their share when the call width changes
(plain steps and verifications alternating). Measured on the 2-core development VM, glibc's malloc against
jemalloc, processes alternating:
- the demo target's call: one token 1.43-1.51 -> 1.28-1.38 ms, the width-switch penalty 1.04-1.09 ->
  0.73-0.79 ms; prompt lookup 1.89-1.90x -> 1.96-1.97x of plain decoding (`bench speculative`, 2 pairs);
- one core vs GenAI's continuous batching on glibc (`bench streams`, 170M, 5-round runs): 0.93-1.02x ->
  0.98-1.07x over 1/2/4/8 users in two pairs on a quiet host; a third pair on a busier host, no
  difference (0.91-0.95x either way);
- the fleet (`bench fleet`, 330M, steps of 12-25 ms): within noise (2 PCs 1 stream 0.90 -> 0.92x);
- peak RSS +16-18 MB (jemalloc's arenas); memory per extra stream unchanged.

How: a process that is about to run CPU inference calls `run_on_jemalloc(device)` before it loads
OpenVINO; when jemalloc is installed (Debian: libjemalloc2) and not loaded yet, the process re-executes
itself (same PID, same command line) with LD_PRELOAD naming it. Only processes that replay their own
command line do this (the CLIs' `main()` without an argv, the bench's simulated PCs), never a test or a
library caller.

Traps:
- OpenVINO's TBB dlopens libtbbbind with RTLD_DEEPBIND; hwloc inside it then frees with glibc's free what
  libc allocated with jemalloc, and the process aborts in core.compile_model ("free(): invalid pointer",
  oneTBB issue 1645). TBB_ENABLE_SANITIZERS=1 makes TBB load it without RTLD_DEEPBIND; it is set with the
  preload.
- Intel's GPU runtime dlopens some of its libraries with RTLD_DEEPBIND as well, which could break the same
  way and cannot be tested here: only a CPU device gets jemalloc.
- A baseline in a child process (GenAI) must run as it ships: `system_environment()` strips the preload.

DESKFLEET_ALLOCATOR=system keeps glibc's malloc.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from deskfleet.agent.huge_pages import read_maps
from deskfleet.common.devices import device_kind
from deskfleet.common.launch import block_across_exec, restore_default_signals, unblock_held_signals

log = logging.getLogger(__name__)

ENV_VAR = "DESKFLEET_ALLOCATOR"  # "jemalloc" (the default) or "system"
CHOICES = ("jemalloc", "system")
PRELOADED_VAR = "DESKFLEET_JEMALLOC_PRELOADED"  # set on the re-executed process: the library it preloaded
MALLOC_CONF_VAR = "MALLOC_CONF"  # jemalloc's options
BACKGROUND_THREAD = "background_thread:true"  # see _with_background_thread
TBB_VAR = "TBB_ENABLE_SANITIZERS"  # oneTBB: load tbbbind without RTLD_DEEPBIND (see the module's traps)
PROC_MAPS = Path("/proc/self/maps")


# Public functions

def jemalloc_environment(device: str, environ: Mapping[str, str] | None = None, platform: str | None = None,
                         find: Callable[[str], str | None] = ctypes.util.find_library) -> dict[str, str] | None:
    """The environment to re-execute this process in so that it runs on jemalloc, or None to stay as it is:
    not Linux, not a CPU device, DESKFLEET_ALLOCATOR=system, jemalloc already preloaded or tried once, or no
    jemalloc installed. An unknown DESKFLEET_ALLOCATOR value raises ValueError naming it."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV_VAR, "jemalloc").strip().lower() or "jemalloc"
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={environ[ENV_VAR]!r}: choose one of {', '.join(CHOICES)}")
    if choice == "system" or (platform or sys.platform) != "linux" or device_kind(device) != "CPU":
        return None
    preload = environ.get("LD_PRELOAD", "")
    if PRELOADED_VAR in environ or "jemalloc" in preload:
        return None  # already on it, or the preload was tried and did not take: never loop
    library = find("jemalloc")
    if library is None:
        return None
    return {**environ, "LD_PRELOAD": f"{library} {preload}".strip(), TBB_VAR: "1", PRELOADED_VAR: library,
            MALLOC_CONF_VAR: _with_background_thread(environ.get(MALLOC_CONF_VAR, ""))}


def _with_background_thread(conf: str) -> str:
    """jemalloc's MALLOC_CONF with its background purging threads on (unless the environment's says otherwise).

    jemalloc gives an arena's freed pages back to the system as the arena is used again; an arena no thread uses any
    more never does. The CPU plugin runs each compiled model's calls on a thread of its own, left parked when the
    model goes (README: a thread per compile), so the buffers of every stage an agent let go stayed resident in that
    thread's arena: the demo target assigned, fed a 900-token prompt and released, in-process, grew by 38 MB a cycle,
    12 s after each, with the plugin's memory freed (Stage.release_memory); with background threads, 5 MB."""
    if "background_thread" in conf:
        return conf
    return f"{conf},{BACKGROUND_THREAD}" if conf else BACKGROUND_THREAD


def run_on_jemalloc(device: str) -> None:
    """Re-execute this process on jemalloc when `jemalloc_environment` says so; otherwise return. Call it
    before anything is printed or started: the process image is replaced (same PID and command line)."""
    environment = jemalloc_environment(device)
    if environment is None:  # on jemalloc already (re-executed), or not wanted
        unblock_held_signals()  # blocked across the re-exec: a main() without the launcher takes them from here
        return
    log.debug("re-executing on %s", environment[PRELOADED_VAR])
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None when the shell closed it (`>&-`): nothing to flush
            stream.flush()
    block_across_exec()  # a SIGTERM or Ctrl-C while the new interpreter starts is then taken by its launcher
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    finally:  # reached only when the exec failed
        restore_default_signals()


def system_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` without the jemalloc preload this module added, for a child that must run as it ships."""
    environ = dict(os.environ if environ is None else environ)
    library = environ.pop(PRELOADED_VAR, None)
    if library is None:
        return environ
    rest = [entry for entry in environ.get("LD_PRELOAD", "").split() if entry != library]
    if rest:
        environ["LD_PRELOAD"] = " ".join(rest)
    else:
        environ.pop("LD_PRELOAD", None)
    environ.pop(TBB_VAR, None)
    conf = environ.get(MALLOC_CONF_VAR, "")
    if conf == BACKGROUND_THREAD:
        environ.pop(MALLOC_CONF_VAR)
    elif conf.endswith(f",{BACKGROUND_THREAD}"):
        environ[MALLOC_CONF_VAR] = conf.removesuffix(f",{BACKGROUND_THREAD}")
    return environ


def in_use(maps: Path = PROC_MAPS) -> str:
    """ "jemalloc" when this process has jemalloc mapped, else "system" (for benchmark reports)."""
    try:
        text = read_maps(maps)
    except OSError:
        return "system"
    return "jemalloc" if "libjemalloc" in text else "system"
