"""A drop of the controller's own network is not a PC's failure (controller/own_network.py, and the failover's use
of it): the driver's link to a stage died as the interface that carried it lost its link, and the failover kept that
healthy PC once a run, so a second drop in the run left it out (from an exploratory test's laptop controller)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from deskfleet.agent.link import Link, LinkError
from deskfleet.controller import fleet_pipeline, own_network
from deskfleet.controller.fleet_deploy import DeployError
from deskfleet.controller.fleet_pipeline import ChainError, FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.own_network import LinkDeath, NetworkFault, OwnNetworkWatch
from tests.controller.test_review_blame import CHAIN, A, B, C, scripted_failover
from tests.log_records import records_of

HERE = "10.0.0.100"  # the controller's address on eth0


class _Interfaces:
    """This PC's interfaces as psutil gives them, changed by the test; `clock` the watch's time."""

    def __init__(self) -> None:
        self.up = {"lo": True, "eth0": True, "wlan0": True}
        self.addresses = {"lo": ["127.0.0.1"], "eth0": [HERE, "fd00::100"], "wlan0": ["10.1.0.7"]}
        self.now = 100.0
        self.failing: OSError | None = None

    def stats(self) -> dict[str, SimpleNamespace]:
        if self.failing is not None:
            raise self.failing
        return {name: SimpleNamespace(isup=up) for name, up in self.up.items()}

    def found(self) -> dict[str, list[SimpleNamespace]]:
        return {name: [SimpleNamespace(family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                                       address=address) for address in addresses]
                for name, addresses in self.addresses.items()}

    def watch(self) -> OwnNetworkWatch:
        return OwnNetworkWatch(self.stats, self.found, lambda: self.now)


def test_the_watch_tells_the_fault_of_the_interface_a_link_ran_from_that_it_died_of() -> None:
    pc = _Interfaces()
    watch = pc.watch()
    watch.sample()
    pc.now, pc.up["eth0"] = 110.0, False  # the cable pulled
    watch.sample()
    assert watch.fault_under(HERE, 112.0) == NetworkFault("eth0", None, 110.0, None)  # not back yet
    pc.now, pc.up["eth0"] = 124.0, True
    watch.sample()
    fault = NetworkFault("eth0", None, 110.0, 124.0)
    assert watch.fault_under(HERE, 124.0) == watch.fault_under(HERE, 126.0) == fault  # died as it closed (2 s)
    assert watch.fault_under("::ffff:10.0.0.100", 124.0) == fault  # as an IPv6 socket names an IPv4 peer
    assert watch.fault_under("fd00::100", 124.0) == fault  # the interface's other address: the same link
    assert fault.describe(130.0) == "this PC's network interface eth0 lost its link 20 s ago, back after 14 s"
    assert watch.fault_under(HERE, 130.0) is None  # over well before: links come back within a second of it
    assert watch.fault_under(HERE, 105.0) is None  # began after the death
    assert watch.fault_under("10.1.0.7", 124.0) is None  # another interface's link
    assert watch.fault_under("127.0.0.1", 124.0) is None
    assert watch.fault_under("10.9.9.9", 124.0) is None  # an address this PC never had: nothing known
    assert watch.fault_under("ctl.example", 124.0) is None
    pc.now, pc.up["eth0"] = 126.0, False  # down again as the link dies: this drop, not the one before
    watch.sample()
    assert watch.fault_under(HERE, 126.5) == NetworkFault("eth0", None, 126.0, None)


def test_the_watch_tells_an_address_the_pc_lost_and_forgets_faults_after_a_while() -> None:
    pc = _Interfaces()
    watch = pc.watch()
    watch.sample()
    pc.now = 200.0
    pc.addresses["wlan0"] = ["10.1.0.8"]  # a new lease: the old address gone, the link up all along
    watch.sample()
    pc.now = 201.0
    watch.sample()
    lost = NetworkFault("wlan0", "10.1.0.7", 200.0, None)
    assert watch.fault_under("10.1.0.7", 201.0) == lost
    assert watch.fault_under("10.1.0.8", 201.0) is None  # the new address's links lost nothing
    assert lost.describe(230.0) == "this PC's network interface wlan0 lost its address 10.1.0.7 30 s ago, " \
                                   "not back yet"
    pc.now, pc.up["eth0"] = 210.0, False
    watch.sample()
    pc.now, pc.up["eth0"] = 215.0, True
    watch.sample()
    pc.now = 215.0 + own_network.KEEP_S + 1.0  # long past: neither is kept
    watch.sample()
    assert watch.fault_under(HERE, 215.0) is None
    assert watch.fault_under("10.1.0.7", 215.0) is None  # the address itself forgotten


def _death(at: float, local_host: str | None = HERE, gone: str | None = None, peer_closed: bool = False) -> LinkDeath:
    return LinkDeath(local_host, gone, peer_closed, at)


def test_a_blip_shorter_than_links_ride_out_or_long_over_explains_no_link_death() -> None:
    # a Wi-Fi's roaming blip 19 s before a PC crashed excused the crash (from a review); so did a 5 s drop the links
    # rode out, 15 s before (from an exploratory test)
    pc = _Interfaces()
    watch = pc.watch()
    watch.sample()
    pc.now, pc.up["eth0"] = 110.0, False
    watch.sample()
    pc.now, pc.up["eth0"] = 110.5, True
    watch.sample()
    assert own_network.explain(watch, _death(111.0)) is None
    pc.now, pc.up["eth0"] = 120.0, False
    watch.sample()
    pc.now, pc.up["eth0"] = 125.0, True
    watch.sample()
    assert own_network.explain(watch, _death(140.0)) is None
    pc.now, pc.up["eth0"] = 150.0, False  # still down as the link dies: however short so far, it counts
    watch.sample()
    assert own_network.explain(watch, _death(150.2)) == "this PC's network interface eth0 lost its link 0 s ago, " \
                                                       "not back yet"
    # the peer's close frame came: the peer closed it, whatever this PC's network did
    assert own_network.explain(watch, _death(150.2, peer_closed=True)) is None
    gone = f"this PC lost its address {HERE}, which the link ran from"
    assert own_network.explain(watch, _death(150.2, gone=HERE)) == gone  # the link told it: no watch needed
    assert own_network.explain(None, _death(150.2, gone=HERE)) == gone
    assert own_network.explain(None, _death(150.2)) is None and own_network.explain(watch, None) is None


def test_a_labelled_address_is_watched_on_its_interface_and_link_local_ones_not_at_all() -> None:
    # psutil lists `ip addr add 10.0.0.101/24 dev eth0 label eth0:1` under eth0:1, and the stats under eth0: the
    # label read as an interface down for good, and every link from it as the controller's own fault (review)
    pc = _Interfaces()
    pc.addresses["eth0:1"] = ["10.0.0.101"]
    pc.addresses["veth7"] = ["fe80::7"]  # a container's: its link-local address is no link's end
    watch = pc.watch()
    watch.sample()
    pc.now = 130.0
    watch.sample()
    assert watch.fault_under("10.0.0.101", 130.0) is None
    pc.now, pc.up["eth0"] = 131.0, False
    watch.sample()
    assert watch.fault_under("10.0.0.101", 131.0) == NetworkFault("eth0", None, 131.0, None)
    assert "fe80::7" not in watch._where
    del pc.addresses["eth0:1"], pc.addresses["eth0"]  # every address of eth0 gone for good: nothing kept of it
    pc.now = 131.0 + own_network.KEEP_S + 1.0
    watch.sample()
    assert watch._open == {} and set(watch._where) == {"127.0.0.1", "10.1.0.7"}


def test_a_watch_that_cannot_read_the_interfaces_says_so_once_and_knows_no_fault() -> None:
    pc = _Interfaces()
    watch = pc.watch()
    watch.sample()
    pc.failing = PermissionError(13, "Permission denied")
    pc.up["eth0"] = False
    with records_of(own_network.__name__, logging.WARNING) as records:
        for now in (110.0, 111.0):
            pc.now = now
            watch.sample()
    assert watch.fault_under(HERE, 120.0) is None
    said = [text for text in records.messages() if "Permission denied" in text]  # the process's own watch aside
    assert said == ["cannot read this PC's network interfaces ([Errno 13] Permission denied): a dropped network of "
                    "its own is not told from a PC's failure until they can be read"]


def test_the_shared_watch_is_one_running_watch() -> None:
    watch = own_network.shared_watch()
    assert own_network.shared_watch() is watch and watch._thread is not None and watch._thread.is_alive()


def _dropped(agent_id: str, own_fault: str | None) -> ChainError:
    """The controller's own link to `agent_id`'s stage died (its observation: no agent's word), as FleetPipeline
    found `own_fault` of this PC's network then."""
    return ChainError(f"agent {agent_id[:3]} (stage 1): its link closed: the peer answered no keepalive ping",
                      agent_id, stages=CHAIN, own_fault=own_fault)


LINK_LOST = "this PC's network interface eth0 lost its link 15 s ago, back after 12 s"


@pytest.mark.parametrize("own_network_failed", [True, False])
def test_a_link_that_died_as_the_controllers_own_network_dropped_blames_no_pc(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, own_network_failed: bool) -> None:
    # a laptop controller's Wi-Fi dropped twice in one run for longer than the links ride out: the first drop's
    # failover kept B (blamed once), the second left the healthy B out
    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    failover.max_failovers = 2
    for _ in range(2):
        failover(_dropped(B, LINK_LOST if own_network_failed else None))
    if not own_network_failed:  # as before: kept once, then left out
        assert excluded == [frozenset(), frozenset({B})]
        return
    assert excluded == [frozenset(), frozenset()]  # B placed by both re-plans
    assert failover.lost == set() and failover.kept == set()
    assert failover._spent() == 0  # no failover spent: a PC that fails next is still re-planned around
    record = failover.replans[-1]
    assert record["blamed_agent"] is None and record["lost_agent"] is None  # no PC is blamed
    assert record["own_network"] == record["blame_check"] == (
        f"the link to agent {B[:12]} died as this PC's own network failed under it ({LINK_LOST}): no PC is blamed, "
        "and no failover is spent on it")


def test_own_network_re_plans_are_free_only_so_many_times_a_run(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deskfleet.controller.fleet_failover.OWN_NETWORK_FREE_REPLANS", 1)
    failover, _ = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    failover.max_failovers = 1
    for _ in range(2):
        failover(_dropped(B, LINK_LOST))
    assert failover._spent() == 1 and failover.lost == set()
    assert "a failover is spent on it (1 such breaks in this run were free)" in str(failover.replans[-1]["own_network"])
    with pytest.raises(Exception, match="--max-failovers 1"):
        failover(_dropped(B, LINK_LOST))
    failover.start_run()  # a chat's next reply: free again
    failover.max_failovers = 2
    failover(_dropped(B, LINK_LOST))
    assert failover._spent() == 0


def test_own_network_re_plans_stay_free_when_a_take_back_fails(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a failed take-back sets the run's one credit for the re-plan it may cause: it wiped the free re-plans (review)
    failover, _ = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    failover.max_failovers = 2
    for _ in range(3):
        failover(_dropped(B, LINK_LOST))
    failover._credit = 1  # as _take_back sets it where its re-plan failed
    assert failover._spent() == -1
    failover(_dropped(B, None))
    failover(_dropped(C, None))  # two real failures still fit the budget
    assert failover._spent() == 1


def test_a_pc_whose_link_died_in_a_re_plan_as_the_controllers_network_dropped_again_is_not_lost(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a laptop's Wi-Fi dropped again as the re-plan deployed: the PCs whose links died there were lost, and the
    # run ended on one PC (from an exploratory test)
    from deskfleet.controller import fleet_failover

    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    pc = _Interfaces()
    failover.own_network = watch = pc.watch()
    watch.sample()
    real_deploy = fleet_failover.deploy
    calls: list[int] = []

    async def dropped_again_as_it_deployed(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            pc.now, pc.up["eth0"] = pc.now + 1.0, False
            watch.sample()
            raise DeployError(f"agent {A[:12]} at 10.0.0.0:7431: link closed: keepalive", agents=frozenset({A}),
                              death=_death(pc.now + 14.0))
        return await real_deploy(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet_failover, "deploy", dropped_again_as_it_deployed)
    notes: list[str] = []
    failover.notify = notes.append
    failover.max_failovers = 1
    failover(_dropped(B, LINK_LOST))
    assert excluded == [frozenset()] and failover.lost == set() and failover._spent() == 0
    assert "that link died as this PC's own network failed under it (this PC's network interface eth0 lost its link " \
           "14 s ago, not back yet): no PC is blamed, and the re-plan is made again" in notes[0]
    assert failover.replans[-1]["cut_short"] == [f"agent {A[:12]} at 10.0.0.0:7431: link closed: keepalive"]


def test_an_agents_word_carries_no_fault_of_the_controllers_network(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failover, _ = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    said = ChainError("internal from the chain: next hop unreachable", B, A, CHAIN, own_fault=LINK_LOST)
    assert said.own_fault is None  # the agent's link to its next hop is no link of the controller's
    failover(said)
    assert failover.replans[-1]["own_network"] is None


class _Link:
    local_host = HERE


def _chain_asking(watch: OwnNetworkWatch | None) -> FleetPipeline:
    chain = FleetPipeline.__new__(FleetPipeline)  # no agents behind it: only its reading of a link's death
    chain.own_network = watch
    return chain


def test_a_chain_asks_as_a_link_dies_whether_its_own_network_failed_under_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pc = _Interfaces()
    watch = pc.watch()
    clock = [100.0]
    monkeypatch.setattr(fleet_pipeline.time, "monotonic", lambda: clock[0])
    watch.sample()
    pc.now, pc.up["eth0"] = 101.0, False
    watch.sample()
    pc.now, pc.up["eth0"] = 115.0, True
    watch.sample()
    link = cast(Link, _Link())
    dropped = LinkError("link closed: keepalive", closed_because="keepalive")  # no close frame from the peer
    chain = _chain_asking(watch)
    clock[0] = 116.0
    assert chain._own_fault(link, dropped) == "this PC's network interface eth0 lost its link 15 s ago, back " \
                                              "after 14 s"
    # the peer closed it (or crashed and reset it): no network's fault, whatever the interface did
    assert chain._own_fault(link, LinkError("closed", peer_closed=True)) is None
    clock[0] = 140.0  # died long after the drop: not of it
    assert chain._own_fault(link, dropped) is None
    gone = LinkError("closed", own_address_gone=HERE)  # the link told it: no watch needed
    assert _chain_asking(None)._own_fault(link, gone) == f"this PC lost its address {HERE}, which the link ran from"
    assert _chain_asking(None)._own_fault(link, dropped) is None and chain._own_fault(None, None) is None
