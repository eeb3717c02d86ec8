"""Find the fleet's agents and ask each how it is: the first step of `fleet ls`, `plan` and `deploy`.

Sources, merged in a discovery Registry (controller/registry.py):
- registrations: the roster addresses `deskfleet fleet serve` recorded when agents called in;
- mDNS: a short zeroconf browse (`--discover-seconds`) on this host's interfaces;
- manual `--peer HOST:PORT`, dialled without knowing the agent id (its certificate tells).
Every agent found is then dialled over an authenticated link (its agent id pinned in TLS where known,
revoked agents refused) and asked for a StatusReport, at all of its addresses at once, the first answer
winning (an mDNS announcement is anyone's claim, and a wrong address just fails the TLS pin); one that
does not answer at any is listed with each address's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from deskfleet.agent.advertise import interface_addresses
from deskfleet.agent.link import (
    OPEN_TIMEOUT_S,
    REPLY_MAX_FRAME_BYTES,
    Link,
    LinkError,
    LinkVersionError,
    TlsFiles,
    open_link,
)
from deskfleet.common import pki
from deskfleet.common.planner import NETWORK_DOWN_WORDS
from deskfleet.common.wire import (
    Error,
    KnownRemovals,
    StatusReport,
    StatusRequest,
    ip_families,
    is_loopback_address,
)
from deskfleet.controller.discovery import RESOLVE_TIMEOUT_MS, Discovery, ManualPeers, ZeroconfDiscovery
from deskfleet.controller.fleet_ca import Revocations, fleet_addresses, take_known_removals
from deskfleet.controller.fleet_store import FleetStore, FleetStoreError
from deskfleet.controller.registry import DiscoverySource, Registry, Sighting

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 5.0
RECHECK_OPEN_TIMEOUT_S = 3.0  # SurveyOptions.recheck: a TLS handshake on a LAN takes milliseconds
REFUSAL_READ_S = 1.0  # a link closed at once: how long to look for what the peer said before the close
MAX_ADDRESSES_PER_AGENT = 16  # dialled per agent: those an authenticated source gave first
# An agent's next address is dialled this long after the one before it stays silent (RFC 8305 gives 250 ms between a
# name's addresses)
SURVEY_DIAL_STAGGER_S = 0.25
# Links being opened at a time, whatever the announcements claim. A dial to a PC that is off holds its place
# for the whole open timeout (10 s): at 64, every 64 PCs that were off cost a survey another 10 s (150 of 300
# asleep: 31 s). 256 dials an office in one round and stays well inside the 1024 file handles Linux gives a
# process (with the links that answered, kept open until the survey closes); fewer where the process has fewer.
MAX_DIALS_AT_ONCE = 256
NO_ADDRESS = "-"  # the address of an enrolled PC that never said where it listens
NEVER_REGISTERED = ("joined, but its agent never called in: start `deskfleet-agent --headless` (with the join's "
                    "--data-dir) on that PC; if it runs, `fleet serve`'s log says why it was refused (a PC of "
                    "another deskfleet release is, at Hello: upgrade one of the two)")


@dataclass(frozen=True)
class SurveyOptions:
    peers: tuple[str, ...] = ()
    discover_seconds: float = 2.0  # 0: no mDNS browse
    use_roster: bool = True
    # Agent ids dialled with RECHECK_OPEN_TIMEOUT_S, not the whole open timeout: the PCs a failover has just
    # lost or that a stage blamed. One restarted answers within it; a frozen one (a stopped process, a hung PC)
    # cost the re-plan the whole open timeout again, after the chain had already waited it out.
    recheck: frozenset[str] = frozenset()
    # Agent ids: dial only these (a run's start asking the PCs of its chain that called in whether they still host
    # their stage), no roster member, mDNS record or --peer beside them; None: every one
    only: frozenset[str] | None = None


@dataclass(frozen=True)
class AgentView:
    """One agent as the survey found it: its status, or why it could not be reached."""

    agent_id: str | None  # None: a manual peer that did not answer
    hostname: str
    address: str  # the one that answered; the first tried when none did
    sources: tuple[str, ...]
    report: StatusReport | None
    problem: str | None
    certificate_expires: datetime.datetime | None = None  # the agent's certificate, as its link showed it
    version: str | None = None  # the deskfleet version its Hello named (also one that speaks another protocol)
    other_protocol: int | None = None  # the fleet protocol it speaks where that is not this controller's
    # its other addresses known (its registration's, mDNS's): a deploy gives them to the stage before it, which
    # dials one of a family its own PC has where `address` is not (NextHop.other_addresses)
    other_addresses: tuple[str, ...] = ()


class PeerVersion(NamedTuple):
    """What an agent said of its version: the deskfleet version its Hello (or its refusal of ours) named, the fleet
    protocol it speaks where that is not ours, and its id where only a refusal showed it (no link stays open)."""

    software: str | None
    other_protocol: int | None
    agent_id: str | None


UNKNOWN_VERSION = PeerVersion(None, None, None)


@dataclass
class Survey:
    """The agents found; `links` stay open for the caller (deploy) until `close()`."""

    agents: list[AgentView]
    links: dict[str, Link]
    # the fleet (its CA's id) the links were checked against: a deploy records nothing over them once `fleet init
    # --force` made another; None: not known (not checked)
    fleet_id: str | None = None

    async def close(self) -> None:
        for link in self.links.values():
            await link.close()
        self.links.clear()

    def reachable(self) -> list[AgentView]:
        return [agent for agent in self.agents if agent.report is not None and agent.agent_id in self.links]


async def survey(store: FleetStore, options: SurveyOptions) -> Survey:
    """Discover, dial and ask every agent; never raises for an agent's fault."""
    store.require_initialised()
    fleet = pki.fleet_id(store.tls_files.ca_certificate())
    revocations = Revocations(store)
    registry = Registry(ttl_s=3600.0)
    roster = store.roster()
    if options.use_roster:
        for agent_id, member in roster.items():
            if member.addresses and not revocations().is_revoked(agent_id):
                registry.observe(Sighting(agent_id, member.addresses, DiscoverySource.REGISTRATION))
    sources: list[Discovery] = [ManualPeers(registry, options.peers)]
    interfaces = interface_addresses()
    browser: ZeroconfDiscovery | None = None
    if options.discover_seconds > 0 and interfaces and not _loopback_fleet(store):
        # A resolve waits at most half the browse: a record that never resolves cannot outlast it.
        resolve_timeout_ms = min(RESOLVE_TIMEOUT_MS, max(1, int(options.discover_seconds * 500)))
        members = [agent_id for agent_id in roster if not revocations().is_revoked(agent_id)]
        browser = ZeroconfDiscovery(registry, fleet, interfaces, resolve_timeout_ms, members)
        sources.append(browser)
    await _run_for(sources, options.discover_seconds if len(sources) > 1 else 0.0)

    targets = survey_targets(registry, set(roster), revocations(), len(browser.strangers) if browser else 0)
    if options.only is not None:
        targets = [target for target in targets if target[0] in options.only]
    dials = asyncio.Semaphore(dials_at_once())
    results = await asyncio.gather(*(_ask_at_any(store, revocations, target_id, addresses, dials,
                                                 RECHECK_OPEN_TIMEOUT_S if target_id in options.recheck
                                                 else OPEN_TIMEOUT_S, _announced_only(registry, target_id))
                                     for target_id, addresses, _ in targets))

    found = Survey([], {}, fleet)
    listed_at: dict[str, int] = {}  # agent id -> its place in found.agents
    removed = revocations()  # with the removals agents gave back (a data dir restored from an older backup)
    for (target_id, addresses, source_names), (address, link, report, problem, peer) in zip(targets, results,
                                                                                          strict=True):
        # a PC of another protocol is known by the certificate its link showed before it closed: a --peer address
        # of a roster member was listed twice, once as "?"
        known_id = link.peer.agent_id if link is not None else target_id or peer.agent_id
        if known_id is not None and removed.is_revoked(known_id):  # removed again by what another agent said
            if link is not None:
                await link.close()
            continue
        if link is not None and known_id in found.links:  # the same agent by two routes
            await link.close()
            continue
        # the same agent by two routes that did not open a link (a PC of another protocol at its registered address
        # and at a --peer alias of it): listed once, the route that reached it kept
        earlier = listed_at.get(known_id) if known_id is not None else None
        if earlier is not None and (link is None or found.agents[earlier].report is not None):
            continue
        if link is not None and known_id is not None:
            found.links[known_id] = link
        hostname = roster[known_id].hostname if known_id is not None and known_id in roster else "?"
        expires = link.peer.not_valid_after if link is not None else None
        view = AgentView(known_id, hostname, address, source_names, report, problem, expires, peer.software,
                         peer.other_protocol, tuple(other for other in addresses if other != address))
        if earlier is not None:
            found.agents[earlier] = view
        else:
            if known_id is not None:
                listed_at[known_id] = len(found.agents)
            found.agents.append(view)
    if options.use_roster and options.only is None:
        # members that joined but whose agent never called in: listed, so the admin sees them
        listed = {agent.agent_id for agent in found.agents}
        for agent_id, member in roster.items():
            if not member.addresses and agent_id not in listed and not revocations().is_revoked(agent_id):
                found.agents.append(AgentView(agent_id, member.hostname, NO_ADDRESS, ("roster",), None,
                                              NEVER_REGISTERED))
    return found


