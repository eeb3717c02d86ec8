"""Find the controller over mDNS when the addresses an agent joined with no longer answer.

`fleet serve` announces `_deskfleet-ctl._tcp.local.` (controller/fleet_server.py). An agent whose
registration fails at every address of its membership (the controller got a new DHCP lease, or its data dir
moved to another PC) browses for a few seconds and gets back the addresses of announcements that name its
fleet and its controller's id. Nothing here is trusted: anyone on the LAN can announce anything, so the
browse is bounded (SEARCH_S, at most MAX_INSTANCES resolved, MAX_ADDRESSES returned) and the caller dials
the addresses over TLS pinned to the controller key it saved at join, which only the real controller holds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence

from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from deskfleet.agent.advertise import ip_version_of
from deskfleet.common.discovery_record import CONTROLLER_SERVICE_TYPE, ControllerRecord, RecordError

log = logging.getLogger(__name__)

SEARCH_S = 3.0  # a live responder answers within ~120 ms (RFC 6762), the rest is zeroconf's query retries
RESOLVE_TIMEOUT_MS = 1000
MAX_INSTANCES = 16  # announcements resolved per search; a flood of fakes costs a bounded browse
MAX_ADDRESSES = 8  # addresses handed back to dial


async def find_controller(fleet_id: str, controller_id: str, interfaces: Sequence[str],
                          search_s: float = SEARCH_S) -> list[str]:
    """"host:port" of every announcement of `controller_id` for `fleet_id` seen on `interfaces` within
    `search_s` seconds (none when mDNS cannot be used there: the error is logged, never raised)."""
    if not interfaces:
        return []
    names: list[str] = []
    seen = asyncio.Event()

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Removed and name not in names and len(names) < MAX_INSTANCES:
            names.append(name)
            seen.set()

    try:
        zeroconf = AsyncZeroconf(interfaces=list(interfaces), ip_version=ip_version_of(interfaces))
    except OSError as error:
        log.info("cannot look for the controller over mDNS on %s: %s", ", ".join(interfaces), error)
        return []
    browser = AsyncServiceBrowser(zeroconf.zeroconf, CONTROLLER_SERVICE_TYPE, handlers=[on_change])
    found: list[str] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + search_s
        resolved = 0
        while loop.time() < deadline and len(found) < MAX_ADDRESSES:
            if resolved == len(names):
                seen.clear()
                try:
                    await asyncio.wait_for(seen.wait(), deadline - loop.time())
                except TimeoutError:
                    break
                continue
            name = names[resolved]
            resolved += 1
            for address in await _addresses_of(zeroconf, name, fleet_id, controller_id):
                if address not in found:
                    found.append(address)
            if found:
                break  # the first answer is enough: the one controller of a fleet
    finally:
        await browser.async_cancel()
        await zeroconf.async_close()
    return found[:MAX_ADDRESSES]


async def _addresses_of(zeroconf: AsyncZeroconf, name: str, fleet_id: str, controller_id: str) -> list[str]:
    info = AsyncServiceInfo(CONTROLLER_SERVICE_TYPE, name)
    if not await info.async_request(zeroconf.zeroconf, RESOLVE_TIMEOUT_MS) or not info.port:
        return []
    try:
        record = ControllerRecord.from_txt(info.properties)
    except RecordError as error:
        log.debug("ignoring controller announcement %s: %s", name[:24], error)
        return []
    if record.fleet_id != fleet_id or record.controller_id != controller_id or name != record.instance_name:
        log.debug("ignoring controller announcement %s: another fleet or controller", name[:24])
        return []
    return [f"[{address}]:{info.port}" if ":" in address else f"{address}:{info.port}"
            for address in info.parsed_addresses() if not ipaddress.ip_address(address).is_link_local]

