"""Registry: merging sources, liveness by an injected clock, withdrawals and manual dial targets."""

from __future__ import annotations

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import AgentRecord
from deskfleet.common.wire import ProtocolError
from deskfleet.controller.registry import DiscoverySource, Registry, Sighting
from tests.fake_clock import FakeClock

A, B = "a" * 52, "b" * 52


def make(ttl: float = 10.0) -> tuple[Registry, FakeClock]:
    clock = FakeClock(0.0)
    return Registry(ttl_s=ttl, clock=clock), clock


def test_sources_merge_into_one_entry() -> None:
    registry, clock = make()
    record = AgentRecord(A, "0123456789abcdef", "1", ("CPU",), 10, AgentState.AVAILABLE)
    registry.observe(Sighting(A, ("10.0.0.5:7431",), DiscoverySource.MDNS, record))
    clock.now = 3.0
    registry.observe(Sighting(A, ("192.168.1.5:7431", "10.0.0.5:7431"), DiscoverySource.REGISTRATION))
    (entry,) = registry.entries()
    assert entry.addresses == ("192.168.1.5:7431", "10.0.0.5:7431")
    assert entry.sources == {DiscoverySource.MDNS, DiscoverySource.REGISTRATION}
    assert entry.record == record and (entry.first_seen, entry.last_seen) == (0.0, 3.0)


def test_addresses_an_authenticated_source_gave_are_dialled_first() -> None:
    # Anyone can announce a real agent's id over mDNS: the newest sighting's address first let a fake one
    # hide the address the agent registered with.
    registry, _ = make()
    registry.observe(Sighting(A, ("10.0.0.5:7431",), DiscoverySource.REGISTRATION))
    registry.observe(Sighting(A, ("10.6.6.6:9",), DiscoverySource.MDNS))
    registry.observe(Sighting(A, ("10.6.6.7:9", "10.0.0.5:7431"), DiscoverySource.MDNS))
    assert registry.entries()[0].addresses == ("10.0.0.5:7431", "10.6.6.7:9", "10.6.6.6:9")
    registry.observe(Sighting(A, ("192.168.1.5:7431",), DiscoverySource.MANUAL))  # its certificate said A
    registry.observe(Sighting(B, ("10.6.6.6:9",), DiscoverySource.MDNS))
    registry.observe(Sighting(B, ("10.0.0.6:7431",), DiscoverySource.REGISTRATION))
    a, b = registry.entries()
    assert a.addresses == ("192.168.1.5:7431", "10.0.0.5:7431", "10.6.6.7:9", "10.6.6.6:9")
    assert a.authenticated == {"192.168.1.5:7431", "10.0.0.5:7431"}
    assert b.addresses == ("10.0.0.6:7431", "10.6.6.6:9")


def test_unrefreshed_entry_disappears_and_pings_keep_it() -> None:
    registry, clock = make(ttl=5.0)
    registry.observe(Sighting(A, ("10.0.0.5:7431",), DiscoverySource.MDNS))
    registry.observe(Sighting(B, ("10.0.0.6:7431",), DiscoverySource.MDNS))
    clock.now = 4.0
    assert registry.confirm(A)
    clock.now = 5.0
    assert [entry.agent_id for entry in registry.entries()] == [A, B]  # exactly ttl: still alive
    clock.now = 5.5
    assert registry.expire() == [B]
    assert registry.get(B) is None and not registry.confirm(B)
    clock.now = 9.0  # confirmed at 4.0: alive until 9.0
    assert registry.entries()[0].agent_id == A
    clock.now = 9.1
    assert registry.entries() == ()
    registry.observe(Sighting(A, ("10.0.0.5:7431",), DiscoverySource.MDNS))  # comes back when seen again
    assert registry.get(A) is not None


def test_dial_targets_are_manual_addresses_not_yet_identified() -> None:
    registry, clock = make(ttl=5.0)
    registry.add_dial_targets(["10.0.0.9:7431", "pc-12.corp:7431"])
    assert registry.dial_targets() == ("10.0.0.9:7431", "pc-12.corp:7431")
    registry.observe(Sighting(A, ("10.0.0.9:7431",), DiscoverySource.MANUAL))
    assert registry.dial_targets() == ("pc-12.corp:7431",)
    clock.now = 6.0  # the manual agent went silent: dial it again
    assert registry.dial_targets() == ("10.0.0.9:7431", "pc-12.corp:7431")
    registry.observe(Sighting(B, ("pc-12.corp:7431",), DiscoverySource.MDNS))  # anyone's claim: still dial it
    assert registry.dial_targets() == ("10.0.0.9:7431", "pc-12.corp:7431")
    with pytest.raises(ProtocolError):
        registry.add_dial_targets(["no-port"])


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        Registry(ttl_s=0)
    with pytest.raises(ProtocolError):
        Sighting(A, ("10.0.0.1",), DiscoverySource.MDNS)