def expiry_warnings(agents: list[AgentView], files: TlsFiles, now: datetime.datetime) -> list[str]:
    """A line for every agent whose certificate (as its link showed it) runs out within pki.EXPIRY_WARNING_DAYS
    of `now`, then for the controller's own certificate and the fleet CA in the data dir, each with what to run.
    Nothing renews them: without a word, every link fails on the day."""
    lines = []
    for agent in agents:
        if agent.certificate_expires is not None and agent.agent_id is not None:
            notice = pki.expiry_notice(agent.certificate_expires, now)
            if notice:
                lines.append(f"agent {agent.agent_id[:12]} ({agent.hostname}) certificate {notice}: join it again "
                             "with a new token (`deskfleet fleet token`, then `deskfleet-agent join TOKEN` on it)")
    controller_notice = pki.expiry_notice(files.own_identity().not_valid_after, now)
    if controller_notice:
        lines.append(f"the controller's certificate ({files.cert_path}) {controller_notice}: delete it, and the next "
                     "fleet command issues it again for the kept key (agents accept it); then restart `deskfleet "
                     "fleet serve`")
    ca_notice = pki.expiry_notice(files.ca_certificate().not_valid_after_utc, now)
    if ca_notice:
        lines.append(f"the fleet CA ({files.ca_path}) {ca_notice}: nothing renews it; before then make a new fleet "
                     "with `deskfleet fleet init --force` and join every PC to it again with a new token")
    return lines


