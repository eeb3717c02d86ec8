"""The open-files limit of a process that listens for fleet members (an agent, `fleet serve`, `serve`).

Every connection takes a file descriptor until it is dropped: a TLS handshake never finished for up to 10 s, a
websocket that says no Hello for 10 s more. At a service manager's usual soft limit (1024) one host on the LAN that
held 3,000 idle connections to an agent made it refuse its controller, fail its sensor reads ("Too many open
files") and drop out of plans while the flood lasted. The hard limit is the admin's; the soft one is the process's
to raise up to it, which these processes do at start."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

WANTED = 65536  # plenty for an office's PCs, their links and a flood of strangers lasting 10 s each


def raise_open_files_limit(wanted: int = WANTED, limits: tuple[Callable[[], tuple[int, int]],
                                                          Callable[[tuple[int, int]], None]] | None = None
                           ) -> tuple[int, int] | None:
    """Raise the soft limit on open files to `wanted`, or to the hard limit where that is lower; never lower it.
    Returns (the soft limit before, after), or None where the platform has no such limit (Windows) or refused.
    `limits`: (get, set) of RLIMIT_NOFILE, for tests."""
    if limits is None:
        try:
            import resource
        except ImportError:  # Windows: no per-process descriptor limit of this kind
            return None
        infinity = resource.RLIM_INFINITY
        limits = (lambda: resource.getrlimit(resource.RLIMIT_NOFILE),
                  lambda pair: resource.setrlimit(resource.RLIMIT_NOFILE, pair))
    else:
        infinity = -1
    get, set_limit = limits
    soft, hard = get()
    target = wanted if hard == infinity else min(wanted, hard)
    if soft != infinity and soft < target:
        try:
            set_limit((target, hard))
        except (ValueError, OSError):  # a sandbox that refuses it: the soft limit stays as it was
            return None
        return soft, target
    return soft, soft


def log_open_files_limit(raised: tuple[int, int] | None) -> None:
    """Say in the log what raise_open_files_limit did, where it raised the limit."""
    if raised is not None and raised[1] != raised[0]:
        log.info("open files limit raised from %d to %d (each connection takes one)", *raised)
