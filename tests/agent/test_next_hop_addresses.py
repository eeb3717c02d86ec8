"""A stage dials its next hop at an address of an IP family its own PC has (NextHop.other_addresses, protocol 15),
and an agent registers every address it listens at, so that the controller knows them all.

From an exploratory test of a mixed IPv4/IPv6 office: a dual-stack PC that answered the controller's survey over
IPv6 was given to the IPv4-only PC before it in the chain at that IPv6 address alone, which it could never dial; the
run failed over and left the healthy dual-stack PC out."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import psutil
import pytest

from deskfleet.agent import advertise
from deskfleet.agent import core as core_module
from deskfleet.agent import service as service_module
from deskfleet.agent.core import CommandError
from deskfleet.agent.link import Link, LinkError, listening_families
from deskfleet.agent.service import AgentOptions, AgentService
from deskfleet.common.wire import AddressesChanged, NextHop, Register, ReleaseMicroBatch, Role
from tests.agent.test_core import FakeMonitor
from tests.agent.test_review_controller_search import Joined, joined  # noqa: F401 (the fixture)
from tests.agent.test_review_hop_auth import NEXT, FakeLink, make_core

DUAL_STACK_HOP = NextHop("[fd62::30]:7431", NEXT, ("10.62.0.30:7431", "[fd62::31]:7431"))
TEMPORARY = "fd62::5743:5ce7:2415:b4a3"  # a privacy address of the PC's /64, which the kernel picks for its links


def _pc_with(monkeypatch: pytest.MonkeyPatch, *lan: tuple[socket.AddressFamily, str]) -> None:
    """This PC's interfaces: loopback of both families (as nearly every PC has), and `lan` on eth0."""
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1"),
               SimpleNamespace(family=socket.AF_INET6, address="::1")],
        "eth0": [SimpleNamespace(family=family, address=address) for family, address in lan]})


def _dial_log(monkeypatch: pytest.MonkeyPatch, answering: set[str]) -> list[str]:
    """open_link faked: the addresses dialled, in order; those in `answering` open a link to NEXT, the others are
    refused."""
    dialled: list[str] = []

    async def dial(address: str, *args: object, **kwargs: object) -> Link:
        dialled.append(address)
        if address not in answering:
            raise LinkError(f"cannot reach {address}: [Errno 101] Network is unreachable")
        return FakeLink(Role.AGENT, NEXT)  # type: ignore[return-value]

    monkeypatch.setattr(core_module, "open_link", dial)
    return dialled


def _send(tmp_path: Path, hop: NextHop) -> None:
    core = make_core(tmp_path, "agent")

    async def scenario() -> None:
        try:
            await core._send_next(hop, ReleaseMicroBatch(7))
        finally:
            await core.close()

    asyncio.run(scenario())


