"""Announce this agent on the LAN: zeroconf `_deskfleet._tcp.local.` with the AgentRecord as TXT (and
`fleet serve` the controller, `_deskfleet-ctl._tcp.local.` with its ControllerRecord, the same way).

mDNS goes out only on the interfaces given (their IP addresses); nothing is sent elsewhere. The agent
core must:
    advertiser = Advertiser(record, port, addresses=[...])   # concrete IPs, never 0.0.0.0
    await advertiser.start()
    await advertiser.update(new_record)                        # after each status change; cheap if equal
    await advertiser.close()                                   # sends goodbye packets
(or `async with Advertiser(...) as advertiser:`), all from the event loop that runs the agent.
Free memory is rounded down (AgentRecord.coarse) so a TXT update goes out only on a real change.
Corporate Wi-Fi often drops multicast: the agent also registers with the controller (Register message).
`advertise_while_serving` is the loop both the agent and `fleet serve` run: it follows the PC's addresses,
keeps the record current and outlives what the LAN does to it (no multicast, a name announced by another host).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import psutil
from zeroconf import IPVersion, NonUniqueNameException
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from deskfleet.common.discovery_record import AgentRecord, ControllerRecord
from deskfleet.common.log_limit import as_one_line
from deskfleet.common.wire import ProtocolError, ip_families, listens_everywhere, parse_address

logger = logging.getLogger(__name__)

Record = TypeVar("Record", AgentRecord, ControllerRecord)


def interface_addresses(include_loopback: bool = False) -> list[str]:
    """This host's addresses that mDNS can use and announce: IPv4 and IPv6, but no link-local one (an IPv6 one needs
    the dialling PC's own zone; an IPv4 one, 169.254/16, is what a PC takes when DHCP fails), multicast or
    unspecified, and loopback only if asked; IPv4 first, each family sorted."""
    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:  # Windows and macOS give an IPv6 link-local address with its zone ("fe80::1%12")
                ip = ipaddress.ip_address(address.address.split("%", 1)[0])
            except ValueError:
                continue
            if ip.is_link_local or ip.is_multicast or ip.is_unspecified or (ip.is_loopback and not include_loopback):
                continue
            found.add(ip)
    return [str(ip) for ip in sorted(found, key=lambda ip: (ip.version, ip))]


# Per IP version, a socket family and an address of a documentation network: a route to it is the default route
DEFAULT_ROUTE_PROBES = {4: (socket.AF_INET, "192.0.2.1"), 6: (socket.AF_INET6, "2001:db8::1")}


_IPV6_ADDR_PREFERENCES, _IPV6_PREFER_SRC_PUBLIC = 72, 0x0002  # <linux/in6.h>; Python's socket does not name them


def route_source(family: socket.AddressFamily, target: str) -> str | None:
    """The address this machine sends from to reach `target`; None where no route of that family reaches it or
    the route's source is one no other PC can dial (loopback, link-local). A UDP connect sends no packet."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no IPv6 on this PC: OSError here
            if family == socket.AF_INET6 and sys.platform.startswith("linux"):
                # a stable address, not a temporary (privacy) one, which goes within days (a token carries it)
                with contextlib.suppress(OSError):
                    probe.setsockopt(socket.IPPROTO_IPV6, _IPV6_ADDR_PREFERENCES, _IPV6_PREFER_SRC_PUBLIC)
            probe.connect((target, 9))
            host = str(probe.getsockname()[0]).split("%", 1)[0]
    except OSError:
        return None
    ip = ipaddress.ip_address(host)
    return None if ip.is_loopback or ip.is_link_local or ip.is_unspecified else host


def stable_source(reached_from: str, toward: str) -> str:
    """The address to register for `reached_from`, this PC's end of a link to `toward`: on IPv6, the stable address of
    the same /64 where the kernel took a temporary (privacy) one for the link, which goes within days (the default on
    Windows and desktop Linux; an exploratory test's agent registered one, and the roster followed each rotation);
    `reached_from` itself otherwise. Linux tells the stable one when asked for a public source (route_source); other
    systems give the temporary one again, which is kept."""
    try:
        ip = ipaddress.ip_address(reached_from)
        if ip.version != 6 or ip.ipv4_mapped is not None or ip.is_loopback or ip.is_link_local:
            return reached_from
        prefix = ipaddress.ip_network(f"{reached_from}/64", strict=False)
    except ValueError:  # a scoped address ("fe80::1%eth0"), which no other PC dials anyway
        return reached_from
    stable = route_source(socket.AF_INET6, toward)
    if stable is None or stable == reached_from or stable not in interface_addresses():
        return reached_from
    return stable if ipaddress.ip_address(stable) in prefix else reached_from


