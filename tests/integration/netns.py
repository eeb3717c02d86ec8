"""Small network-namespace tests' shared pieces (test_mdns_ipv6.py, test_link_blip.py): a node process started in a
namespace, and the namespaces and host-side links removed. test_fleet.py's sweep takes what a killed run left."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from tests.integration.test_fleet import _environment, _ip

REPO = Path(__file__).resolve().parents[2]


def start_in(namespace: str, module: str, *argv: str) -> subprocess.Popen[str]:
    """`python -m MODULE ARGV` inside `namespace`, its output read as text through pipes."""
    return subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-m", module, *argv], cwd=REPO,
                            env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def remove_network(namespaces: Iterable[str], links: Iterable[str]) -> None:
    """Delete `namespaces` (each takes its veth ends, and so their pairs, with it), then the host-side `links`."""
    for namespace in namespaces:
        _ip("netns", "del", namespace, check=False)
    for name in links:
        _ip("link", "del", name, check=False)
