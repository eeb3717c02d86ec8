"""Discovery sources into a Registry: registrations, manual peers, and a real mDNS browse on loopback.

The mDNS test binds zeroconf to 127.0.0.1 only (nothing is sent on other interfaces; see
test_advertise.py, which checks that as root). Each test uses a fresh random fleet id, so other
processes advertising on the same loopback are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable

import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from deskfleet.agent.advertise import Advertiser
from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import SERVICE_TYPE, AgentRecord
from deskfleet.common.wire import Register
from deskfleet.controller.discovery import ManualPeers, RegistrationDiscovery, ZeroconfDiscovery
from deskfleet.controller.registry import DiscoverySource, Registry
from tests.run_ids import RUN, run_random

LOOPBACK = "127.0.0.1"


def agent_id(generator: random.Random) -> str:
    return "".join(generator.choice("abcdefghijklmnopqrstuvwxyz234567") for _ in range(52))


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Real network events: poll (this is the one place a clock cannot be injected)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting for mDNS")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def announced(records: list[AgentRecord], port: int, addresses: list[bytes]) -> AsyncIterator[None]:
    """Announce `records` on loopback as anyone could: any port, any addresses (none: it never resolves)."""
    zeroconf = AsyncZeroconf(interfaces=[LOOPBACK], ip_version=IPVersion.V4Only)
    infos = [AsyncServiceInfo(SERVICE_TYPE, record.instance_name, addresses=addresses, port=port,
                              properties=record.to_txt(), server=f"stranger-{RUN}-{index}.local.")
             for index, record in enumerate(records)]
    try:  # no probing first: a stranger would not
        await asyncio.gather(*[await zeroconf.async_register_service(info, cooperating_responders=True)
                               for info in infos])
        yield
    finally:
        await asyncio.gather(*[await zeroconf.async_unregister_service(info) for info in infos])
        await zeroconf.async_close()


def test_registration_checks_the_tls_identity() -> None:
    registry = Registry()
    source = RegistrationDiscovery(registry)
    generator = run_random(1)
    me, other = agent_id(generator), agent_id(generator)
    source.accept(Register(me, ("10.1.1.1:7431",)), peer_agent_id=me)
    entry = registry.get(me)
    assert entry is not None and entry.sources == {DiscoverySource.REGISTRATION}
    with pytest.raises(PermissionError):
        source.accept(Register(other, ("10.1.1.2:7431",)), peer_agent_id=me)
    assert registry.get(other) is None


def test_manual_peers_become_dial_targets() -> None:
    registry = Registry()
    with pytest.raises(ValueError, match="--peer 'pc-1'"):
        ManualPeers(registry, ["pc-1"])
    peers = ManualPeers(registry, ["pc-1:7431", "[fd00::5]:7431"])

    async def scenario() -> None:
        task = asyncio.create_task(peers.run())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert registry.dial_targets() == ("pc-1:7431", "[fd00::5]:7431")


def test_mdns_advertise_browse_update_and_a_goodbye_not_taken_on_loopback() -> None:
    generator = run_random(2)
    fleet = "".join(generator.choice("0123456789abcdef") for _ in range(16))
    me, stranger = agent_id(generator), agent_id(generator)
    registry = Registry(ttl_s=60.0)
    mine = AgentRecord(me, fleet, "0.1.0", ("CPU",), 8 << 30, AgentState.AVAILABLE)
    other_fleet = AgentRecord(stranger, "f" * 16, "0.1.0", ("CPU",), 8 << 30, AgentState.AVAILABLE)

    async def scenario() -> None:
        async with asyncio.TaskGroup() as group:
            browse = group.create_task(ZeroconfDiscovery(registry, fleet, [LOOPBACK]).run())
            async with Advertiser(other_fleet, 7432, [LOOPBACK]), Advertiser(mine, 7431, [LOOPBACK]) as advertiser:
                await wait_for(lambda: registry.get(me) is not None)
                entry = registry.get(me)
                assert entry is not None and entry.addresses == ("127.0.0.1:7431",)
                assert entry.record == mine and entry.sources == {DiscoverySource.MDNS}
                await advertiser.update(AgentRecord(me, fleet, "0.1.0", ("CPU",), 8 << 30, AgentState.PAUSED))
                await wait_for(lambda: (e := registry.get(me)) is not None and e.record is not None
                               and e.record.state is AgentState.PAUSED)
            # its goodbye is not taken: anyone can send one (a forged one hid a member found by mDNS alone); the
            # survey's dial says whether it is there
            await asyncio.sleep(1.5)
            assert registry.get(me) is not None
            assert registry.get(stranger) is None  # another fleet's agent never entered
            browse.cancel()

    asyncio.run(scenario())


def test_an_announcement_with_port_0_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    # It used to end the browse with a ProtocolError, and with it `fleet ls`, plan, deploy and failover.
    generator = run_random(3)
    fleet = "".join(generator.choice("0123456789abcdef") for _ in range(16))
    bad, good = (AgentRecord(agent_id(generator), fleet, "0.1.0", ("CPU",), 8 << 30, AgentState.AVAILABLE)
                 for _ in range(2))
    registry = Registry(ttl_s=60.0)

    async def scenario() -> None:
        async with announced([bad], 0, [bytes([127, 0, 0, 1])]):
            browse = asyncio.create_task(ZeroconfDiscovery(registry, fleet, [LOOPBACK]).run())
            try:
                await wait_for(lambda: bad.agent_id[:12] in caplog.text or browse.done())
                async with Advertiser(good, 7431, [LOOPBACK]):
                    await wait_for(lambda: registry.get(good.agent_id) is not None or browse.done())
                    assert not browse.done(), browse.exception()
            finally:
                browse.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await browse
        assert registry.get(bad.agent_id) is None

    with caplog.at_level(logging.WARNING, logger="deskfleet.controller.discovery"):
        asyncio.run(scenario())
    assert f"ignoring an mDNS announcement for agent {bad.agent_id[:12]}… (anyone on the LAN can announce one): " \
           "address '127.0.0.1:0' has no port" in caplog.text


def test_announcements_that_never_resolve_delay_no_other() -> None:
    # Resolved one at a time for up to 3 s each, one of them kept a real agent out of a 2 s browse.
    generator = run_random(4)
    fleet = "".join(generator.choice("0123456789abcdef") for _ in range(16))
    ghosts = [AgentRecord(agent_id(generator), fleet, "0.1.0", ("CPU",), 8 << 30, AgentState.AVAILABLE)
              for _ in range(8)]
    real = AgentRecord(agent_id(generator), fleet, "0.1.0", ("CPU",), 8 << 30, AgentState.AVAILABLE)
    registry = Registry(ttl_s=60.0)

    async def scenario() -> None:
        async with announced(ghosts, 7431, []), asyncio.TaskGroup() as group:  # SRV and TXT, no address
            browse = group.create_task(ZeroconfDiscovery(registry, fleet, [LOOPBACK]).run())
            await asyncio.sleep(0.3)  # the ghosts are being resolved
            async with Advertiser(real, 7431, [LOOPBACK]):
                await wait_for(lambda: registry.get(real.agent_id) is not None, timeout=2.0)  # the survey's browse
            browse.cancel()
        assert all(registry.get(ghost.agent_id) is None for ghost in ghosts)

    asyncio.run(scenario())


def test_only_members_are_resolved_and_no_address_a_peer_cannot_be_at_is_kept() -> None:
    # A flood of ids that are no member held every resolver, and a member that had moved was missed; an
    # announcement at 0.0.0.0, a multicast or the broadcast address was dialled (at this PC's own loopback too)
    generator = run_random(5)
    fleet = "".join(generator.choice("0123456789abcdef") for _ in range(16))
    member, stranger = (AgentRecord(agent_id(generator), fleet, "0.1.0", ("CPU",), 8 << 30, AgentState.AVAILABLE)
                        for _ in range(2))
    registry = Registry(ttl_s=60.0)
    browser = ZeroconfDiscovery(registry, fleet, [LOOPBACK], members={member.agent_id})
    odd = [bytes([0, 0, 0, 0]), bytes([224, 0, 0, 251]), bytes([255, 255, 255, 255]), bytes([127, 0, 0, 1])]

    async def scenario() -> None:
        async with announced([stranger, member], 7431, odd), asyncio.TaskGroup() as group:
            browse = group.create_task(browser.run())
            await wait_for(lambda: registry.get(member.agent_id) is not None and bool(browser.strangers))
            browse.cancel()

    asyncio.run(scenario())
    entry = registry.get(member.agent_id)
    assert entry is not None and entry.addresses == ("127.0.0.1:7431",)  # on loopback, loopback is a peer's
    assert registry.get(stranger.agent_id) is None and browser.strangers == {stranger.agent_id}
