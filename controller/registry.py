"""The controller's registry of agents: every discovery source merged, with liveness.

Sources (controller/discovery.py) report `Sighting`s: mDNS, an agent's Register message, or a manual
`--peer` the controller reached. The connection layer pings every known agent over its websocket and
calls `confirm(agent_id)` on each answer. An entry that is neither sighted nor confirmed for `ttl_s`
seconds disappears (a closed laptop is gone within ttl_s), and comes back with the next sighting.

Manual peers have no agent id until the controller connects and reads it from the TLS certificate, so
they are kept apart as `dial_targets()`: addresses the connection layer must keep trying; once it
knows the id it reports a Sighting with source MANUAL.

Anyone on the LAN can announce any agent id over mDNS (the id is public: it is in the agent's own TXT),
so an entry keeps the addresses authenticated sources gave (a Register over the agent's TLS link, a
manual peer whose certificate named it) ahead of mDNS-only ones: a fake announcement adds an address
to try last, never hides the agent's real one.

No clock is read except through `clock`; not thread-safe (use from the controller's event loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import Enum

from deskfleet.common.discovery_record import AgentRecord
from deskfleet.common.wire import parse_address

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 10.0


class DiscoverySource(Enum):
    MDNS = "mdns"
    REGISTRATION = "registration"  # the agent called in with its token's controller address
    MANUAL = "manual"  # `--peer HOST:PORT`

    @property
    def authenticated(self) -> bool:
        """Its addresses came from the agent itself over TLS (its certificate named it); mDNS's from anyone."""
        return self is not DiscoverySource.MDNS


@dataclass(frozen=True)
class Sighting:
    """A source saw agent `agent_id` at `addresses` ("host:port"); `record` when mDNS carried one."""

    agent_id: str
    addresses: tuple[str, ...]
    source: DiscoverySource
    record: AgentRecord | None = None

    def __post_init__(self) -> None:
        for address in self.addresses:
            parse_address(address)  # ProtocolError on a malformed address


@dataclass(frozen=True)
class FleetEntry:
    """One live agent. `addresses` in the order to dial them: those an authenticated source gave first,
    then mDNS-only ones, newest first within each; `record` is the last mDNS TXT seen (may be None)."""

    agent_id: str
    addresses: tuple[str, ...]
    sources: frozenset[DiscoverySource]
    record: AgentRecord | None
    first_seen: float
    last_seen: float  # last sighting or confirmed ping
    authenticated: frozenset[str] = frozenset()  # the addresses an authenticated source gave


class Registry:
    """Live agents by id, plus the manual addresses to dial. Call `expire()` (or read `entries()`) often."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, FleetEntry] = {}
        self._dial_targets: dict[str, None] = {}  # ordered set

    # Public methods: sources report

    def observe(self, sighting: Sighting) -> FleetEntry:
        """Record a sighting: adds the agent or refreshes it (addresses merged, authenticated ones first,
        then newest first)."""
        now = self._clock()
        old = self._entries.get(sighting.agent_id)
        authenticated = frozenset(sighting.addresses if sighting.source.authenticated else ())
        if old is None:
            entry = FleetEntry(sighting.agent_id, _dial_order(sighting.addresses, authenticated),
                               frozenset({sighting.source}), sighting.record, first_seen=now, last_seen=now,
                               authenticated=authenticated)
            logger.info("agent %s… found via %s at %s", sighting.agent_id[:12], sighting.source.value,
                        ", ".join(sighting.addresses))
        else:
            authenticated |= old.authenticated
            addresses = _dial_order(tuple(dict.fromkeys((*sighting.addresses, *old.addresses))), authenticated)
            entry = replace(old, addresses=addresses, sources=old.sources | {sighting.source},
                            record=sighting.record or old.record, last_seen=now, authenticated=authenticated)
        self._entries[sighting.agent_id] = entry
        return entry

    def confirm(self, agent_id: str) -> bool:
        """The agent answered a ping: keep it alive. False if it is not (or no longer) registered."""
        entry = self._entries.get(agent_id)
        if entry is None:
            return False
        self._entries[agent_id] = replace(entry, last_seen=self._clock())
        return True

    def add_dial_targets(self, addresses: Iterable[str]) -> None:
        """Addresses ("host:port") the connection layer must dial to learn who is there (manual peers)."""
        for address in addresses:
            parse_address(address)
            self._dial_targets[address] = None

    # Public methods: readers

    def expire(self) -> list[str]:
        """Drop entries not refreshed for ttl_s seconds; returns their agent ids."""
        deadline = self._clock() - self.ttl_s
        gone = [agent_id for agent_id, entry in self._entries.items() if entry.last_seen < deadline]
        for agent_id in gone:
            del self._entries[agent_id]
            logger.info("agent %s… lost: no sighting or ping answer for %.0f s", agent_id[:12], self.ttl_s)
        return gone

    def entries(self) -> tuple[FleetEntry, ...]:
        """Live agents, sorted by agent id (expires stale ones first)."""
        self.expire()
        return tuple(self._entries[agent_id] for agent_id in sorted(self._entries))

    def get(self, agent_id: str) -> FleetEntry | None:
        self.expire()
        return self._entries.get(agent_id)

    def dial_targets(self) -> tuple[str, ...]:
        """Manual addresses, in the order given, that no authenticated source has tied to a live entry yet:
        dial these (an mDNS claim alone does not count: a fake one would hide the peer behind another's id)."""
        self.expire()
        known = {address for entry in self._entries.values() for address in entry.authenticated}
        return tuple(address for address in self._dial_targets if address not in known)


# Private functions

def _dial_order(addresses: tuple[str, ...], authenticated: frozenset[str]) -> tuple[str, ...]:
    """`addresses` (newest first) with the authenticated ones moved ahead, each group's order kept."""
    return tuple(sorted(addresses, key=lambda address: address not in authenticated))
