"""Whether this PC's own network failed under a link: the interface that carried it lost its link (a cable pulled, a
laptop's Wi-Fi dropped, its switch port down) or the address it ran from.

A fleet run's driver sees a stage's link die and names that stage; where the controller's own network dropped for
longer than the links ride out (~10 s), every PC of the chain was healthy. The failover kept the named PC once a run,
so a second such drop in one run left a healthy PC out (an exploratory test's laptop controller). A watch samples
this PC's interfaces (psutil: `isup` is the running flag, the carrier, on Linux; the operational status on Windows)
and tells the chain, as a link of its dies, whether the link's own end failed just before (FleetPipeline._own_fault,
ChainError.own_fault, which the failover reads). A drop upstream of this PC (a switch between it and the office, or
under a VPN interface that stays up) leaves no trace here and is still taken for the stage's.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from deskfleet.agent.advertise import interface_of
from deskfleet.agent.link import Link, LinkError

log = logging.getLogger(__name__)

SAMPLE_S = 0.5  # how often the watch looks: shorter faults than this are ridden out by every link anyway
KEEP_S = 300.0  # how long a fault, and an address no longer seen, is remembered
# A fault over before a link died explains its death only where it ended this little before (a link dies of its
# keepalive while its network is down, and closes within CLOSE_TIMEOUT_S, 2 s, and a sample) and lasted this long:
# links ride out shorter drops (their resends), and a drop they rode out, or a Wi-Fi's roaming blip, excused a PC that
# crashed 15-20 s later (from a review and an exploratory test)
ENDED_GRACE_S = 3.0
MIN_FAULT_S = 3.0


@dataclass(frozen=True)
class NetworkFault:
    """A fault of this PC's network: `interface` lost its link (`address` None), or lost `address`; from `began`
    until `ended` (time.monotonic(); None: not over when last looked)."""

    interface: str
    address: str | None
    began: float
    ended: float | None

    def describe(self, now: float) -> str:
        what = f"lost its address {self.address}" if self.address is not None else "lost its link"
        ago = f"{max(0.0, now - self.began):.0f} s ago"
        back = "not back yet" if self.ended is None else f"back after {max(0.0, self.ended - self.began):.0f} s"
        return f"this PC's network interface {self.interface} {what} {ago}, {back}"


@dataclass(frozen=True)
class LinkDeath:
    """How a link of this PC's died, kept where it died (a chain's step, a deploy) for the failover to weigh against
    this PC's own network: `local_host` the address its end ran from, `own_address_gone` that address where this PC
    had lost it, `peer_closed` whether the peer's close frame came, `at` when (time.monotonic())."""

    local_host: str | None
    own_address_gone: str | None
    peer_closed: bool
    at: float

    @classmethod
    def of(cls, link: Link, error: LinkError) -> LinkDeath:
        return cls(link.local_host, error.own_address_gone, error.peer_closed, time.monotonic())


def explain(watch: OwnNetworkWatch | None, death: LinkDeath | None) -> str | None:
    """In words, the fault of this PC's own network that `death` came of, or None: the address the link ran from lost
    (the link told it), or, where no close frame came from the peer (a peer that closed, or crashed and reset it, is
    no network's fault), a fault of its interface as it died (`watch`'s fault_under; without a watch, none)."""
    if death is None or death.peer_closed:
        return None
    if death.own_address_gone is not None:
        return f"this PC lost its address {death.own_address_gone}, which the link ran from"
    fault = None if watch is None or death.local_host is None else watch.fault_under(death.local_host, death.at)
    return None if fault is None else fault.describe(death.at)


