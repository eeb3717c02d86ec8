"""An office of both IP families, as separate processes in network namespaces on one bridge (as root; skipped
otherwise): a controller of both families, a PC of IPv4 alone, one of IPv6 alone and one of both, whose IPv4 address
the controller cannot reach (a route it lacks), so that it answers the controller over IPv6 alone.

Before (stop 62's helper, protocol 14): the plan put the IPv4-only PC next to the IPv6-only one, or gave the IPv4-only
PC the PC of both at the IPv6 address the controller had reached it at; each run failed over twice, learning the
links, and ended on fewer PCs. Now each agent reports the IP families it dials over, registers its other family's
addresses, and a stage is given all of its next hop's addresses: the chain puts the PC of both between the other two,
and the run goes through without a failover, giving the local tokens.

Then (protocol 16): the PC of both rotates its IPv6 address while its registration link runs over IPv4; it says so,
and the controller, its IPv4 route to that PC gone, finds it at the new address and runs through it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.netns import remove_network
from tests.integration.test_fleet import (
    BIN,
    DEPLOY_ARGS,
    LINK_PREFIX,
    NAMESPACE_PREFIX,
    RELAXED_SETTINGS,
    REPO,
    RUN_TAG,
    Fleet,
    Node,
    _environment,
    _ip,
    _ls,
    _wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="needs root and iproute2 for network namespaces")]

# test_fleet.py's network uses indexes 0-3, test_link_blip.py's 6-7 and 9, test_mdns_ipv6.py's 8-9; the sweep of a
# killed run's leftovers takes these too
INDEXES = (10, 11, 12, 13)  # the controller, the IPv4-only PC, the IPv6-only PC, the PC of both
NAMESPACES = tuple(f"{NAMESPACE_PREFIX}{os.getpid()}-a{index}" for index in INDEXES)
HOST_ENDS = tuple(f"{LINK_PREFIX}{RUN_TAG}v{index}" for index in INDEXES)
BRIDGE = f"{LINK_PREFIX}{RUN_TAG}v19"  # named as the sweep's links are
IPV4 = ("10.215.0.1", "10.215.0.11", None, "10.215.0.13")
IPV6 = ("fd6e:cf::1", None, "fd6e:cf::12", "fd6e:cf::13")
CONTROLLER_PORT, AGENT_PORT = 7341, 7431


@pytest.fixture
def mixed_office() -> Iterator[None]:
    _remove()
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("link", "set", BRIDGE, "type", "bridge", "mcast_snooping", "0", check=False)
        _ip("link", "set", BRIDGE, "up")
        for index, namespace, host_end, ipv4, ipv6 in zip(INDEXES, NAMESPACES, HOST_ENDS, IPV4, IPV6, strict=True):
            pc_end = f"{LINK_PREFIX}{RUN_TAG}p{index}"
            _ip("netns", "add", namespace)
            _sysctl(namespace, "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0")
            if ipv6 is None:  # no IPv6 at all, as on a PC that turned it off: no IPv6 socket either
                _sysctl(namespace, "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
            _ip("link", "add", host_end, "type", "veth", "peer", "name", pc_end)
            _ip("link", "set", host_end, "master", BRIDGE, "up")
            _ip("link", "set", pc_end, "netns", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            if ipv4 is not None:
                _ip("-n", namespace, "addr", "add", f"{ipv4}/24", "dev", pc_end)
            if ipv6 is not None:
                _ip("-n", namespace, "addr", "add", f"{ipv6}/64", "dev", pc_end, "nodad")
            _ip("-n", namespace, "link", "set", pc_end, "up")
        yield
    finally:
        _remove()


def _sysctl(namespace: str, *settings: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-qw", *settings], check=True, capture_output=True)


def _remove() -> None:
    remove_network(NAMESPACES, (*HOST_ENDS, BRIDGE))


def _start_office(tmp_path: Path) -> Fleet:
    """The controller serving, and the 3 PCs joined, started and answering, each listening on every interface of
    the families it has (the default); the agents' logs are agent1 (IPv4 alone), agent2 (IPv6 alone), agent3 (both)."""
    controller = Node("controller", NAMESPACES[0], IPV4[0])
    agents = [Node(f"agent{index}", namespace, IPV4[index] or IPV6[index] or "")
              for index, namespace in enumerate(NAMESPACES) if index]
    fleet = Fleet(tmp_path, controller, agents, f"{IPV4[0]}:{CONTROLLER_PORT}", [])
    try:
        fleet.deskfleet("fleet", "init", "--address", f"{IPV4[0]}:{CONTROLLER_PORT}", "--address",
                        f"[{IPV6[0]}]:{CONTROLLER_PORT}")
        fleet.start("controller", controller, str(BIN / "deskfleet"), "-v", "fleet", "serve", "--data-dir",
                    str(fleet.controller_dir))
        _wait_for("the controller to listen", lambda: "controller listening" in fleet.log("controller"))
        token = fleet.deskfleet("fleet", "token", "--uses", "3", "--ttl", "10m").strip()
        for index, node in enumerate(agents):
            data_dir = fleet.agent_dir(index)
            fleet.run(node, str(BIN / "deskfleet-agent"), "join", token, "--data-dir", str(data_dir), "--hostname",
                      f"desk-{index}")
            (data_dir / "settings").mkdir(exist_ok=True)
            (data_dir / "settings" / "agent-settings.json").write_text(json.dumps(RELAXED_SETTINGS))
            fleet.start(node.name, node, str(BIN / "deskfleet-agent"), "--headless", "--data-dir", str(data_dir))
        _wait_for("3 registered agents to answer",
                  lambda: sum(agent["state"] == "available" for agent in _ls(fleet)) == 3, timeout=60)
    except BaseException:
        fleet.stop_all()
        raise
    return fleet


