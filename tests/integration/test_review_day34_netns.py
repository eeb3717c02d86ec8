"""Review (day 34): the integration fixture's per-run network names and the sweep of dead runs' leftovers.

No root and no real network: `ip` is faked by a small model of the kernel's namespaces and links (a name
that exists refuses `add`, deleting a namespace takes its veth pairs with it), so these run anywhere in
about a second and never touch another test run's network.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import test_fleet as fleet_test


class FakeIp:
    """Namespaces and the host's links, as much as test_fleet's fixture uses of `ip`."""

    def __init__(self) -> None:
        self.namespaces: set[str] = set()
        self.links: dict[str, str | None] = {}  # host link -> its veth peer (wherever it is), None for a bridge
        self.peer_in: dict[str, str] = {}  # a veth end moved into a namespace -> that namespace
        self.calls: list[list[str]] = []

    def add_run(self, pid: int, *, with_ifn_suffix: bool = True) -> None:
        """What a run of pid `pid` leaves when killed after its set-up."""
        tag = f"dft{pid:x}"
        self.links[f"{tag}br"] = None
        for index, namespace in enumerate([f"df-test-{pid}-ctl", *[f"df-test-{pid}-a{i}" for i in range(3)]]):
            self.namespaces.add(namespace)
            self.links[f"{tag}v{index}"] = f"{tag}p{index}"
            self.peer_in[f"{tag}p{index}"] = namespace

    def run(self, argv: list[str], check: bool = False, capture_output: bool = False,
            text: bool = False) -> subprocess.CompletedProcess[str]:
        assert argv[0] == "ip"
        args = list(argv[1:])
        self.calls.append(args)
        if args[:1] == ["-n"]:
            return subprocess.CompletedProcess(argv, 0, "", "")
        if args == ["netns", "list"]:
            return subprocess.CompletedProcess(argv, 0, "".join(f"{n} (id: {i})\n" for i, n in
                                                              enumerate(sorted(self.namespaces))), "")
        if args == ["-o", "link", "show"]:
            lines = ["1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\\    link/loopback"]
            for number, (name, peer) in enumerate(self.links.items(), start=2):
                # a veth whose peer went into a namespace shows as NAME@ifN; one whose peer is here, NAME@PEER
                suffix = "" if peer is None else f"@if{number + 100}" if peer in self.peer_in else f"@{peer}"
                lines.append(f"{number}: {name}{suffix}: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue")
            return subprocess.CompletedProcess(argv, 0, "\n".join(lines) + "\n", "")
        failed = self._change(args)
        if failed and check:
            raise subprocess.CalledProcessError(2, argv, "", failed)
        return subprocess.CompletedProcess(argv, 2 if failed else 0, "", failed or "")

    def _change(self, args: list[str]) -> str | None:
        if args[:2] == ["netns", "add"]:
            if args[2] in self.namespaces:
                return f'Cannot create namespace file "/run/netns/{args[2]}": File exists'
            self.namespaces.add(args[2])
        elif args[:2] == ["netns", "del"]:
            if args[2] not in self.namespaces:
                return "Cannot remove namespace file: No such file or directory"
            self.namespaces.discard(args[2])
            for end in [end for end, namespace in self.peer_in.items() if namespace == args[2]]:
                del self.peer_in[end]
                for host_end in [h for h, p in self.links.items() if p == end]:
                    del self.links[host_end]
        elif args[:2] == ["link", "add"]:
            name, peer = args[2], (args[args.index("name") + 1] if "veth" in args else None)
            if name in self.links or peer in self.links or peer in self.peer_in:
                return "RTNETLINK answers: File exists"
            if max(len(name), len(peer or "")) > 15:
                return f'Error: argument "{name}" is wrong: "name" not a valid ifname'
            if peer is not None:
                self.links[name], self.links[peer] = peer, name
            else:
                self.links[name] = None
        elif args[:2] == ["link", "del"]:
            if args[2] not in self.links:
                return f'Cannot find device "{args[2]}"'
            peer = self.links.pop(args[2])
            if peer is not None:
                self.links.pop(peer, None)
                self.peer_in.pop(peer, None)
        elif args[:2] == ["link", "set"] and "netns" in args:
            name, namespace = args[2], args[args.index("netns") + 1]
            self.peer_in[name] = namespace
            self.links.pop(name, None)
        return None


def _a_dead_pid(ending: str = "") -> int:
    """A pid that runs no process (its hex ending in `ending`), below this kernel's pid_max."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path("/proc/sys/kernel/pid_max").exists() \
        else 32768
    for pid in range(pid_max - 1, 1000, -1):
        if f"{pid:x}".endswith(ending) and not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free pid")


@pytest.fixture
def fake_ip(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeIp]:
    fake = FakeIp()
    monkeypatch.setattr(fleet_test.subprocess, "run", fake.run)
    monkeypatch.setattr(fleet_test, "_use_namespaces", lambda: True)
    yield fake


def test_a_dead_runs_leftovers_go_and_a_live_runs_stay(fake_ip: FakeIp) -> None:
    dead, live = _a_dead_pid(ending="b"), os.getppid()  # a hex pid ending in b: "dft...bbr"
    fake_ip.add_run(dead)
    fake_ip.add_run(live)
    fake_ip.links[f"dft{dead:x}p7"] = None  # a veth end left in the host by a run killed mid-set-up
    fleet_test._remove_dead_runs_networks()
    assert not any(str(dead) in namespace for namespace in fake_ip.namespaces)
    assert not any(name.startswith(f"dft{dead:x}") for name in fake_ip.links), fake_ip.links
    assert {f"df-test-{live}-ctl", f"df-test-{live}-a2"} <= fake_ip.namespaces
    assert f"dft{live:x}br" in fake_ip.links and f"dft{live:x}v0" in fake_ip.links


def test_every_link_name_fits_the_kernels_15_characters_at_the_largest_pid() -> None:
    largest = f"dft{4194304:x}br"
    assert len(largest) <= 15 and len(f"dft{4194304:x}v3") <= 15


def test_leftovers_that_carry_this_runs_own_pid_do_not_stop_its_network(fake_ip: FakeIp) -> None:
    # A run killed before its clean-up (SIGKILL, OOM, a CI timeout) whose pid this run now has: in a fresh
    # container or pid namespace pytest gets the same pid run after run, while the network namespace (the
    # host's, a VM's) keeps the killed run's bridge and namespaces. _running(os.getpid()) is True, so the sweep
    # keeps them as a "live run's", and the fixture's first `ip link add` of its bridge fails: File exists.
    # Before this change the fixture removed its own names first (_remove_test_network(names)).
    fake_ip.add_run(os.getpid())
    setup = fleet_test.network.__wrapped__()  # type: ignore[attr-defined]
    try:
        controller, agents = next(setup)
    finally:
        setup.close()
    assert controller.namespace == f"df-test-{os.getpid()}-ctl" and len(agents) == 3