def lan_sources(toward: Sequence[str] = ()) -> dict[int, str]:
    """This PC's address of each IP version (4, 6) that reaches beyond it: the one it sends from towards the first of
    `toward` (host:port: the controller's addresses) of that version it has a route to, else towards the version's
    default route; a version that reaches neither is left out, as is an address not among interface_addresses().
    A container's or a VM's adapter (172.17.0.1, 192.168.56.1) routes nowhere past this PC: a PC whose LAN had IPv6
    alone counted as one of both families for its container bridge, and the plan put an IPv4-only PC before it
    (from an exploratory test of a dual-stack office). A UDP connect sends no packet."""
    here = set(interface_addresses())
    found: dict[int, str] = {}
    for version, (family, default_route) in DEFAULT_ROUTE_PROBES.items():
        hosts = [host for host in _ip_hosts(toward) if ipaddress.ip_address(host).version == version]
        for target in (*hosts, default_route):
            source = route_source(family, target)
            if source is not None and source in here:
                found[version] = source
                break
    return found


class RoutedSources:
    """lan_sources() looked up again at each call (`look`), keeping an address whose route alone went: one of a
    version the look no longer finds a source of (no route to the controller's address, nor a default one) stays
    while the PC still has it on an interface that is up, for at most KEEP_UNROUTED_S. An exploratory test's ULA-only
    office (no IPv6 default route) read a flapping route to the controller's IPv6 address as the address's loss: the
    roster dropped the PC's working IPv6 address for 30 s, and a deploy meanwhile took it for an IPv4-only PC. A
    source of another address replaces it (renumbered); an address gone from the interfaces, or whose interface went
    down (Linux keeps IPv4 addresses on a downed interface), goes, as does one unrouted for longer than the limit
    (an IPv6 router gone quiet leaves its SLAAC addresses for days)."""

    def __init__(self, look: Callable[[], dict[int, str]], clock: Callable[[], float] = time.monotonic) -> None:
        self._look, self._clock = look, clock
        self._last: dict[int, str] = {}
        self._unrouted_since: dict[int, float] = {}  # the versions kept for want of a route, since when (logged once)

    def __call__(self) -> dict[int, str]:
        found = self._look()
        now = self._clock()
        kept = {version: address for version, address in self._last.items() if version not in found
                and now - self._unrouted_since.get(version, now) < KEEP_UNROUTED_S and on_an_up_interface(address)}
        for version in kept.keys() - self._unrouted_since.keys():
            logger.info("no IPv%d route past this PC now (none to the controller, no default one); %s is still on "
                        "an interface that is up, and is kept for up to %.0f s", version, kept[version],
                        KEEP_UNROUTED_S)
        self._unrouted_since = {version: self._unrouted_since.get(version, now) for version in kept}
        found.update(kept)
        self._last = dict(found)
        return found


KEEP_UNROUTED_S = 300.0  # how long RoutedSources keeps an address whose route went


def on_an_up_interface(address: str) -> bool:
    """Whether `address` is on an interface of this PC that is up (psutil's `isup`: the running flag, the carrier, on
    Linux; the operational status on Windows)."""
    try:
        stats = psutil.net_if_stats()
        return any(entry.address.split("%", 1)[0] == address and (state := stats.get(interface_of(label)))
                   is not None and state.isup
                   for label, entries in psutil.net_if_addrs().items() for entry in entries
                   if entry.family in (socket.AF_INET, socket.AF_INET6))
    except OSError:  # the interfaces cannot be read: nothing is kept that may be gone
        return False


def interface_of(label: str) -> str:
    """The interface that psutil's net_if_addrs() key `label` is on: a labelled IPv4 address (`ip addr add ... label
    eth0:1`) is listed under its label, its interface's stats (net_if_stats()) under eth0 (from a review)."""
    return label.split(":", 1)[0]


def _ip_hosts(addresses: Sequence[str]) -> list[str]:
    """The IP hosts of host:port `addresses` (host names and malformed ones left out)."""
    hosts = []
    for address in addresses:
        try:
            host = parse_address(address)[0]
            ipaddress.ip_address(host)
        except (ProtocolError, ValueError):
            continue
        hosts.append(host)
    return hosts


def dialable_here(addresses: Sequence[str]) -> list[str]:
    """Of `addresses` (host:port), those of an IP family this PC has a LAN address of (loopback ones, and host names,
    which may resolve to either, kept); all of them where it has no LAN address yet. A controller of both families
    whose IPv6 address moved was announced at its old IPv4 address and its new IPv6 one: an agent with IPv6 alone
    took the IPv4 one, a membership address, for the controller not having moved, dialled it alone, and never
    registered again (from an exploratory test of a mixed IPv4/IPv6 office). The families are read from the LAN
    addresses alone: loopback has both on nearly every PC."""
    families = {ipaddress.ip_address(address).version for address in interface_addresses()}
    if not families:
        return list(addresses)
    return [address for address in addresses if (family := ip_families([address])) is None or family & families]


