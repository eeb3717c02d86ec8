"""A fleet link through an 8 s drop of its network: it stays open and carries on within a second or two of the network
coming back. Two network namespaces on a bridge (as root; skipped otherwise); one end serves fleet links, the
other dials and sends a message every 0.25 s while the first one's port on the bridge goes down for 8 s.

Before, TCP's retransmission back-off sent the queued data again at 6.2 s (still down) and 12.6 s after it was first
lost: the link caught up 5.5 s after the network was back (measured here), or the 10 s keepalive ping had closed it
meanwhile, and a chain of PCs that were all fine failed over (agent/link.py `cap_retransmit_backoff`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deskfleet.common.wire import Role
from tests.agent.test_link import kernel_caps_retransmits
from tests.fleet_pki import make_ca, make_member
from tests.integration.netns import remove_network, start_in
from tests.integration.test_fleet import LINK_PREFIX, NAMESPACE_PREFIX, RUN_TAG, _ip

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="needs root and iproute2 for network namespaces")]

# test_fleet.py's network uses indexes 0-3 and test_mdns_ipv6.py's 8-9 for the same run; its sweep of a killed
# run's leftovers takes these too
NAMESPACES = (f"{NAMESPACE_PREFIX}{os.getpid()}-a6", f"{NAMESPACE_PREFIX}{os.getpid()}-a7")
HOST_ENDS = (f"{LINK_PREFIX}{RUN_TAG}v6", f"{LINK_PREFIX}{RUN_TAG}v7")  # on the bridge
PC_ENDS = (f"{LINK_PREFIX}{RUN_TAG}p6", f"{LINK_PREFIX}{RUN_TAG}p7")  # in the namespaces
BRIDGE = f"{LINK_PREFIX}{RUN_TAG}v9"  # named as the sweep's links are
HOSTS = ("10.214.0.1", "10.214.0.2")
NODE = "tests.integration.link_node"
DROP_S = 8.0


@pytest.fixture
def two_pcs() -> Iterator[None]:
    """Two namespaces on a bridge. A drop is the bridge's port of the first going down: what the second sends it is
    lost on the way (a Wi-Fi drop), not held back in the sender's own queue, as it is where the sender's own link
    has no carrier (that comes out at once when the link is back: no back-off to wait out)."""
    _remove()
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("link", "set", BRIDGE, "up")
        for namespace, host_end, pc_end, host in zip(NAMESPACES, HOST_ENDS, PC_ENDS, HOSTS, strict=True):
            _ip("netns", "add", namespace)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", pc_end)
            _ip("link", "set", host_end, "master", BRIDGE, "up")
            _ip("link", "set", pc_end, "netns", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{host}/24", "dev", pc_end)
            _ip("-n", namespace, "link", "set", pc_end, "up")
        yield
    finally:
        _remove()


def _remove() -> None:
    remove_network(NAMESPACES, (*HOST_ENDS, BRIDGE))


@pytest.mark.skipif(not kernel_caps_retransmits(), reason="this kernel has no TCP_RTO_MAX_MS (Linux 6.15 and later)")
def test_a_link_carries_on_within_two_seconds_of_an_8_s_network_drop(two_pcs: None, tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    make_member(ca, tmp_path, "serve")
    make_member(ca, tmp_path, "dial", Role.CONTROLLER)
    address = f"{HOSTS[0]}:7431"
    server = start_in(NAMESPACES[0], NODE, "serve", str(tmp_path), address)
    dialer: subprocess.Popen[str] | None = None
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening", server.stderr
        dialer = start_in(NAMESPACES[1], NODE, "dial", str(tmp_path), address, str(DROP_S + 8))
        assert dialer.stdout is not None and dialer.stdout.readline().strip() == "open"
        time.sleep(1.5)
        down_at = time.time()
        _ip("link", "set", HOST_ENDS[0], "down")
        time.sleep(DROP_S)
        _ip("link", "set", HOST_ENDS[0], "up")
        up_at = time.time()
        out, err = dialer.communicate(timeout=60)
        assert out.strip() == "done", (out, err)  # the link stayed open through the drop
    finally:
        for process in (server, dialer):
            if process is not None:
                process.kill()
                process.wait()
    assert server.stdout is not None
    received = [json.loads(line) for line in server.stdout.read().splitlines() if line.startswith("{")]
    texts = [entry["text"] for entry in received if "text" in entry]
    assert [int(text.split()[0]) for text in texts] == list(range(len(texts))) and len(texts) >= 40
    # the first message sent into the drop arrives within 2 s of the network's return (before: 5.5 s, or never)
    first_lost = next(entry for entry in received if float(entry["text"].split()[1]) >= down_at)
    assert first_lost["t"] - up_at < 2.0, (first_lost, up_at)
