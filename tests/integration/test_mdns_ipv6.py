"""mDNS on a LAN with IPv6 alone: two network namespaces on a veth pair, each with a unique-local address and no
IPv4 (as root; skipped otherwise). One announces an agent and a controller as a PC listening on every interface
does; the other browses as `fleet ls` does and looks for its moved controller as an agent does. Before, both sides
used IPv4 addresses alone: the agent announced nothing ("no IPv4 network address yet"), and neither search had an
interface to look on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.netns import remove_network, start_in
from tests.integration.test_fleet import LINK_PREFIX, NAMESPACE_PREFIX, RUN_TAG, _ip
from tests.run_ids import run_agent_id, run_fleet_id

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="needs root and iproute2 for network namespaces")]

# test_fleet.py's network uses indexes 0-3 for the same run: these stay clear of them, and its sweep of a killed
# run's leftovers takes these too
NAMESPACES = (f"{NAMESPACE_PREFIX}{os.getpid()}-a8", f"{NAMESPACE_PREFIX}{os.getpid()}-a9")
LINKS = (f"{LINK_PREFIX}{RUN_TAG}v8", f"{LINK_PREFIX}{RUN_TAG}p8")
HOSTS = ("fd6e:df::1", "fd6e:df::2")
NODE = "tests.integration.mdns_node"


@pytest.fixture
def ipv6_only_lan() -> Iterator[None]:
    _remove()
    try:
        for namespace in NAMESPACES:
            _ip("netns", "add", namespace)
            for setting in ("all", "default"):  # no duplicate address detection: the addresses are usable at once
                subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-qw",
                                f"net.ipv6.conf.{setting}.accept_dad=0"], check=True, capture_output=True)
        _ip("link", "add", LINKS[0], "type", "veth", "peer", "name", LINKS[1])
        for namespace, link, host in zip(NAMESPACES, LINKS, HOSTS, strict=True):
            _ip("link", "set", link, "netns", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "addr", "add", f"{host}/64", "dev", link, "nodad")
            _ip("-n", namespace, "link", "set", link, "up", "multicast", "on")
        yield
    finally:
        _remove()


def _remove() -> None:
    remove_network(NAMESPACES, (LINKS[0],))


def test_an_agent_and_a_moved_controller_are_found_over_mdns_on_a_lan_with_ipv6_alone(ipv6_only_lan: None) -> None:
    ids = (run_agent_id("ipv6 agent"), run_agent_id("ipv6 controller"), run_fleet_id("ipv6"))
    announcer = start_in(NAMESPACES[0], NODE, "announce", *ids, "12")
    try:
        assert announcer.stdout is not None
        announced = json.loads(announcer.stdout.readline() or "null")
        assert announced is not None, announcer.stderr.read() if announcer.stderr else ""
        assert announced["addresses"] == [HOSTS[0]]
        time.sleep(1.0)  # both names probed and announced
        looker = start_in(NAMESPACES[1], NODE, "look", *ids, "3")
        out, err = looker.communicate(timeout=60)
        assert looker.returncode == 0, err
        assert json.loads(out) == {"interfaces": [HOSTS[1]], "agent": [f"[{HOSTS[0]}]:7431"],
                                   "controller": [f"[{HOSTS[0]}]:7432"]}
    finally:
        announcer.kill()
        announcer.wait()