# A PC whose clock is this far off the controller's is warned of: a certificate is valid from 5 minutes before it was
# issued (pki._CLOCK_SKEW), so one behind by more refuses the certificates of PCs that joined within the difference,
# and one ahead by more has its own refused by the others until then
CLOCK_WARNING_S = 300.0


def clock_warnings(agents: list[AgentView], now_s: float) -> list[str]:
    """A line for every agent whose reported clock (StatusReport.clock_s) is CLOCK_WARNING_S or more off `now_s`,
    the controller's clock as the list is shown (a survey takes seconds: minutes are what count)."""
    lines = []
    for agent in agents:
        clock = agent.report.clock_s if agent.report is not None else None
        if clock is None or agent.agent_id is None or abs(clock - now_s) < CLOCK_WARNING_S:
            continue
        off = abs(clock - now_s)
        amount = f"{off / 86400:.1f} days" if off >= 86400 else f"{off / 3600:.1f} h" if off >= 3600 else \
            f"{off / 60:.0f} min"
        side = "behind" if clock < now_s else "ahead of"
        lines.append(f"agent {agent.agent_id[:12]} ({agent.hostname})'s clock is {amount} {side} this controller's: "
                     "every PC judges certificates by its own clock, so links between it and PCs that joined within "
                     "that time (or the fleet, where it is ahead) are refused as not valid yet; set the wrong clock "
                     "right (NTP)")
    return lines


