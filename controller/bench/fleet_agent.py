"""One simulated PC for `deskfleet bench fleet`: an agent core in its own process, pinned to its own cores.

    python -m deskfleet.controller.bench.fleet_agent --tls-dir D --name N --listen HOST:PORT --cores 0[,1]
        --cache DIR [--threads 1] [--port-file F] [--stop-on-stdin-eof]

The same AgentCore and TLS server as the headless agent (deploy, shards, stages, Forward relaying over
real TLS websockets), without enrollment or mDNS: the bench issues its certificate directly. The process
is pinned with os.sched_setaffinity and compiles its stage with INFERENCE_NUM_THREADS = --threads; every PC
reports the same pinned speed, so plans split the layers evenly. With PORT 0 it listens on a free port and
writes the port to --port-file once listening (ports picked by the parent and bound later can be taken in
between, e.g. by the ephemeral port of another connection). With --stop-on-stdin-eof it stops when its stdin
reaches the end: the bench holds the other end of that pipe, which the kernel closes however the bench ends
(SIGKILL, the OOM killer, a crash), so no simulated PC outlives it holding a port and a compiled model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from deskfleet.agent.allocator import run_on_jemalloc
from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import TlsFiles, start_server
from deskfleet.agent.monitor import HostMonitor
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.agent.speed_probe import SpeedMeasurement
from deskfleet.agent.stage import openvino_devices
from deskfleet.common import event_loop
from deskfleet.common.arguments import path_argument, whole_number
from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.wire import parse_address

log = logging.getLogger(__name__)

SIMULATED_PC_GB_PER_S = 10.0


async def serve(files: TlsFiles, listen: str, cache_dir: Path, threads: int, port_file: Path | None,
                stop_on_stdin_eof: bool = False) -> None:
    # Every simulated PC is one core of the same machine: a pinned speed gives every PC the same weight in
    # the plan (measured speeds of PCs sharing a memory bus are noise and split the layers unevenly).
    settings = AgentSettings(speed_gb_per_s=SIMULATED_PC_GB_PER_S,
                             thresholds=Thresholds(require_ac_power=False, min_battery_percent=None,
                                                   max_temperature_c=None, min_free_memory_bytes=None,
                                                   max_cpu_load=None))
    pinned = SpeedMeasurement(settings.device, "pinned for the bench", SIMULATED_PC_GB_PER_S, 0.0)
    core = AgentCore(files, settings, ShardCache(cache_dir, 16 << 30), HostMonitor(), num_threads=threads,
                     speed_probe=lambda: pinned, device_probe=openvino_devices)
    host, port = parse_address(listen, any_port=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if stop_on_stdin_eof:

        def stop_soon() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already (a signal stopped this PC)
                loop.call_soon_threadsafe(stop.set)

        _call_at_stdin_eof(stop_soon)
    server = await start_server(core.serve_link, host, port, files, revocations=core.revocations,
                                large_frames=core.takes_large_frames)
    port = int(next(iter(server.sockets)).getsockname()[1])
    if port_file is not None:
        write_atomic(port_file, f"{port}\n".encode())
    log.info("bench agent %s on %s:%d", core.agent_id[:12], host, port)
    async with server:
        await stop.wait()
    await core.close()


def _call_at_stdin_eof(callback: Callable[[], object]) -> None:
    """Call `callback` (from a thread of its own) once stdin reaches its end, whatever was written to it."""
    stdin = sys.stdin.fileno()

    def wait_for_eof() -> None:
        try:
            while os.read(stdin, 4096):  # nothing is expected: only the end matters
                pass
        except OSError:  # a stdin that cannot be read has no writer to wait for either
            pass
        callback()

    threading.Thread(target=wait_for_eof, name="stop-on-stdin-eof", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tls-dir", type=path_argument, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--cores", required=True, help="comma-separated CPU numbers")
    parser.add_argument("--cache", type=path_argument, required=True)
    parser.add_argument("--threads", type=whole_number, default=1)
    parser.add_argument("--port-file", type=path_argument, default=None, help="write the listening port here")
    parser.add_argument("--stop-on-stdin-eof", action="store_true",
                        help="stop when stdin reaches its end (the bench that started it ended)")
    args = parser.parse_args()
    run_on_jemalloc("CPU")  # as the agent runs a CPU stage (deskfleet/agent/allocator.py)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.sched_setaffinity(0, {int(core) for core in args.cores.split(",")})
    event_loop.run(serve(TlsFiles.in_folder(args.tls_dir, args.name), args.listen, args.cache, args.threads,
                      args.port_file, args.stop_on_stdin_eof))


if __name__ == "__main__":
    main()
