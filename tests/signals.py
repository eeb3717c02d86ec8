"""Signals a test sends its own process, and a fresh process to send them in.

Twice, a fresh-clone CI run died with a segmentation fault (exit 139, no Python traceback) at the first test that
sent the pytest process a SIGINT (tests/common/test_console.py), right after the agent tests. The cause, found
later: every ov.Core loaded a CPU plugin of its own, which gives its thread an alternate signal stack and unmaps
it when destroyed; Cores released out of order or on another thread left the main thread's alternate stack
unmapped, and Python runs signal handlers there (agent/openvino_core.py, which now gives the process one Core,
and tests/agent/test_openvino_core.py). The tests of signal handling itself still run in a fresh Python process
(`in_fresh_process`): what they test is how one process takes a Ctrl-C, and a child with nothing loaded before
is that process.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

_CHILD = "DESKFLEET_TEST_IN_FRESH_PROCESS"  # set in the child: the test named there runs in place


def signal_main_thread(signum: int = signal.SIGINT) -> None:
    """Deliver `signum` to this process's main thread, as a Ctrl-C (or `kill`) would reach Python."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signum)


def in_fresh_process(test: Callable[[], None]) -> Callable[[], None]:
    """Run the test (one without fixtures) in a child pytest of its own; its failure is the child's output."""
    @functools.wraps(test)
    def run() -> None:
        if os.environ.get(_CHILD) == test.__name__:
            test()
            return
        node = f"{Path(test.__code__.co_filename)}::{test.__name__}"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                              env={**os.environ, _CHILD: test.__name__}, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, f"{node} in a fresh process (exit {done.returncode}):\n" \
                                     f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"

    return run
