"""Signals a test sends its own process, and a fresh process to send them in.

Twice, a fresh-clone CI run died with a segmentation fault (exit 139, no Python traceback) at the first test that
sends the pytest process a SIGINT (tests/common/test_console.py), right after the agent tests, which load
OpenVINO stages and leave their native worker threads behind; the same tests pass alone, and in that order in
local runs. Sending the signal to the main thread (`signal_main_thread`) did not help, so the cause lies in the
state those earlier tests leave in the process, not known more closely. The tests of signal handling itself run
in a fresh Python process (`in_fresh_process`): what they test is how one process takes a Ctrl-C, and a child
with nothing loaded before is that process.
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
