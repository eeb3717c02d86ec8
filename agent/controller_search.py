"""Find the controller over mDNS when the addresses an agent joined with no longer answer.

`fleet serve` announces `_deskfleet-ctl._tcp.local.` under its controller id (controller/fleet_server.py). An
agent whose registration fails at every address of its membership (the controller got a new DHCP lease, or its
data dir moved to another PC) asks, for a few seconds, for that one name, `<controller id>._deskfleet-ctl._tcp`,
and gets back the addresses of an announcement whose TXT names its fleet and its controller's id. Nothing here
is trusted: anyone on the LAN can announce anything. Other names are never resolved, so a flood of them costs
nothing and cannot hide the controller; the search ends after SEARCH_S; at most MAX_ADDRESSES addresses come
back, and the caller dials them over TLS pinned to the controller key it saved at join, which only the real
controller holds.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence

from zeroconf.asyncio import AsyncServiceInfo

from deskfleet.agent.advertise import interface_addresses, open_zeroconf
from deskfleet.common.discovery_record import CONTROLLER_SERVICE_TYPE, ControllerRecord, RecordError
from deskfleet.common.wire import is_loopback_address

log = logging.getLogger(__name__)

SEARCH_S = 3.0  # a live responder answers within ~120 ms (RFC 6762), the rest is zeroconf's query retries
MAX_ADDRESSES = 8  # addresses handed back to dial


def interfaces_to_search(listen: str, controller_addresses: Sequence[str]) -> list[str]:
    """The interfaces to look for a moved controller on: none where no announcement can help, every interface's
    (interface_addresses) otherwise. None when this agent listens on loopback only (no controller elsewhere could
    reach it), or when every address it knows its controller by is loopback (a `fleet serve` on this PC that
    listens there announces nothing): before, such an agent sent its mDNS queries out of every interface of the
    PC, onto the LAN, each time its controller was down."""
    if is_loopback_address(listen) or (controller_addresses and all(is_loopback_address(address)
                                                                     for address in controller_addresses)):
        return []
    return interface_addresses()


async def find_controller(fleet_id: str, controller_id: str, interfaces: Sequence[str],
                          search_s: float = SEARCH_S) -> list[str]:
    """"host:port" of the announcement of `controller_id` for `fleet_id` seen on `interfaces` within `search_s`
    seconds, at most MAX_ADDRESSES (none when there is none, or when mDNS cannot be used there: the error is
    logged, never raised). Its mDNS sockets are closed on every way out, cancellation included."""
    if not interfaces:
        return []
    try:
        zeroconf = open_zeroconf(interfaces)
    except OSError as error:
        log.info("cannot look for the controller over mDNS on %s: %s", ", ".join(interfaces), error)
        return []
    try:
        info = AsyncServiceInfo(CONTROLLER_SERVICE_TYPE, f"{controller_id}.{CONTROLLER_SERVICE_TYPE}")
        if not await info.async_request(zeroconf.zeroconf, search_s * 1000):
            return []
    except OSError as error:  # the query could not be sent
        log.info("cannot look for the controller over mDNS on %s: %s", ", ".join(interfaces), error)
        return []
    finally:
        await zeroconf.async_close()
    return _addresses_of(info, fleet_id, controller_id)[:MAX_ADDRESSES]


def _addresses_of(info: AsyncServiceInfo, fleet_id: str, controller_id: str) -> list[str]:
    """The addresses to dial that a resolved announcement gives: none when its TXT is not this fleet's controller
    record or its port is 0; link-local (unusable without an interface), unspecified and multicast addresses
    left out."""
    if not info.port:
        return []
    try:
        record = ControllerRecord.from_txt(info.properties)
    except RecordError as error:
        log.debug("ignoring the controller announcement: %s", error)
        return []
    if record.fleet_id != fleet_id or record.controller_id != controller_id:
        log.debug("ignoring the controller announcement: another fleet or controller")
        return []
    addresses = [ipaddress.ip_address(address) for address in info.parsed_addresses()]
    return [f"[{address}]:{info.port}" if address.version == 6 else f"{address}:{info.port}"
            for address in addresses if not (address.is_link_local or address.is_unspecified or address.is_multicast)]