def _plain_ip(host: str) -> str | None:
    """`host` as interface addresses are listed (no zone, IPv4-mapped as IPv4); None for a host that is no IP."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class OwnNetworkWatch:
    """Samples this PC's interfaces every SAMPLE_S in a daemon thread (start()) and remembers their faults for
    KEEP_S. `stats`, `addresses` and `clock` are psutil's and time.monotonic, given by tests."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]] = psutil.net_if_stats,
                 addresses: Callable[[], Mapping[str, Sequence[Any]]] = psutil.net_if_addrs,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stats, self._addresses, self._clock = stats, addresses, clock
        self._lock = threading.Lock()
        self._where: dict[str, tuple[str, float]] = {}  # address -> (its interface, when last seen there)
        self._open: dict[tuple[str, str | None], float] = {}  # (interface, address or None) -> when its fault began
        self._faults: list[NetworkFault] = []  # those over, kept for KEEP_S
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: str | None = None  # the last sampling error, logged once until a sample succeeds

    def start(self) -> OwnNetworkWatch:
        if self._thread is None:
            self.sample()
            self._thread = threading.Thread(target=self._run, name="own-network-watch", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def sample(self) -> None:
        """One look at this PC's interfaces: their link and their addresses."""
        try:
            stats, found = self._stats(), self._addresses()
        except OSError as error:  # no fault is recorded for want of a look; said once until a look succeeds
            if str(error) != self._failing:
                self._failing = str(error)
                log.warning("cannot read this PC's network interfaces (%s): a dropped network of its own is not "
                            "told from a PC's failure until they can be read", error)
            return
        self._failing = None
        now = self._clock()
        present: set[str] = set()
        with self._lock:
            for label, entries in found.items():
                interface = interface_of(label)  # a label read as an interface always down (from a review)
                for entry in entries:
                    if entry.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    address = _plain_ip(str(entry.address))
                    # no link runs from a link-local address (every container's veth has one: they came and went)
                    if address is not None and not ipaddress.ip_address(address).is_link_local:
                        present.add(address)
                        self._where[address] = (interface, now)
            for address, (interface, seen) in list(self._where.items()):
                if address not in present and now - seen > KEEP_S:
                    del self._where[address]
                    self._open.pop((interface, address), None)
                    continue
                self._track((interface, address), address not in present, now)
            known = {interface for interface, _ in self._where.values()}
            for interface in known:
                state = stats.get(interface)
                if state is not None:  # not listed: not known (an interface gone shows as its addresses lost)
                    self._track((interface, None), not state.isup, now)
            for key in [key for key in self._open if key[1] is None and key[0] not in known]:
                del self._open[key]
            self._faults = [fault for fault in self._faults if fault.ended is not None and now - fault.ended <= KEEP_S]

    def fault_under(self, local_host: str, died_at: float) -> NetworkFault | None:
        """The fault of this PC's own network that explains the death at `died_at` (time.monotonic()) of a link
        whose end ran from `local_host` (Link.local_host): one of the interface that carries that address, or of the
        address itself, begun by then and still on then, or over within ENDED_GRACE_S before it after MIN_FAULT_S at
        least (the one still on, else the latest over); None where none is, or where this watch never saw that
        address on an interface (loopback included: it never fails)."""
        address = _plain_ip(local_host)
        with self._lock:
            where = self._where.get(address) if address is not None else None
            if where is None:
                return None
            interface = where[0]
            faults = [*self._faults, *(NetworkFault(key[0], key[1], began, None) for key, began in self._open.items()
                                       if key[0] == interface)]
        under = [fault for fault in faults if fault.interface == interface and fault.address in (None, address)
                 and fault.began <= died_at and (fault.ended is None or fault.ended >= died_at or (
                     fault.ended >= died_at - ENDED_GRACE_S and fault.ended - fault.began >= MIN_FAULT_S))]
        return max(under, key=lambda fault: (fault.ended is None or fault.ended >= died_at, fault.ended or 0.0,
                                             fault.began), default=None)

    def _track(self, key: tuple[str, str | None], faulty: bool, now: float) -> None:
        began = self._open.get(key)
        if faulty and began is None:
            self._open[key] = now
        elif not faulty and began is not None:
            del self._open[key]
            self._faults.append(NetworkFault(key[0], key[1], began, now))

    def _run(self) -> None:
        while not self._stopping.wait(SAMPLE_S):
            try:
                self.sample()
            except Exception:  # a bug here must not end the watch silently, nor anything else
                log.exception("the watch of this PC's network failed a look")


_shared: OwnNetworkWatch | None = None
_shared_lock = threading.Lock()


def shared_watch() -> OwnNetworkWatch:
    """The process's watch, started at its first use: one thread for every run of a long-lived server."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = OwnNetworkWatch().start()
        return _shared