def links_of_no_shared_family(agents: Sequence[AgentView]) -> frozenset[tuple[str, str]]:
    """(from, to) agent ids of the PCs that answered where `from` reaches other PCs over no IP family `to` is known at
    (its StatusReport.ip_families against the addresses the survey knows of `to`): a stage on `from` could not dial a
    stage on `to` (an IPv4-only PC before one known at IPv6 addresses alone). A PC that reported no families, or is
    known at a host name or a loopback address (dialled over either family), constrains nothing. From an exploratory
    test of a mixed IPv4/IPv6 office: the first run that put such PCs next to each other spent two failovers learning
    the links, and every run that took one of them back did again."""
    dials_over = {agent.agent_id: frozenset(agent.report.ip_families) for agent in agents
                  if agent.agent_id is not None and agent.report is not None and agent.report.ip_families}
    known_at = {agent.agent_id: families for agent in agents
                if agent.agent_id is not None and agent.report is not None
                and (families := ip_families((agent.address, *agent.other_addresses))) is not None}
    return frozenset((source, target) for source, ours in dials_over.items() for target, theirs in known_at.items()
                     if source != target and not ours & theirs)


def dials_at_once() -> int:
    """MAX_DIALS_AT_ONCE, or a quarter of this process's file handles where that is fewer (macOS gives a
    shell's processes 256), at least 16."""
    try:
        import resource
    except ImportError:  # Windows: sockets are not bounded by a file handle limit there
        return MAX_DIALS_AT_ONCE
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DIALS_AT_ONCE
    return max(16, min(MAX_DIALS_AT_ONCE, soft // 4))


def _loopback_fleet(store: FleetStore) -> bool:
    """Whether agents reach this controller at loopback addresses alone (`fleet init --address 127.0.0.1:PORT`): every
    agent of such a fleet runs on this PC and registers, so an mDNS browse finds none, and it sent its queries out
    of every interface of the PC, onto the LAN."""
    try:
        addresses = fleet_addresses(store)
    except FleetStoreError:
        return False
    return bool(addresses) and all(is_loopback_address(address) for address in addresses)


NETWORK_DOWN_WAIT_S = 60.0  # how long a re-plan surveys again while no PC can be reached for this PC's network
NETWORK_DOWN_RETRY_S = 5.0


def network_down(found: Survey) -> bool:
    """Whether no PC answered and every one dialled failed for want of a route or a network: this PC's own network is
    the likely fault (its cable, its Wi-Fi), not the PCs."""
    dialled = [agent for agent in found.agents if agent.address != NO_ADDRESS]
    return bool(dialled) and not found.reachable() and \
        all(agent.problem is not None and NETWORK_DOWN_WORDS.search(agent.problem) for agent in dialled)


async def survey_through_outage(store: FleetStore, options: SurveyOptions, notify: Callable[[str], None],
                                wait_s: float = NETWORK_DOWN_WAIT_S, retry_s: float = NETWORK_DOWN_RETRY_S,
                                surveyor: Callable[[FleetStore, SurveyOptions], Awaitable[Survey]] | None = None
                                ) -> Survey:
    """`surveyor` (survey()), again every `retry_s` for up to `wait_s` while network_down: a controller whose network
    dropped for 20 s ended its run at the first re-plan ("no reachable agents: ... start `deskfleet-agent` on them"),
    with failovers to spare and every agent running; `notify` hears it once."""
    surveyor = surveyor or survey
    found = await surveyor(store, options)
    deadline = time.monotonic() + wait_s
    told = False
    while network_down(found) and time.monotonic() < deadline:
        if not told:
            told = True
            notify(f"no PC answers, each for want of a route or a network: this PC's network may be down; looking "
                   f"again every {retry_s:.0f} s for up to {wait_s:.0f} s")
        await found.close()
        await asyncio.sleep(retry_s)
        found = await surveyor(store, options)
    return found


def survey_targets(registry: Registry, enrolled: set[str], revoked: pki.RevocationSet, strangers: int = 0
                   ) -> list[tuple[str | None, tuple[str, ...], tuple[str, ...]]]:
    """(agent id or None for a manual address, the addresses to dial, the sources' names) of every agent
    worth dialling. An agent id only mDNS announced and this controller never enrolled is left out: every
    member joined through it, and anyone on the LAN can announce ids by the thousand to make a survey dial
    them all (and run out of file handles) before the real agents (the browser leaves them out before it
    resolves them: `strangers` counts those, for the warning). Each agent is dialled at no more than
    MAX_ADDRESSES_PER_AGENT addresses, those its own registration gave first."""
    targets: list[tuple[str | None, tuple[str, ...], tuple[str, ...]]] = []
    for entry in registry.entries():
        if revoked.is_revoked(entry.agent_id):
            continue
        if entry.agent_id not in enrolled and entry.sources <= {DiscoverySource.MDNS}:
            strangers += 1
            continue
        targets.append((entry.agent_id, entry.addresses[:MAX_ADDRESSES_PER_AGENT],
                        tuple(sorted(source.value for source in entry.sources))))
    if strangers:
        log.warning("ignored mDNS announcements of %d agent id(s) this controller never enrolled", strangers)
    targets += [(None, (address,), (DiscoverySource.MANUAL.value,)) for address in registry.dial_targets()]
    return targets


# Private functions

async def _run_for(sources: list[Discovery], seconds: float) -> None:
    """Run the discovery sources for `seconds` (at least one loop turn), then cancel them."""
    tasks: list[asyncio.Task[None]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(source.run()) for source in sources]
            await asyncio.sleep(seconds)
            for task in tasks:
                task.cancel()
    except* OSError as errors:  # no multicast route, for instance: discovery by other sources still works
        log.warning("mDNS browse failed: %s", errors.exceptions[0])


def _announced_only(registry: Registry, agent_id: str | None) -> frozenset[str]:
    """The addresses of `agent_id` that only an mDNS announcement gave (no registration, roster or --peer)."""
    entry = registry.get(agent_id) if agent_id is not None else None
    return frozenset(entry.addresses) - entry.authenticated if entry is not None else frozenset()


# (the address asked, its link, its report, its problem, its version): what _ask_at_any makes of an agent
_Answer = tuple[str, Link | None, StatusReport | None, str | None, PeerVersion]


async def _ask_at_any(store: FleetStore, revocations: Revocations, agent_id: str | None,
                      addresses: tuple[str, ...], dials: asyncio.Semaphore, open_timeout: float = OPEN_TIMEOUT_S,
                      announced_only: frozenset[str] = frozenset()) -> _Answer:
    """Ask the agent at `addresses`, each SURVEY_DIAL_STAGGER_S after the one before it or as soon as that one fails
    (RFC 8305's race): (the first address to answer, its link, its report, None, its version), or (the first
    address, None, None, every address's problem, its version) when none did. TLS pins the agent's id, so any answer
    is its own. Asking in turn made a stale registered address (a PC that changed IP) cost the whole open timeout
    before its live mDNS address was tried; asking at all of them at once cost a PC of both IP families, which
    registers 2-4 addresses, as many TLS handshakes at every survey, where the first (the address it reached the
    controller from) nearly always answers. The version is (the deskfleet version the agent's Hello or its refusal
    of ours named, where one did; the fleet protocol it speaks where that is not ours): `fleet ls` shows who is not
    upgraded. A problem at one of `announced_only` (an address only mDNS gave) says so: anyone on the LAN can
    announce one, and what answers there (another fleet's PC, a rogue with a certificate of its own) says nothing
    of the member, whose advice it would otherwise carry."""
    versions: dict[str, PeerVersion] = {}  # address -> what the agent there said of its version

    async def ask(address: str) -> _Answer:
        link, report, problem = await _ask(store, revocations, agent_id, address, dials, versions, open_timeout)
        return address, link, report, problem, versions.get(address, UNKNOWN_VERSION)

    waiting = list(addresses)
    tasks: list[asyncio.Future[_Answer]] = []
    running: set[asyncio.Future[_Answer]] = set()
    problems: dict[str, str] = {}
    version = UNKNOWN_VERSION
    winner: _Answer | None = None
    try:
        while winner is None and (waiting or running):
            if waiting:
                tasks.append(asyncio.ensure_future(ask(waiting.pop(0))))
                running.add(tasks[-1])
            done, running = await asyncio.wait(running, timeout=SURVEY_DIAL_STAGGER_S if waiting else None,
                                               return_when=asyncio.FIRST_COMPLETED)
            for answer in (task.result() for task in tasks if task in done):
                if answer[3] is None:
                    winner = winner or answer
                    continue
                problems[answer[0]] = str(answer[3]) if answer[0] not in announced_only else \
                    f"at {answer[0]}, an address only an mDNS announcement gave (anyone on the LAN can send one, so " \
                    f"what answers there may be no PC of this fleet): {answer[3]}"
                version = version if version != UNKNOWN_VERSION else answer[4]
    finally:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, tuple) and result[1] is not None and (winner is None or result[1] is not winner[1]):
                await result[1].close()  # another address of the same agent answered too
    if winner is not None:
        return winner
    return addresses[0], None, None, "; ".join(problems[address] for address in addresses), version


async def _ask(store: FleetStore, revocations: Revocations, agent_id: str | None, address: str,
               dials: asyncio.Semaphore, versions: dict[str, PeerVersion] | None = None,
               open_timeout: float = OPEN_TIMEOUT_S) -> tuple[Link | None, StatusReport | None, str | None]:
    """Open a link to `address`, holding one of `dials` while it opens (a link that opened is a fleet member's,
    its certificate checked: waiting for its status holds no place that a dial to another PC needs), and ask
    its status."""
    try:
        async with dials:
            # replies only (a status; a deploy's ShardHave and StageReady): a member cannot make it hold 320 MB
            link = await open_link(address, store.tls_files, expected_agent_id=agent_id, revocations=revocations,
                                   open_timeout=open_timeout, max_frame_bytes=REPLY_MAX_FRAME_BYTES)
    except LinkVersionError as error:  # listed with the version it runs, and which side to upgrade
        if versions is not None:
            versions[address] = PeerVersion(error.peer_software, error.peer_protocol, error.peer_agent_id)
        return None, None, str(error)
    except LinkError as error:
        return None, None, str(error)
    software = getattr(link, "peer_software", None)  # (a test's stand-in link has none)
    if versions is not None and software:
        versions[address] = PeerVersion(software, None, None)
    try:
        # The fleet's list of removed agents rides along: an agent that was off during a removal, or that never
        # meets `fleet serve` (which also sends it), refuses the removed agents' links from now on too.
        try:
            await link.send(revocations.update())
            await link.send(StatusRequest())
        except LinkError as error:  # refused at once: what it said before it closed names why (see _refusal_of)
            raise LinkError(await _refusal_of(link) or str(error)) from None
        taking_removals = True
        while True:
            message = await asyncio.wait_for(link.receive(), STATUS_TIMEOUT_S)
            if isinstance(message, StatusReport):
                return link, message, None
            if isinstance(message, KnownRemovals) and taking_removals:  # before its status: ones we lack
                taking_removals = await take_known_removals(store, revocations, message, link.peer.agent_id) is not None
            if isinstance(message, Error):
                raise LinkError(f"{message.code.value}: {message.message}")
    except (LinkError, TimeoutError, pki.PkiError) as error:
        with contextlib.suppress(LinkError):
            await link.close()
        return None, None, f"no status from {address}: {str(error) or 'timed out'}"
    except BaseException:  # cancelled: another address of the agent answered first (left open, it leaked)
        with contextlib.suppress(Exception):
            await link.close()
        raise


async def _refusal_of(link: Link) -> str | None:
    """What a peer that closed the link at once said first ("unauthorized: ... the fleet's controller, not an
    agent"), read from what the link received before the close; None when it said nothing. The survey's first
    send met the close, and the survey said only "closed: received 1008 (policy violation) unauthorized"."""
    try:
        message = await asyncio.wait_for(link.receive(), REFUSAL_READ_S)
    except (LinkError, TimeoutError):
        return None
    return f"{message.code.value}: {message.message}" if isinstance(message, Error) else None