class _GoneAddressSocketLog(logging.Filter):
    """zeroconf warns, with the error's traceback, of a socket whose send failed ("Error with socket 18
    (('10.231.0.13', 5353))): [Errno 101] Network is unreachable"): at each change of a PC's addresses, that of the
    address it just lost (an exploratory test), whose socket the next announcement replaces. Such a record becomes one
    line at INFO saying so; any other failure stays as zeroconf says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, OSError) and error.errno in _ADDRESS_GONE_ERRNOS and \
                str(record.msg).startswith("Error with socket"):
            # zeroconf says a repeat at DEBUG, which stays
            as_one_line(record, "this PC lost that address, or its route (mDNS sends again at its next announcement)",
                        logging.INFO)
        return True


_ADDRESS_GONE_ERRNOS = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL})
_GONE_ADDRESS_SOCKETS = _GoneAddressSocketLog()


def open_zeroconf(interfaces: Sequence[str]) -> AsyncZeroconf:
    """Zeroconf's sockets on `interfaces` (IP addresses of this PC), and on them alone; OSError where one of them is
    on no interface now (an address gone since it was read: zeroconf raises RuntimeError for an IPv6 one, whose
    interface index it looks up) or mDNS cannot be set up there."""
    logging.getLogger("zeroconf").addFilter(_GONE_ADDRESS_SOCKETS)  # once: a filter is added once
    try:
        return AsyncZeroconf(interfaces=list(interfaces), ip_version=ip_version_of(interfaces))
    except RuntimeError as error:  # "No adapter found for IP address ..."
        raise OSError(errno.EADDRNOTAVAIL, str(error)) from None


async def advertised_addresses(host: str) -> list[str]:
    """The addresses to announce for a listen host: every interface's for a wildcard, none for loopback, a
    host name's resolved addresses (none when it does not resolve)."""
    return (await addresses_to_advertise(host))[0]


async def addresses_to_advertise(host: str) -> tuple[list[str], str]:
    """(the addresses to announce for a listen host now, why there are none when there are none)."""
    if listens_everywhere(host):
        return interface_addresses(), "this PC has no network address yet (link-local ones are not announced)"
    try:
        return ([], f"listening on {host} only") if ipaddress.ip_address(host).is_loopback else ([host], "")
    except ValueError:  # a host name
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as error:
        return [], f"{host} does not resolve ({error})"
    resolved = sorted({str(info[4][0]) for info in infos})
    return [address for address in resolved if not ipaddress.ip_address(address).is_loopback], \
        f"{host} resolves to loopback addresses only"


def never_changes(host: str) -> bool:
    """Whether the addresses to announce for a listen host are fixed: an IP address's are (a wildcard's follow
    the interfaces, a host name's its resolution)."""
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def ip_version_of(addresses: Sequence[str]) -> IPVersion:
    """The zeroconf IP version that covers `addresses` (IP address strings)."""
    versions = {ipaddress.ip_address(address).version for address in addresses}
    if versions == {4}:
        return IPVersion.V4Only
    if versions == {6}:
        return IPVersion.V6Only
    return IPVersion.All


class Advertiser(Generic[Record]):
    """One agent's (or controller's) mDNS advertisement on `addresses` (the IPs it listens on and announces).

    `interfaces` defaults to `addresses`: mDNS traffic is bound to exactly those interfaces.
    """

    def __init__(self, record: Record, port: int, addresses: Sequence[str],
                 interfaces: Sequence[str] | None = None) -> None:
        if not addresses:
            raise ValueError("an advertisement needs at least one address")
        parsed = [ipaddress.ip_address(address) for address in addresses]
        if any(ip.is_unspecified for ip in parsed):
            raise ValueError(f"advertise concrete addresses, not {addresses}; see interface_addresses()")
        if not 0 < port < 65536:
            raise ValueError(f"port {port} is outside 1..65535")
        self._record: Record = record.coarse()
        self._port = port
        self._addresses = [ip.packed for ip in parsed]
        self._interfaces = list(interfaces) if interfaces is not None else [str(ip) for ip in parsed]
        self._zeroconf: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    # Public methods

    @property
    def record(self) -> Record:
        """The record as last announced (free memory rounded)."""
        return self._record

    async def start(self) -> None:
        """Register the service (probing the name first); raises zeroconf's errors on a name conflict, its sockets
        closed (as they are when cancelled while probing)."""
        if self._zeroconf is not None:
            raise RuntimeError("advertiser already started")
        self._zeroconf = zeroconf = open_zeroconf(self._interfaces)
        self._info = self._service_info()
        try:
            await (await zeroconf.async_register_service(self._info))  # the inner task: probing done
        except BaseException:  # a name conflict, or cancelled while probing: no sockets left open
            self._zeroconf = self._info = None
            await zeroconf.async_close()  # a goodbye too, where the name was registered already
            raise
        logger.info("advertising %s %s… on %s port %d", _what(self._record), self._record.instance_name[:12],
                    self._interfaces, self._port)

    async def update(self, record: Record) -> bool:
        """Announce `record` if its TXT differs from the last one; returns True when it sent an update."""
        if record.instance_name != self._record.instance_name:
            raise ValueError("an advertiser announces one agent (or controller); make a new one for another id")
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

    async def __aenter__(self) -> Advertiser[Record]:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.close()

    # Private methods

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            self._record.service_type,
            self._record.instance_name,
            addresses=self._addresses,
            port=self._port,
            properties=self._record.to_txt(),
            server=self._record.server_name,
        )


