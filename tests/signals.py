"""Signals a test sends its own process, to the main thread only.

`os.kill(os.getpid(), SIGINT)` lets the kernel hand the signal to any thread that does not block it: with an
OpenVINO stage or a transformers model loaded earlier in the run, that may be one of their worker threads,
interrupted in native code. A fresh-clone CI run died with a segmentation fault at the first such test
(tests/common/test_console.py, after the agent tests), which passes alone and passed in the runs before; the
likeliest cause is that. Python runs the handler on the main thread either way, so sending it there tests the
same thing without the risk.
"""

from __future__ import annotations

import signal
import threading


def signal_main_thread(signum: int = signal.SIGINT) -> None:
    """Deliver `signum` to this process's main thread, as a Ctrl-C (or `kill`) would reach Python."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signum)
