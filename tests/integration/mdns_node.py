"""One side of test_mdns_ipv6.py, run as a process inside a network namespace.

    python -m tests.integration.mdns_node announce AGENT_ID CONTROLLER_ID FLEET_ID SECONDS
        announces an agent and a controller, each on the addresses an agent or `fleet serve` listening on every
        interface announces (addresses_to_advertise), for SECONDS; prints them as JSON first
    python -m tests.integration.mdns_node look AGENT_ID CONTROLLER_ID FLEET_ID SECONDS
        browses for agents as `fleet ls` does (on interface_addresses()) for SECONDS, then looks for the moved
        controller as an agent listening on every interface does; prints what each found as JSON
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

from deskfleet.agent.advertise import Advertiser, addresses_to_advertise, interface_addresses
from deskfleet.agent.controller_search import find_controller, interfaces_to_search
from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import AgentRecord, ControllerRecord
from deskfleet.controller.discovery import ZeroconfDiscovery
from deskfleet.controller.registry import Registry

PORT = 7431


async def announce(agent_id: str, controller_id: str, fleet_id: str, seconds: float) -> None:
    addresses, why_none = await addresses_to_advertise("0.0.0.0")
    print(json.dumps({"addresses": addresses, "why_none": why_none}), flush=True)
    agent = AgentRecord(agent_id, fleet_id, "0.16.0", ("CPU",), 1 << 30, AgentState.AVAILABLE)
    async with Advertiser(agent, PORT, addresses), Advertiser(ControllerRecord(controller_id, fleet_id), PORT + 1,
                                                              addresses):
        await asyncio.sleep(seconds)


async def look(agent_id: str, controller_id: str, fleet_id: str, seconds: float) -> None:
    registry = Registry(ttl_s=60.0)
    interfaces = interface_addresses()
    browse = asyncio.create_task(ZeroconfDiscovery(registry, fleet_id, interfaces, members=[agent_id]).run())
    await asyncio.sleep(seconds)
    browse.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await browse
    entry = registry.get(agent_id)
    controller = await find_controller(fleet_id, controller_id, interfaces_to_search("0.0.0.0", ["10.9.9.9:7341"]))
    print(json.dumps({"interfaces": interfaces, "agent": list(entry.addresses) if entry else None,
                      "controller": controller}), flush=True)


def main() -> None:
    mode, agent_id, controller_id, fleet_id, seconds = sys.argv[1:]
    asyncio.run({"announce": announce, "look": look}[mode](agent_id, controller_id, fleet_id, float(seconds)))


if __name__ == "__main__":
    main()
