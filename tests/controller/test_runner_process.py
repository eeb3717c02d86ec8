"""stop_processes: what the benches and the integration fleet use to end their child processes."""

from __future__ import annotations

import subprocess
import sys
import time

from deskfleet.controller.bench.runner_process import stop_processes

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")


def test_running_processes_are_terminated_and_one_that_ignores_it_is_killed() -> None:
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"  # its handler is set
    began = time.monotonic()
    stop_processes([polite, stubborn, done], timeout=1.0)
    assert time.monotonic() - began < 10
    assert polite.returncode == -15 and stubborn.returncode == -9 and done.returncode == 0
