"""Loopback ports for tests that must name a server's port before the server binds it.

A port picked by binding port 0 comes from the kernel's ephemeral range, the range every outgoing
connection and every other port-0 bind draws from too: between the probe's close and the server's bind,
another socket of the test run could be given it, and the server's bind then failed (a fresh-clone CI
run, stop 30). These come from below that range, where the kernel hands out nothing by itself; within one
test process no port is handed out twice, and each is checked free (nothing bound, nothing listening)
before it is given.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # above the registered services a test machine might run (5353 mDNS, 7341 our default...)
_handed_out: set[int] = set()
_choice = random.Random()  # its own generator: a test that seeds `random` does not make two runs collide


def _first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and Windows start at 49152


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nobody listens on and no socket of the kernel's choosing will be given (a dial there is
    refused at once; a server may bind it)."""
    highest = _first_ephemeral_port() - 1
    if highest <= _LOWEST:
        raise RuntimeError(f"the ephemeral port range starts at {highest + 1}: no room below it for test ports")
    for _ in range(1000):
        port = _choice.randint(_LOWEST, highest)
        if port not in _handed_out and _is_free(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port between {_LOWEST} and {highest} after 1000 tries")


def free_address() -> str:
    """`free_port` as a loopback host:port."""
    return f"{LOOPBACK}:{free_port()}"
