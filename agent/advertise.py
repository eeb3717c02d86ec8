"""Announce this agent on the LAN: zeroconf `_deskfleet._tcp.local.` with the AgentRecord as TXT.

mDNS goes out only on the interfaces given (their IP addresses); nothing is sent elsewhere. The agent
core must:
    advertiser = Advertiser(record, port, addresses=[...])   # concrete IPs, never 0.0.0.0
    await advertiser.start()
    await advertiser.update(new_record)                        # after each status change; cheap if equal
    await advertiser.close()                                   # sends goodbye packets
(or `async with Advertiser(...) as advertiser:`), all from the event loop that runs the agent.
Free memory is rounded down (AgentRecord.coarse) so a TXT update goes out only on a real change.
Corporate Wi-Fi often drops multicast: the agent also registers with the controller (Register message).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence
from types import TracebackType

import psutil
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from deskfleet.common.discovery_record import SERVICE_TYPE, AgentRecord

logger = logging.getLogger(__name__)


def interface_addresses(include_loopback: bool = False) -> list[str]:
    """This host's IPv4 addresses that mDNS can use (no link-local; loopback only if asked), sorted."""
    found = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family != socket.AF_INET:
                continue
            ip = ipaddress.IPv4Address(address.address)
            if ip.is_link_local or (ip.is_loopback and not include_loopback):
                continue
            found.add(str(ip))
    return sorted(found, key=ipaddress.IPv4Address)


class Advertiser:
    """One agent's mDNS advertisement on `addresses` (the IPs it listens on and announces).

    `interfaces` defaults to `addresses`: mDNS traffic is bound to exactly those interfaces.
    """

    def __init__(self, record: AgentRecord, port: int, addresses: Sequence[str],
                 interfaces: Sequence[str] | None = None) -> None:
        if not addresses:
            raise ValueError("an advertisement needs at least one address")
        parsed = [ipaddress.ip_address(address) for address in addresses]
        if any(ip.is_unspecified for ip in parsed):
            raise ValueError(f"advertise concrete addresses, not {addresses}; see interface_addresses()")
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is outside 1..65535")
        self._record = record.coarse()
        self._port = port
        self._addresses = [ip.packed for ip in parsed]
        self._interfaces = list(interfaces) if interfaces is not None else [str(ip) for ip in parsed]
        self._ip_version = _ip_version(parsed)
        self._zeroconf: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    # Public methods

    @property
    def record(self) -> AgentRecord:
        """The record as last announced (free memory rounded)."""
        return self._record

    async def start(self) -> None:
        """Register the service (probing the name first); raises zeroconf's errors on a name conflict."""
        if self._zeroconf is not None:
            raise RuntimeError("advertiser already started")
        self._zeroconf = AsyncZeroconf(interfaces=self._interfaces, ip_version=self._ip_version)
        self._info = self._service_info()
        await (await self._zeroconf.async_register_service(self._info))  # the inner task: probing done
        logger.info("advertising agent %s… on %s port %d", self._record.agent_id[:12], self._interfaces, self._port)

    async def update(self, record: AgentRecord) -> bool:
        """Announce `record` if its TXT differs from the last one; returns True when it sent an update."""
        if record.agent_id != self._record.agent_id:
            raise ValueError("an advertiser announces one agent; make a new one for another id")
        coarse = record.coarse()
        if coarse == self._record:
            return False
        self._record = coarse
        if self._zeroconf is None:
            return False  # not started: start() will announce the new record
        self._info = self._service_info()
        await (await self._zeroconf.async_update_service(self._info))
        logger.debug("advertisement updated: %s", coarse.to_txt())
        return True

    async def close(self) -> None:
        """Send goodbye and close the sockets. Safe to call twice."""
        zeroconf, self._zeroconf = self._zeroconf, None
        if zeroconf is None:
            return
        try:
            if self._info is not None:
                await (await zeroconf.async_unregister_service(self._info))  # goodbyes sent
        finally:
            await zeroconf.async_close()

    async def __aenter__(self) -> Advertiser:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.close()

    # Private methods

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE,
            self._record.instance_name,
            addresses=self._addresses,
            port=self._port,
            properties=self._record.to_txt(),
            server=f"df-{self._record.agent_id[:16]}.local.",
        )


def _ip_version(addresses: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> IPVersion:
    versions = {ip.version for ip in addresses}
    if versions == {4}:
        return IPVersion.V4Only
    if versions == {6}:
        return IPVersion.V6Only
    return IPVersion.All