def _runs_through_without_failover(fleet: Fleet, model: Path) -> None:
    """A run on every PC of the plan just deployed: no failover, and the tokens of a local f32 run."""
    prompt = ("--prompt-ids", "1,17,42,99,5", "--max-new-tokens", "8", "--ignore-eos", "--json")
    remote = json.loads(fleet.deskfleet("generate", "--fleet", "--model", str(model), *prompt,
                                        "--discover-seconds", "0"))
    local = json.loads(subprocess.run([str(BIN / "deskfleet"), "generate", "--model", str(model), *prompt,
                                       "--precision", "f32"], capture_output=True, check=True, cwd=REPO,
                                      env=_environment()).stdout)
    assert not remote.get("failovers") and remote["stages"] == 3, remote.get("failovers")
    assert remote["tokens"] == local["tokens"]


def test_a_pc_of_both_families_stands_between_an_ipv4_and_an_ipv6_pc_and_the_run_goes_through(
        mixed_office: None, tmp_path: Path, tiny_export: Path) -> None:
    fleet = _start_office(tmp_path)
    try:
        # the controller loses its IPv4 route to the PC of both: it reaches that PC over IPv6 alone
        _ip("-n", NAMESPACES[0], "route", "add", "unreachable", f"{IPV4[3]}/32")
        both = f"[{IPV6[3]}]:{AGENT_PORT}"
        _wait_for("the PC of both to answer over IPv6",
                  lambda: any(agent["address"] == both and agent["state"] == "available" for agent in _ls(fleet)),
                  timeout=60)
        listed = {agent["hostname"]: agent for agent in _ls(fleet)}
        assert [listed[f"desk-{index}"]["ip_families"] for index in range(3)] == [[4], [6], [4, 6]]
        assert f"{IPV4[3]}:{AGENT_PORT}" in listed["desk-2"]["other_addresses"]  # registered, for the PC before it

        deployed = json.loads(fleet.deskfleet(*DEPLOY_ARGS, "--model", str(tiny_export)))
        addresses = [stage[1] for stage in deployed["stages"]]
        assert addresses[1] == both and sorted(addresses[::2]) == sorted([f"{IPV4[1]}:{AGENT_PORT}",
                                                                          f"[{IPV6[2]}]:{AGENT_PORT}"]), addresses
        _runs_through_without_failover(fleet, tiny_export)
    finally:
        fleet.stop_all()


def test_a_pc_whose_ipv6_address_rotates_while_registered_over_ipv4_is_found_at_the_new_one(
        mixed_office: None, tmp_path: Path, tiny_export: Path) -> None:
    # Before (protocol 15): the roster kept the rotated address until the PC's registration link dropped, which an
    # IPv6 change does not do where the link runs over IPv4; a controller or a stage before the PC that reach it over
    # IPv6 alone dialled the stale address. The agent now says the change (AddressesChanged, within 30 s).
    fleet = _start_office(tmp_path)
    rotated = "fd6e:cf::23"
    try:
        listed = {agent["hostname"]: agent for agent in _ls(fleet)}
        assert listed["desk-2"]["address"] == f"{IPV4[3]}:{AGENT_PORT}"  # registered over IPv4 (the first address)
        assert listed["desk-2"]["other_addresses"] == [f"[{IPV6[3]}]:{AGENT_PORT}"]
        pc_end = f"{LINK_PREFIX}{RUN_TAG}p{INDEXES[3]}"
        _ip("-n", NAMESPACES[3], "addr", "add", f"{rotated}/64", "dev", pc_end, "nodad")
        _ip("-n", NAMESPACES[3], "addr", "del", f"{IPV6[3]}/64", "dev", pc_end)
        _wait_for("the roster to list the rotated address", lambda: next(
            agent for agent in _ls(fleet) if agent["hostname"] == "desk-2")["other_addresses"] == [
            f"[{rotated}]:{AGENT_PORT}"], timeout=60)
        assert "this PC's addresses changed" in fleet.log("agent3")
        said = fleet.log("controller")
        assert "addresses changed: now at" in said and "is available again" not in said  # no call-in
        assert said.count("registered at") == 3  # the link stayed up: no registration again
        # the controller loses its IPv4 route to the PC: the rotated address is where it reaches it now
        _ip("-n", NAMESPACES[0], "route", "add", "unreachable", f"{IPV4[3]}/32")
        listed = {agent["hostname"]: agent for agent in _ls(fleet)}
        assert (listed["desk-2"]["address"], listed["desk-2"]["state"]) == (f"[{rotated}]:{AGENT_PORT}", "available")
        deployed = json.loads(fleet.deskfleet(*DEPLOY_ARGS, "--model", str(tiny_export)))
        assert [stage[1] for stage in deployed["stages"]][1] == f"[{rotated}]:{AGENT_PORT}", deployed["stages"]
        _runs_through_without_failover(fleet, tiny_export)
    finally:
        fleet.stop_all()
