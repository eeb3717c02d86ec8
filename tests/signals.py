"""Signals a test sends its own process, to the main thread only.

`os.kill(os.getpid(), SIGINT)` lets the kernel hand the signal to another thread that does not block it (Linux
prefers the main thread, but not when a signal is already pending there): with an OpenVINO stage or a
transformers model loaded earlier in the run, one of their worker threads, interrupted in native code. A
fresh-clone CI run died with a segmentation fault at the first such test (tests/common/test_console.py, after
the agent tests); it passed in every run before and after, and 4 runs of tests/agent + tests/common in a row did
not bring it back, so the cause is not known, and this is only the likeliest one we could see. Python runs the
handler on the main thread either way, so sending it there tests the same thing without that risk.
"""

from __future__ import annotations

import signal
import threading


def signal_main_thread(signum: int = signal.SIGINT) -> None:
    """Deliver `signum` to this process's main thread, as a Ctrl-C (or `kill`) would reach Python."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signum)