def _what(record: AgentRecord | ControllerRecord) -> str:
    return "agent" if isinstance(record, AgentRecord) else "controller"


@dataclass(frozen=True)
class Announcement(Generic[Record]):
    """What one advertising loop announces, where, and how its log lines speak of it."""

    port: Callable[[], int | None]  # the port served now; None: stopped, and the loop ends
    addresses: Callable[[], Awaitable[tuple[list[str], str]]]  # the addresses to announce now, and why none
    fixed: bool  # those addresses never change (an IP address to listen on): a failure there ends the loop
    record: Callable[[], Awaitable[Record | None]]  # the record now; None: unreadable, read again next refresh
    refresh_s: Callable[[], float]  # how often the addresses and the record are read again
    name: str  # the mDNS instance name, named when another host announces it
    doing: str  # "advertising" / "announcing the controller", for "not ... over mDNS: why"
    failing: str  # "mDNS advertisement" / "mDNS announcement of the controller", for "... failed at"
    log: logging.Logger  # the caller's: its lines belong to the caller's component
    no_address_level: int = logging.INFO  # how "not ... over mDNS: no address" is logged
    clash_note: str = ""  # what still works while another host holds the name
    advertiser: Callable[..., Any] = Advertiser  # the Advertiser class (tests give a fake)


async def advertise_while_serving(announcement: Announcement[Record]) -> None:
    """Announce at the addresses the PC has now, read again at every refresh: a PC whose address changes (a laptop
    moved from its dock to the Wi-Fi, a new DHCP lease) or that started before its network was up is announced
    where it is, by a new advertisement on the new addresses (the old one says goodbye: its sockets were bound to
    the addresses it announced). One that fails (no multicast there) is tried again when the addresses change; a
    name another host announces first (the name is public: anyone on the LAN can) every refresh. Each state is
    logged once. Returns when the port is gone, or when fixed addresses leave nothing to wait for."""
    a = announcement
    said: str | None = None  # the last state logged, so that each change is logged once

    def say(level: int, text: str) -> None:
        nonlocal said
        if text != said:
            said = text
            a.log.log(level, "%s", text)

    failed: list[str] | None = None  # the addresses an advertisement failed on, until they change
    while (port := a.port()) is not None:
        addresses, why_none = await a.addresses()
        if not addresses or addresses == failed:
            if not addresses:
                say(a.no_address_level, f"not {a.doing} over mDNS: {why_none}")
                if a.fixed:
                    return
            await asyncio.sleep(a.refresh_s())
            continue
        failed = None
        record = await a.record()
        if record is None:
            await asyncio.sleep(a.refresh_s())
            continue
        try:
            async with a.advertiser(record, port, addresses) as advertiser:  # logs where
                said = None
                while True:
                    await asyncio.sleep(a.refresh_s())
                    now, _ = await a.addresses()
                    if now != addresses:
                        a.log.info("this PC's addresses changed from %s to %s: %s again", ", ".join(addresses),
                                   ", ".join(now) or "none", a.doing)
                        break
                    record = await a.record()
                    if record is not None:
                        await advertiser.update(record)
        except NonUniqueNameException:
            say(logging.WARNING, f"not {a.doing} over mDNS: another host announces its name {a.name} (a copy of "
                                 f"this data dir running elsewhere, or a stranger on the LAN); tried again every "
                                 f"{a.refresh_s():.0f} s{a.clash_note}")
            await asyncio.sleep(a.refresh_s())
        except OSError as error:  # no multicast on this network
            say(logging.WARNING, f"{a.failing} failed at {', '.join(addresses)}: {error}; tried again when this "
                                 "PC's addresses change")
            failed = addresses
            if a.fixed:
                return