def test_an_ipv4_only_pc_dials_a_dual_stack_next_hop_at_its_ipv4_address(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _pc_with(monkeypatch, (socket.AF_INET, "10.62.0.10"), (socket.AF_INET6, "fe80::10%2"))  # link-local: no family
    dialled = _dial_log(monkeypatch, {"10.62.0.30:7431"})
    _send(tmp_path, DUAL_STACK_HOP)
    assert dialled == ["10.62.0.30:7431"]  # its IPv6 addresses not even tried


def test_a_dual_stack_pc_dials_the_address_the_controller_reached_first_then_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _pc_with(monkeypatch, (socket.AF_INET, "10.62.0.1"), (socket.AF_INET6, "fd62::1"))
    dialled = _dial_log(monkeypatch, {"[fd62::31]:7431"})
    _send(tmp_path, DUAL_STACK_HOP)
    assert dialled == ["[fd62::30]:7431", "10.62.0.30:7431", "[fd62::31]:7431"]


def test_a_next_hop_of_no_family_this_pc_has_is_still_dialled_and_the_error_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _pc_with(monkeypatch, (socket.AF_INET, "10.62.0.10"))
    dialled = _dial_log(monkeypatch, set())
    with pytest.raises(CommandError) as failed:
        _send(tmp_path, NextHop("[fd62::20]:7431", NEXT, ("[fd62::21]:7431",)))
    assert dialled == ["[fd62::20]:7431", "[fd62::21]:7431"] * 2  # the step's two attempts
    text = str(failed.value)
    assert text.startswith(f"next hop agent {NEXT[:12]} at [fd62::20]:7431 or [fd62::21]:7431 is unreachable: ")
    assert "cannot reach [fd62::21]:7431" in text and "this PC has no address of their IP family" in text


class _LinkFrom:
    """A registration link as _register_message reads it: the local address this PC reached the controller from."""

    def __init__(self, host: str) -> None:
        self.connection = SimpleNamespace(transport=SimpleNamespace(get_extra_info=lambda key: (host, 40000)))


def test_an_agent_on_every_interface_registers_the_address_the_controller_reached_then_its_other_familys(
        joined: Joined, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # the controller's roster is where a deploy learns a PC's addresses when mDNS does not reach it (corporate Wi-Fi);
    # of the other family, the address that routes towards the controller, not container or VM adapters' (an
    # exploratory test's PC registered 3 of those and not its LAN address)
    routed = {4: "10.62.0.30", 6: "fd62::30"}
    toward: list[tuple[str, ...]] = []

    def sources(controller: tuple[str, ...]) -> dict[int, str]:
        toward.append(controller)
        return routed

    monkeypatch.setattr(service_module, "lan_sources", sources)
    everywhere = AgentService(AgentOptions(joined.data_dir, listen="0.0.0.0:7431"), monitor=FakeMonitor())
    everywhere.bound_port = 7431

    def registered(reached_from: str) -> tuple[str, ...]:
        return everywhere._register_message(cast(Link, _LinkFrom(reached_from))).listen_addresses

    assert registered("fd62::31") == ("[fd62::31]:7431", "10.62.0.30:7431")
    monkeypatch.setattr(service_module, "stable_source", lambda reached, toward: "fd62::30" if reached == TEMPORARY
                        else reached)
    assert registered(TEMPORARY) == ("[fd62::30]:7431", "10.62.0.30:7431")  # its stable address, not the link's
    assert registered("10.62.0.30") == ("10.62.0.30:7431", "[fd62::30]:7431")
    assert toward[0] == joined.membership.controller_addresses  # routes looked up towards the controller
    assert registered("127.0.0.1") == ("127.0.0.1:7431",)  # a fleet on one PC: no LAN address to go stale
    del routed[6]  # no IPv6 route past this PC (a ULA on a container bridge alone)
    assert registered("10.62.0.30") == ("10.62.0.30:7431",)
    routed[6] = "fd62::30"
    everywhere.listen_families = frozenset({4})  # no IPv6 socket (IPv6 turned off): none of its IPv6 addresses
    assert registered("10.62.0.30") == ("10.62.0.30:7431",)
    one = AgentService(AgentOptions(joined.data_dir, listen="10.62.0.30:7431"), monitor=FakeMonitor())
    one.bound_port = 7431
    assert one._register_message(cast(Link, _LinkFrom("10.62.0.30"))).listen_addresses == ("10.62.0.30:7431",)


class _RegistrationLink(_LinkFrom):
    """The live registration link: what the agent sent on it; a send raises `failing` where set."""

    def __init__(self, host: str) -> None:
        super().__init__(host)
        self.address = "10.62.0.1:7341"
        self.sent: list[object] = []
        self.failing: LinkError | None = None

    async def send(self, message: object) -> None:
        if self.failing is not None:
            raise self.failing
        self.sent.append(message)


def test_an_agent_whose_addresses_change_while_its_link_stays_up_tells_the_controller(
        joined: Joined, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # From stop 63's dual-stack office: a rotated IPv6 address (or a renewed IPv4 lease of the family the controller
    # did not reach it over) stayed in the roster until the registration link dropped, and an IPv6-only stage before
    # the PC was given the stale one: the run failed over
    routed = {4: "10.62.0.30", 6: "fd62::30"}
    here = ["10.62.0.30", "fd62::30"]  # the PC's interface addresses
    monkeypatch.setattr(service_module, "lan_sources", lambda controller: dict(routed))
    monkeypatch.setattr(advertise, "on_an_up_interface", lambda address: address in here)
    agent = AgentService(AgentOptions(joined.data_dir, listen="0.0.0.0:7431"), monitor=FakeMonitor())
    agent.bound_port = 7431
    link = _RegistrationLink("10.62.0.30")
    looks: list[bool] = []
    families: list[tuple[int, ...]] = []

    async def registered(served: Link, registration: bool = False) -> None:  # core.serve_link: the link's lifetime
        looks.append(await agent.tell_address_change())  # what it registered: nothing more to say
        routed[6] = here[1] = "fd62::3a"  # the IPv6 address rotated
        link.failing = LinkError("the controller link closed")
        looks.append(await agent.tell_address_change())  # the link just died: said at the next registration
        link.failing = None
        looks.append(await agent.tell_address_change())
        looks.append(await agent.tell_address_change())  # said once
        # the route to the controller's IPv6 address went (and no default one), the address still on its interface:
        # a flapping route was read as the address's loss, and the roster dropped it for 30 s (exploratory test)
        del routed[6]
        looks.append(await agent.tell_address_change())
        families.append(agent.core.dial_families())
        del here[1]  # IPv6 gone from the LAN: the roster must not keep the address
        looks.append(await agent.tell_address_change())
        families.append(agent.core.dial_families())

    async def scenario() -> None:
        looks.append(await agent.tell_address_change())  # not registered: nothing to tell, nowhere to tell it
        await agent._registered(cast(Link, link))

    monkeypatch.setattr(agent.core, "serve_link", registered)
    asyncio.run(scenario())
    assert looks == [False, False, False, True, False, False, True]
    assert families == [(4, 6), (4,)]  # the families it reports dialling over follow the same addresses
    assert link.sent == [Register(agent.core.agent_id, ("10.62.0.30:7431", "[fd62::30]:7431"),
                                  joined.membership.token_sha256),
                         AddressesChanged(("10.62.0.30:7431", "[fd62::3a]:7431")),
                         AddressesChanged(("10.62.0.30:7431",))]
    assert agent._registration is None  # the link closed: the next registration says the addresses


def test_an_agent_that_reached_the_controller_from_a_temporary_ipv6_address_registers_its_stable_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An exploratory test's PC (use_tempaddr=2, as Windows and desktop Linux run) registered the temporary address
    # its registration link came from: it rotates daily and goes within days, and the roster followed each rotation
    routes: dict[str, str | None] = {"fd62::1": "fd62::30"}  # Linux's public source towards the controller
    monkeypatch.setattr(advertise, "route_source", lambda family, target: routes.get(target))
    monkeypatch.setattr(advertise, "interface_addresses", lambda: ["10.62.0.30", "fd62::30", TEMPORARY,
                                                                  "fd63::30"])
    assert advertise.stable_source(TEMPORARY, "fd62::1") == "fd62::30"
    assert advertise.stable_source("fd62::30", "fd62::1") == "fd62::30"
    assert advertise.stable_source("10.62.0.30", "10.62.0.1") == "10.62.0.30"  # IPv4: as the link reached
    assert advertise.stable_source("::ffff:10.62.0.30", "fd62::1") == "::ffff:10.62.0.30"
    assert advertise.stable_source("fe80::1%eth0", "fd62::1") == "fe80::1%eth0"
    routes["fd62::1"] = "fd63::30"  # another prefix (another interface, a VPN): not the link's, kept as it was
    assert advertise.stable_source(TEMPORARY, "fd62::1") == TEMPORARY
    routes["fd62::1"] = "fd62::99"  # not an address of this PC's
    assert advertise.stable_source(TEMPORARY, "fd62::1") == TEMPORARY
    routes["fd62::1"] = None  # another system than Linux, or no route: the temporary one, as before
    assert advertise.stable_source(TEMPORARY, "fd62::1") == TEMPORARY


def test_the_families_a_pc_reports_are_those_it_routes_past_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # A PC whose LAN had IPv6 alone counted as one of both families for its container bridge (172.17.0.1), and the
    # plan put an IPv4-only PC before it (from an exploratory test of a dual-stack office)
    routes: dict[str, str | None] = {}
    monkeypatch.setattr(advertise, "route_source", lambda family, target: routes.get(target))
    monkeypatch.setattr(advertise, "interface_addresses", lambda: ["10.64.0.11", "100.64.0.5", "172.17.0.1",
                                                                  "fd64::15"])
    routes.update({"fd64::1": "fd64::15"})  # its LAN: IPv6 alone; the bridge routes to no other PC
    assert advertise.lan_sources(("10.64.0.1:7341", "[fd64::1]:7341")) == {6: "fd64::15"}
    # towards the controller first: a VPN's default route gives another source than the LAN's
    routes.update({"10.64.0.1": "10.64.0.11", "192.0.2.1": "100.64.0.5"})
    assert advertise.lan_sources(("10.64.0.1:7341", "[fd64::1]:7341")) == {4: "10.64.0.11", 6: "fd64::15"}
    assert advertise.lan_sources(("ctl.office.example:7341",)) == {4: "100.64.0.5"}  # a name: the default route
    routes["192.0.2.1"] = "192.0.2.99"  # a source that is no interface address of this PC: not taken
    assert advertise.lan_sources() == {}


def test_an_address_whose_route_alone_went_is_kept_while_the_pc_still_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An exploratory test's ULA-only office (no IPv6 default route): a flapping route to the controller's IPv6
    # address read as the address's loss, and the roster dropped the PC's working IPv6 address for 30 s
    routed = {4: "10.62.0.30", 6: "fd62::30"}
    here = ["10.62.0.30", "fd62::30", "fd62::31"]  # on an interface that is up
    monkeypatch.setattr(advertise, "on_an_up_interface", lambda address: address in here)
    now = [0.0]
    sources = advertise.RoutedSources(lambda: dict(routed), lambda: now[0])
    assert sources() == {4: "10.62.0.30", 6: "fd62::30"}
    del routed[6]
    assert sources() == sources() == {4: "10.62.0.30", 6: "fd62::30"}  # no route: the address is still here
    routed[6] = "fd62::31"  # a route again, from another address (renumbered meanwhile): that one
    assert sources() == {4: "10.62.0.30", 6: "fd62::31"}
    del routed[6], here[2]  # no route, and the address gone from the interfaces (or its interface down): gone
    assert sources() == {4: "10.62.0.30"}
    here.append("fd62::31")  # back on the interface, still no route: nothing to keep any more
    assert sources() == {4: "10.62.0.30"}
    routed.clear()
    assert sources() == {4: "10.62.0.30"}  # IPv4's route gone too: its address is still here
    now[0] = advertise.KEEP_UNROUTED_S - 1.0
    assert sources() == {4: "10.62.0.30"}
    # kept for so long only: an IPv6 router gone quiet leaves its addresses for days (from a review)
    now[0] = advertise.KEEP_UNROUTED_S
    assert sources() == {}
    routed[4] = "10.62.0.30"
    assert sources() == {4: "10.62.0.30"}
    assert advertise.RoutedSources(lambda: {})() == {}  # nothing looked up before: nothing to keep


def test_an_address_on_an_interface_that_went_down_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # Linux keeps IPv4 addresses on a downed interface (from a review: a docked PC's Ethernet unplugged, its IPv4
    # address registered on for good)
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "eth0": [SimpleNamespace(family=socket.AF_INET, address="10.62.0.30"),
                 SimpleNamespace(family=psutil.AF_LINK, address="00:11:22:33:44:55")],
        "wlan0": [SimpleNamespace(family=socket.AF_INET6, address="fd63::30"),
                  SimpleNamespace(family=socket.AF_INET6, address="fe80::1%wlan0")],
        "eth0:1": [SimpleNamespace(family=socket.AF_INET, address="10.62.0.31")]})  # a labelled address: on eth0
    up = {"eth0": True, "wlan0": True}
    monkeypatch.setattr(psutil, "net_if_stats", lambda: {name: SimpleNamespace(isup=state)
                                                         for name, state in up.items()})
    assert advertise.on_an_up_interface("10.62.0.30") and advertise.on_an_up_interface("fe80::1")
    assert advertise.on_an_up_interface("10.62.0.31") and not advertise.on_an_up_interface("10.62.0.32")
    up["eth0"] = False
    assert not advertise.on_an_up_interface("10.62.0.30") and advertise.on_an_up_interface("fd63::30")
    assert not advertise.on_an_up_interface("10.62.0.31")


def test_an_agent_reports_the_ip_families_it_dials_over(tmp_path: Path) -> None:
    core = make_core(tmp_path, "agent")
    core.dial_families = lambda: (4,)

    async def status() -> tuple[int, ...]:
        try:
            return (await core.status()).ip_families
        finally:
            await core.close()

    assert asyncio.run(status()) == (4,)


def test_a_server_listening_on_both_families_says_so() -> None:
    with socket.create_server(("127.0.0.1", 0)) as ipv4:
        assert listening_families([ipv4]) == {4}
    if socket.has_dualstack_ipv6():
        with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as both:
            assert listening_families([both]) == {4, 6}
