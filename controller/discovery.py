"""How the controller finds agents: interchangeable sources feeding one Registry.

- ZeroconfDiscovery: browses `_deskfleet._tcp.local.` on the given interfaces, keeps the members of our
  fleet only.
- RegistrationDiscovery: agents that called in with a Register message (multicast is often blocked).
- ManualPeers: `--peer HOST:PORT` addresses, handed to the registry as dial targets.

Each source's `run()` works until cancelled (run them in the controller's TaskGroup) and closes what it
opened on the way out. Nothing a source reports is trusted beyond "something claims to be there": the
connection layer pins the agent id in the peer's TLS certificate before it uses an agent, and its pings
(`Registry.confirm`) are what keep an entry alive.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from deskfleet.agent.advertise import open_zeroconf
from deskfleet.common.discovery_record import SERVICE_TYPE, AgentRecord, RecordError, agent_id_of_instance
from deskfleet.common.wire import ProtocolError, Register, host_port, parse_address
from deskfleet.controller.registry import DiscoverySource, Registry, Sighting

logger = logging.getLogger(__name__)

# A live responder answers within a few hundred ms (RFC 6762: 20-120 ms, then zeroconf's retries); an
# announcement that does not resolve by then is given up, so it cannot hold a browse of a second or two.
RESOLVE_TIMEOUT_MS = 1000
# Instances resolved at once: each is a few small queries; more wait their turn, so a flood of
# announcements costs a queue of names, not a task each.
MAX_RESOLVING = 32


class Discovery(Protocol):
    """A source of agents. `run()` reports into the registry it was given, until cancelled."""

    async def run(self) -> None: ...


class ZeroconfDiscovery:
    """mDNS browser bound to `interfaces` (IP addresses of this host); keeps agents of `fleet_id` only, and of
    those only `members` where given (the fleet's roster: every member joined through this controller).

    Up to MAX_RESOLVING instances are resolved at once, each for at most `resolve_timeout_ms`, so an
    announcement that never resolves (or many) delays no other. An instance is resolved by one task at
    a time, for its newest change (changes that arrive meanwhile are folded into one), so a slow resolve
    cannot overwrite a later one. An announcement that does not make a valid agent record of our fleet
    (a bad TXT, an address with no usable port) is ignored with a warning, once a browse.

    What a hostile device on the LAN can announce must not hide a member (December 2026, a helper's rogue
    responder): names of ids that are no member are not resolved at all, only counted (`strangers`: a flood of
    them that never resolved held every resolver, and a member that had moved was missed), and goodbyes are not
    taken (one forged for a member found by mDNS alone hid it every time, and one that came before its
    announcement was resolved stopped the resolve): whether a PC is there is what dialling it says. Addresses no
    peer can be at (loopback where the browse is on the LAN, unspecified, multicast, reserved such as the
    broadcast address, and link-local, which needs a scope we cannot pin) are dropped: the controller dialled its
    own loopback for an announcement.
    """

    def __init__(self, registry: Registry, fleet_id: str, interfaces: Sequence[str],
                 resolve_timeout_ms: int = RESOLVE_TIMEOUT_MS, members: Collection[str] | None = None) -> None:
        if not interfaces:
            raise ValueError("browse on at least one interface address")
        self._registry = registry
        self._fleet_id = fleet_id
        self._interfaces = list(interfaces)
        self._resolve_timeout_ms = resolve_timeout_ms
        self._members = frozenset(members) if members is not None else None
        # a browse on loopback (tests, one PC's fleet) finds its agents there; one on the LAN never does
        self._loopback_ok = all(ipaddress.ip_address(address).is_loopback for address in interfaces)
        self.strangers: set[str] = set()  # announced agent ids that are no member (not resolved)
        self._warned: set[str] = set()  # members whose malformed announcement was said

    async def run(self) -> None:
        latest: dict[str, ServiceStateChange] = {}  # each instance's newest change not yet handled
        ready: asyncio.Queue[str] = asyncio.Queue()  # instances with a change and no task on them
        busy: set[str] = set()  # instances a task is handling

        def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
            # zeroconf calls this on our loop: no thread hop, and nothing else runs in between
            if state_change is ServiceStateChange.Removed:  # a goodbye: anyone can send one (see the class)
                return
            agent_id = agent_id_of_instance(name)
            if agent_id is None:
                logger.debug("ignoring mDNS instance %r: not an agent id", name)
                return
            if self._members is not None and agent_id not in self._members:
                self.strangers.add(agent_id)
                return
            if name not in latest and name not in busy:
                ready.put_nowait(name)
            latest[name] = state_change

        async def resolver() -> None:
            while True:
                name = await ready.get()
                busy.add(name)
                try:
                    while name in latest:  # a change that came during the last one's resolve
                        await self._handle(zeroconf, name, latest.pop(name))
                finally:
                    busy.discard(name)

        zeroconf = open_zeroconf(self._interfaces)
        browser = AsyncServiceBrowser(zeroconf.zeroconf, SERVICE_TYPE, handlers=[on_change])
        logger.info("browsing %s on %s", SERVICE_TYPE, self._interfaces)
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(MAX_RESOLVING):
                    group.create_task(resolver())
        finally:
            await browser.async_cancel()
            await zeroconf.async_close()

    async def _handle(self, zeroconf: AsyncZeroconf, name: str, change: ServiceStateChange) -> None:
        agent_id = agent_id_of_instance(name)
        assert agent_id is not None  # on_change queued only agents' names
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zeroconf.zeroconf, self._resolve_timeout_ms) or info.port is None:
            logger.debug("mDNS instance %s… did not resolve", agent_id[:12])
            return
        try:
            record = AgentRecord.from_txt(info.properties)
        except RecordError as error:
            self._warn_once(agent_id, error)
            return
        if record.agent_id != agent_id or record.fleet_id != self._fleet_id:
            logger.debug("ignoring mDNS instance %s…: another fleet or a mismatched id", agent_id[:12])
            return
        addresses = tuple(host_port(address, info.port) for address in info.parsed_addresses()
                          if _peer_address(address, self._loopback_ok))
        if not addresses:
            return
        try:
            sighting = Sighting(agent_id, addresses, DiscoverySource.MDNS, record)
        except ProtocolError as error:  # port 0, for one: anyone can announce anything
            self._warn_once(agent_id, error)
            return
        self._registry.observe(sighting)

    def _warn_once(self, agent_id: str, error: Exception) -> None:
        """A member's announcement that makes no agent record, said once a browse. Where it came from is not said:
        the addresses a resolve gives may be another sender's records than its TXT (a helper's rogue answered for a
        member's name, and the warning named the member's own address)."""
        if agent_id in self._warned:
            return
        self._warned.add(agent_id)
        logger.warning("ignoring an mDNS announcement for agent %s… (anyone on the LAN can announce one): %s",
                       agent_id[:12], error)


class RegistrationDiscovery:
    """Agents that call in. The controller's server calls `accept` for each Register it receives."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def accept(self, register: Register, peer_agent_id: str) -> None:
        """Record a Register from a TLS peer whose certificate says `peer_agent_id`.

        Raises PermissionError when the message claims another agent's id; the caller must answer
        Error(UNAUTHORIZED) and close the connection.
        """
        if register.agent_id != peer_agent_id:
            raise PermissionError(f"agent {peer_agent_id[:12]}… registered as {register.agent_id[:12]}…")
        self._registry.observe(Sighting(register.agent_id, register.listen_addresses, DiscoverySource.REGISTRATION))

    async def run(self) -> None:
        """Nothing to poll: registrations arrive through `accept`."""
        await asyncio.Event().wait()


class ManualPeers:
    """`--peer HOST:PORT` addresses. ValueError at construction names a malformed one."""

    def __init__(self, registry: Registry, peers: Iterable[str]) -> None:
        self._registry = registry
        self.peers = tuple(peers)
        for peer in self.peers:
            try:
                parse_address(peer)
            except ProtocolError as error:
                raise ValueError(f"--peer {peer!r}: {error}") from error

    async def run(self) -> None:
        """Hand the addresses to the registry as dial targets; the connection layer reports who answers."""
        self._registry.add_dial_targets(self.peers)
        await asyncio.Event().wait()


def _peer_address(address: str, loopback_ok: bool) -> bool:
    """Whether a peer of the browse can be at `address` (see ZeroconfDiscovery): loopback only for a browse on
    loopback."""
    ip = ipaddress.ip_address(address)
    return not (ip.is_link_local or (ip.is_loopback and not loopback_ok) or ip.is_unspecified or ip.is_multicast
                or ip.is_reserved)


