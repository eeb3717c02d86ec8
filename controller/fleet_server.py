"""`deskfleet fleet serve`: the controller's listening side.

One TLS 1.3 port (the address in the join tokens):
- a client WITHOUT a certificate gets only the join exchange (controller/fleet_ca.serve_enrollment);
- a client WITH a fleet certificate is checked against the revocation set right after the handshake,
  says Hello, then Register(listen addresses): the roster records where it listens, and the link stays
  open (websocket pings) so the controller knows it is alive; on it the agent calls in again (a Register: it can take
  stages again) and says when its addresses change (AddressesChanged: the roster's are replaced, no call-in);
- a certificate from another CA fails the TLS handshake; a revoked agent gets HTTP 403.
One serve runs per data dir: it holds the data dir's serve lock (a second one refuses, naming the first's pid).
`fleet remove` (another process) rewrites revoked.json; the watcher here notices within
REVOCATION_POLL_S, closes the removed agent's link at once and sends every other agent the new
RevocationUpdate (also sent right after each registration), so agents refuse the removed one too. An agent
answers a list that lacks removals it keeps (the data dir was restored from an older backup) with them,
signed by the CA, on its registration link: they are added to revoked.json, and the watcher acts on them.
At each registration and call-in it asks the agent for its status and tells it to release the stages that no
deployment places on it (a run re-planned without it while it slept or was off its network).
It also announces itself over mDNS (`_deskfleet-ctl._tcp.local.`, its fleet and controller id) at the addresses
it listens on, announced again when they change: an agent whose join-token address stops answering looks there
(agent/controller_search.py). Announcing is a help, not a duty: where multicast fails it is logged and serving
goes on.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from websockets.asyncio.server import ServerConnection

from deskfleet.agent.advertise import Announcement, addresses_to_advertise, advertise_while_serving, never_changes
from deskfleet.agent.link import Link, LinkError, listen_text, start_server, utc_now
from deskfleet.common import pki
from deskfleet.common.availability import CALL_IN_MIN_INTERVAL_S
from deskfleet.common.discovery_record import ControllerRecord
from deskfleet.common.log_limit import LogEvery
from deskfleet.common.open_files import log_open_files_limit, raise_open_files_limit
from deskfleet.common.wire import (
    AddressesChanged,
    Error,
    ErrorCode,
    KnownRemovals,
    Register,
    ReleaseStage,
    Role,
    StageRef,
    StatusReport,
    StatusRequest,
    parse_address,
)
from deskfleet.controller.fleet_ca import Revocations, serve_enrollment, spend_token_again, take_known_removals
from deskfleet.controller.fleet_deploy import DeployError, awaiting_take_back, undeployed_stages
from deskfleet.controller.fleet_store import UNKNOWN_HOSTNAME, FleetStore, FleetStoreError, RosterEntry
from deskfleet.controller.shared_identity import SharedIdentityWatch

log = logging.getLogger(__name__)

REVOCATION_POLL_S = 0.5
REGISTER_TIMEOUT_S = 10.0
# Registrations that arrive within this of the first not yet written share one write of agents.json: 300 agents
# that register within a second or two of a restart wrote (and fsynced) the whole roster once each, 28 MB in all,
# on the event loop that their handshakes waited for.
ROSTER_BATCH_S = 0.05
# an agent's AddressesChanged written at most this often, the newest once the time is up (agents look every
# service.ADDRESS_CHECK_S, 30 s)
ADDRESSES_CHANGED_MIN_INTERVAL_S = 15.0
REPORT_LOG_EVERY_S = 60.0  # an agent's report of one kind of failure is a warning at most this often
ANNOUNCE_REFRESH_S = 10.0  # how often the addresses announced over mDNS are compared with the PC's (as agents do)
DEPLOY_UNDER_WAY_RECHECK_S = 5.0  # how often a PC's stages are looked at again while a deploy holds the data dir
# How long a PC that a run re-planned without keeps the stage it held of that model, for the next run to take it back
# with (`serve --fleet` does within seconds): a release made that take-back load and compile the stage again
TAKE_BACK_GRACE_S = 600.0


def _log_failure(task: asyncio.Task[None]) -> None:
    """Log what ended a background task other than its cancellation (it was seen only when the task was collected)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("%s failed", task.get_name(), exc_info=error)


class ListenError(RuntimeError):
    """The server cannot listen where it was told (the port is taken, the host does not resolve): named."""


class FleetServer:
    """The controller's enrollment + registration endpoint. `run()` serves until `stop()`."""

    def __init__(self, store: FleetStore, listen: str,
                 on_change: Callable[[dict[str, tuple[str, ...]]], None] | None = None,
                 announce_at: Callable[[], Awaitable[tuple[list[str], str]]] | None = None) -> None:
        """announce_at: the addresses to announce over mDNS now (and why none); default: those of the listen
        host (every interface's for 0.0.0.0, none for loopback). Tests pass loopback's."""
        store.require_initialised()
        host, _ = parse_address(listen)
        self.store = store
        self.listen = listen
        self._announce_at = announce_at or (lambda: addresses_to_advertise(host))
        self._announcement_fixed = announce_at is None and never_changes(host)
        self.revocations = Revocations(store)
        try:  # a lost or damaged list of removed agents, or an unreadable CA key, stops the server before it serves
            self._revoked_at_start = self.revocations()
            self.revocations.update()  # signs them all now, not at the first registration
        except pki.PkiError as error:
            raise FleetStoreError(str(error)) from None
        self.live: dict[str, Link] = {}  # agent id -> its registration link
        self._live_at: dict[str, tuple[str, ...]] = {}  # agent id -> the listen addresses its live link registered
        self._heard_at: dict[str, float] = {}  # agent id -> when it last registered or called in (time.monotonic)
        self._addresses_heard_at: dict[str, float] = {}  # agent id -> its last AddressesChanged written (monotonic)
        self._registering: dict[str, Link] = {}  # agent id -> the link whose Register is being recorded
        self._changed_addresses: dict[Link, tuple[str, ...]] = {}  # a registration link -> its change to write
        self._readdressing: dict[Link, asyncio.Task[None]] = {}  # a registration link -> the writer of its changes
        self._shared_identities = SharedIdentityWatch()  # two PCs of one identity taking turns (a cloned disk)
        # (agent id, error code): a stage's failure an agent reported; (agent id, message type): a first message that
        # was not the agent's own Register
        self._reports_said = LogEvery()
        self._joins_counted: set[tuple[str, str]] = set()  # (agent id, token sha256) checked against tokens.json
        self.bound_port: int | None = None
        self._on_change = on_change
        self._stopping = asyncio.Event()
        # agent id -> (addresses, when they came), for the next write of the roster: `registered_at` is the arrival,
        # not the write, which a data dir's lock held elsewhere can delay past a run's loss of that PC
        # agent id -> (its addresses, when it registered or called in; None: its addresses changed alone)
        self._unrecorded: dict[str, tuple[tuple[str, ...], str | None]] = {}
        self._recorded: asyncio.Future[None] | None = None  # that write, done or failed
        self._next_write: asyncio.TimerHandle | None = None
        self._writes: set[asyncio.Task[None]] = set()  # roster writes under way (kept from the garbage collector)
        self._tidying: dict[Link, asyncio.Task[None]] = {}  # a registration link -> its stages' release under way
        self._asked: dict[Link, int] = {}  # registration links -> statuses asked for that have not come yet
        # (agent id, stage) -> when a grace for a take-back began (time.monotonic): a PC that calls in again and again
        # does not begin it anew each time
        self._graced: dict[tuple[str, StageRef], float] = {}
        # one look at the deploy lock at a time: looks from this process's threads took it from each other, and half of
        # 800 at once read as a deploy under way (flock holds per open file)
        self._looking = threading.Lock()

    # Public methods

    async def run(self) -> None:
        """Serve until stop(); FleetStoreError naming its pid when another serve holds this data dir."""
        with self.store.serving():
            await self._run()

    def stop(self) -> None:
        self._stopping.set()

    # Private methods

    async def _run(self) -> None:
        host, port = parse_address(self.listen)
        log_open_files_limit(raise_open_files_limit())
        try:
            server = await start_server(self._serve_agent, host, port, self.store.tls_files,
                                        revocations=self.revocations, enrollment=self._enroll)
        except OSError as error:  # EADDRINUSE: another `fleet serve`, or another program, holds the port
            raise ListenError(f"cannot listen on {self.listen} (--listen, or the port of the address given to "
                              f"`fleet init`): {error.strerror or error}") from None
        self.bound_port = server.sockets[0].getsockname()[1] if server.sockets else port
        log.info("controller listening on %s", listen_text(host, self.bound_port))
        async with server, asyncio.TaskGroup() as tasks:
            watcher = tasks.create_task(self._watch_revocations(), name="revocations")
            announcer = tasks.create_task(self._announce_forever(), name="mdns")
            await self._stopping.wait()
            watcher.cancel()
            announcer.cancel()
        if self._next_write is not None:  # registrations not written yet: now, not never
            self._next_write.cancel()
            await self._write_roster()
        for link in list(self.live.values()):
            await link.close()

    async def _announce_forever(self) -> None:
        """Announce this controller over mDNS for as long as it serves (`_announce`). Nothing here stops `fleet
        serve`: a failure no one foresaw is logged with its traceback and ends the announcement only."""
        try:
            await self._announce()
        except Exception:
            log.exception("the mDNS announcement of the controller stopped; agents still reach it at the addresses "
                          "in their tokens")

    async def _announce(self) -> None:
        """This controller's record at the addresses `announce_at` gives, for as long as it serves (advertise.py's
        loop: again whenever they change, looked at every ANNOUNCE_REFRESH_S; each state is logged once)."""
        try:
            identity = self.store.tls_files.own_identity()
            record = ControllerRecord(identity.agent_id, pki.fleet_id(self.store.tls_files.ca_certificate()))
        except Exception as error:  # a damaged credential is the links' to report; announcing just stops
            log.warning("not announcing the controller over mDNS: %s", error)
            return

        async def the_record() -> ControllerRecord:
            return record

        await advertise_while_serving(Announcement(
            port=lambda: self.bound_port, addresses=self._announce_at, fixed=self._announcement_fixed,
            record=the_record, refresh_s=lambda: ANNOUNCE_REFRESH_S, name=record.instance_name,
            doing="announcing the controller", failing="mDNS announcement of the controller", log=log,
            clash_note=": agents still reach it at the addresses they saved"))

    async def _enroll(self, connection: ServerConnection) -> None:
        await serve_enrollment(connection, self.store)

    async def _serve_agent(self, link: Link) -> None:
        if link.peer.role is not Role.AGENT:
            # a survey given the controller's own address (`--peer` of `fleet serve`) lands here: say what it is
            await link.refuse(ErrorCode.UNAUTHORIZED, "only agents register with the controller: this address is "
                                                      "the fleet's controller (`deskfleet fleet serve`), not an agent")
            return
        try:
            message = await asyncio.wait_for(link.receive(), REGISTER_TIMEOUT_S)
        except (LinkError, TimeoutError) as error:
            if isinstance(error, LinkError) and error.closed_normally:
                # an agent dials the controller's addresses at once and closes, unused, the links that lost the race:
                # after each restart of fleet serve one line said that a live agent "did not register" (exploratory)
                log.debug("agent %s closed a link before registering on it (another of its dials answered first, or "
                          "it was stopping)", link.peer.agent_id[:12])
            else:
                log.info("agent %s did not register: %s", link.peer.agent_id[:12], str(error) or "timed out")
            await link.close()
            return
        if not isinstance(message, Register) or message.agent_id != link.peer.agent_id:
            # a Register naming another agent is a member posing as it: a warning once a minute per member and kind
            what = (f"a Register as agent {message.agent_id[:12]}" if isinstance(message, Register) else
                    type(message).__name__)
            due = self._reports_said.due((link.peer.agent_id, type(message).__name__), REPORT_LOG_EVERY_S)
            log.log(logging.WARNING if due else logging.DEBUG, "refused agent %s at %s: its first message was %s, "
                    "not its own Register", link.peer.agent_id[:12], link.address, what)
            await link.refuse(ErrorCode.BAD_MESSAGE, "an agent's first message after Hello is its own Register")
            return
        agent_id = link.peer.agent_id
        try:
            removed = self.revocations().is_revoked(agent_id)
        except pki.PkiError as error:  # the list vanished since the handshake: refused like a new link
            log.error("refused agent %s: %s", agent_id[:12], error)
            await link.refuse(ErrorCode.INTERNAL, "the controller cannot read its list of removed agents")
            return
        if removed:  # since its handshake: its Register was recorded, and its link lived till the watcher looked
            log.warning("refused agent %s at %s: it was removed from the fleet", agent_id[:12], link.address)
            await link.refuse(ErrorCode.UNAUTHORIZED, "this agent was removed from the fleet")
            return
        self._registering[agent_id] = link  # its earlier link, live meanwhile, no longer speaks for it
        try:
            await self._record(agent_id, message.listen_addresses)
        except (OSError, FleetStoreError) as error:  # a full disk, a damaged roster: the agent is no less alive
            log.error("cannot record agent %s at %s in %s: %s; its link is kept, and surveys find it at the "
                      "address it registered before and by mDNS", agent_id[:12], ", ".join(message.listen_addresses),
                      self.store.data_dir / "agents.json",
                      error.strerror or error if isinstance(error, OSError) else error)
        finally:
            if self._registering.get(agent_id) is link:
                del self._registering[agent_id]
        previous = self.live.get(agent_id)
        self.live[agent_id] = link
        if previous is not None and previous is not link:
            clash = self._shared_identities.takeover(agent_id, self._live_at.get(agent_id, ()),
                                                     message.listen_addresses)
            if clash is not None:
                log.warning("%s", clash)
            await previous.close()
        self._live_at[agent_id] = message.listen_addresses
        self._heard_at[agent_id] = time.monotonic()
        log.info("agent %s registered at %s", agent_id[:12], ", ".join(message.listen_addresses))
        self._changed()
        try:
            # The list as it is now, once the link is live: a change meanwhile (another agent's restored
            # removals) reaches this agent by this message or by the watcher's, never by neither.
            try:
                await link.send(self.revocations.update())
            except pki.PkiError as error:
                log.error("refused agent %s: %s", agent_id[:12], error)
                await link.refuse(ErrorCode.INTERNAL, "the controller cannot read its list of removed agents")
                return
            except LinkError as error:
                log.info("agent %s: %s", agent_id[:12], error)
            if message.token_sha256 is not None:
                await self._count_join(agent_id, message.token_sha256)
            await self._ask_status(link)
            await self._read_registration(link)
        finally:
            for task in (self._tidying.pop(link, None), self._readdressing.pop(link, None)):
                if task is not None:
                    task.cancel()
            self._changed_addresses.pop(link, None)
            self._asked.pop(link, None)
            if self.live.get(agent_id) is link:
                del self.live[agent_id]
                self._live_at.pop(agent_id, None)
                log.info("agent %s went away", agent_id[:12])
                self._changed()

    async def _count_join(self, agent_id: str, token_sha256: str) -> None:
        """Spend again the use of the join token `agent_id` joined with where tokens.json does not count it (the
        data dir was restored from a backup older than the join): otherwise whoever else holds that token could
        join with it again. Once per agent and token in this process."""
        if (agent_id, token_sha256) in self._joins_counted:
            return
        try:
            spent = await asyncio.to_thread(spend_token_again, self.store, token_sha256, agent_id, utc_now())
        except (OSError, FleetStoreError) as error:
            log.error("cannot check the join token agent %s joined with against %s: %s", agent_id[:12],
                      self.store.data_dir / "tokens.json", error)
            return
        self._joins_counted.add((agent_id, token_sha256))
        if spent:
            log.warning("agent %s joined with a token that %s counted as unused (the data dir was restored from an "
                        "older backup?): that use is spent again", agent_id[:12], self.store.data_dir / "tokens.json")

    async def _read_registration(self, link: Link) -> None:
        """Read what a registered agent says on its registration link until it closes: the removals it kept that
        this data dir lacks (restored from an older backup), signed by the CA, are added to revoked.json, which
        the watcher then tells every agent and acts on. After one this fleet's CA did not sign, that link's are
        no longer read (checking signatures costs; a member has no business sending any). Anything else is
        only logged (an Error as a warning)."""
        taking_removals = True
        while True:
            try:
                message = await link.receive()
            except LinkError:
                return
            if isinstance(message, KnownRemovals) and taking_removals:
                taken = await take_known_removals(self.store, self.revocations, message, link.peer.agent_id)
                taking_removals = taken is not None
            elif isinstance(message, Register) and message.agent_id == link.peer.agent_id:
                await self._called_in(link, message)
            elif isinstance(message, AddressesChanged):
                self._addresses_changed(link, message)
            elif isinstance(message, StatusReport) and self._asked.get(link):  # the answer to _ask_status (one
                # a member sends unasked is not: each would read deployments.json)
                self._asked[link] -= 1
                earlier = self._tidying.pop(link, None)
                if earlier is not None:
                    earlier.cancel()
                task = asyncio.create_task(self._release_undeployed(link, message.stages), name="release-undeployed")
                task.add_done_callback(_log_failure)
                self._tidying[link] = task
            elif isinstance(message, Error):  # a stage's failure with no driver connected to hear it
                text = "".join(char if char.isprintable() else "?" for char in message.message[:500])  # no forged lines
                # once a minute per agent and code (a debug line between): any enrolled PC's Forwards to a PC hosting
                # no stage made it report each, a warning a Forward
                due = self._reports_said.due((link.peer.agent_id, message.code), REPORT_LOG_EVERY_S)
                log.log(logging.WARNING if due else logging.DEBUG, "agent %s reports: %s: %s%s",
                        link.peer.agent_id[:12], message.code.value, text,
                        " (said once a minute at most)" if due else "")
            else:
                log.debug("agent %s said %s on its registration link", link.peer.agent_id[:12], type(message).__name__)

    async def _called_in(self, link: Link, message: Register) -> None:
        """A registered agent's Register again: it can take stages again (its user resumed it, it was plugged in
        or cooled down). Recorded as a registration is (`registered_at`), so that the next fleet run takes back a
        PC that a re-plan left out meanwhile (fleet_deploy.pcs_back). An agent calls in at most once a minute
        (CallInWatch); one that calls in sooner after its last registration or call-in (a member spamming its
        link: each would rewrite agents.json, and every fleet run's start would re-plan for it) is not heard."""
        agent_id = link.peer.agent_id
        now = time.monotonic()
        if now - self._heard_at.get(agent_id, -CALL_IN_MIN_INTERVAL_S) < CALL_IN_MIN_INTERVAL_S / 2:
            log.debug("agent %s called in again within %.0f s: not heard", agent_id[:12], CALL_IN_MIN_INTERVAL_S / 2)
            return
        if not self._speaks_for(agent_id, link) or self._removed(agent_id):  # (a newer link's addresses stand)
            return
        self._heard_at[agent_id] = now
        try:
            await self._record(agent_id, message.listen_addresses)
        except (OSError, FleetStoreError) as error:
            log.error("cannot record in %s that agent %s is available again: %s", self.store.data_dir / "agents.json",
                      agent_id[:12], error.strerror or error if isinstance(error, OSError) else error)
            return
        log.info("agent %s is available again at %s", agent_id[:12], ", ".join(message.listen_addresses))
        if self.live.get(agent_id) is link:
            self._live_at[agent_id] = message.listen_addresses
        await self._ask_status(link)

    def _removed(self, agent_id: str) -> bool:
        """Whether `agent_id` was removed from the fleet (the revocation watcher drops its link at its next look), or
        the list of removed agents cannot be read (the watcher says so): nothing it says is recorded then."""
        try:
            return self.revocations().is_revoked(agent_id)
        except pki.PkiError:
            return True

    def _speaks_for(self, agent_id: str, link: Link) -> bool:
        """Whether `link` is `agent_id`'s live registration link, with no registration of a newer one being recorded:
        a call-in or an address change on a link that another is taking over (the PC registered again while its old
        link lingered, or a clone of its disk did) would write that link's addresses over the newer registration's."""
        return self.live.get(agent_id) is link and self._registering.get(agent_id, link) is link

    def _addresses_changed(self, link: Link, message: AddressesChanged) -> None:
        """A registered agent's addresses changed while its link stayed up (a rotated IPv6 address, its other
        family's address renewed): the roster's are replaced (_write_changed_addresses), which the next survey dials
        and the next deploy gives the stage before it. The newest change of a link is written, at most once every
        ADDRESSES_CHANGED_MIN_INTERVAL_S (a member spamming its link would rewrite agents.json at each): one that
        comes sooner waits, as the agent says each change once. Written beside the link's reading, which a call-in
        waiting for the data dir's lock holds up."""
        self._changed_addresses[link] = message.listen_addresses
        if link not in self._readdressing:
            task = asyncio.create_task(self._write_changed_addresses(link), name="write-changed-addresses")
            task.add_done_callback(_log_failure)
            self._readdressing[link] = task

    async def _write_changed_addresses(self, link: Link) -> None:
        """Write `link`'s changed addresses (_addresses_changed) until none is left to write. Not a call-in:
        `registered_at` stays, so no run takes the PC back for it. A change a failed write lost is said again by
        the agent's next registration; meanwhile surveys find the PC at its other addresses and by mDNS."""
        agent_id = link.peer.agent_id
        try:
            while link in self._changed_addresses:
                wait = self._addresses_heard_at.get(agent_id, -math.inf) + ADDRESSES_CHANGED_MIN_INTERVAL_S \
                    - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                addresses = self._changed_addresses.pop(link)
                was = self._live_at.get(agent_id, ())
                if not self._speaks_for(agent_id, link) or addresses == was:
                    continue
                if self._removed(agent_id):
                    return
                self._addresses_heard_at[agent_id] = time.monotonic()
                try:
                    await self._record(agent_id, addresses, registered=False)
                except (OSError, FleetStoreError) as error:
                    log.error("cannot record in %s that agent %s is now at %s: %s; surveys find it at its other "
                              "addresses and by mDNS until it registers again", self.store.data_dir / "agents.json",
                              agent_id[:12], ", ".join(addresses),
                              error.strerror or error if isinstance(error, OSError) else error)
                    continue
                log.info("agent %s's addresses changed: now at %s (was %s)", agent_id[:12], ", ".join(addresses),
                         ", ".join(was) or "none")
                if self._speaks_for(agent_id, link):
                    self._live_at[agent_id] = addresses
        finally:
            if self._readdressing.get(link) is asyncio.current_task():
                del self._readdressing[link]

    async def _ask_status(self, link: Link) -> None:
        """Ask a PC that registered or called in for its status, whose stages _release_undeployed then looks at: a PC
        back from sleep, or from a network it lost, may hold stages that a run re-planned away from it meanwhile."""
        self._asked[link] = self._asked.get(link, 0) + 1
        try:
            await link.send(StatusRequest())
        except LinkError as error:
            log.debug("agent %s: %s", link.peer.agent_id[:12], error)

    async def _release_undeployed(self, link: Link, stages: tuple[StageRef, ...]) -> None:
        """Tell the PC of `link` to release each of `stages` that no deployment in deployments.json places on it. A
        run that lost the PC (asleep, off its network) re-planned without it and could not tell it: it woke holding the
        stage's memory and cache pins, with nothing to drive it, until the next deploy of that model or the agent's
        restart (`fleet ls` listed it "not deployed"). A stage of a model whose next run is to take the PC back
        (awaiting_take_back) is kept TAKE_BACK_GRACE_S first, so that the take-back finds it built; released only if
        no deployment places it by then.

        While a deploy or a run's re-plan holds the data dir's deploy lock it may be assigning these very stages, and
        what it saves decides: they are looked at again once it is done. The lock is looked at and deployments.json
        read in one thread's call, just before the sends. A deploy or re-plan that takes the lock after that look
        sends its assignment after planning (an admin's deploy also after surveying and a shard query), so the release
        sent here arrives first in all but a narrow window: where a re-plan onto the same PCs, on links it holds open,
        overtakes it, the agent releases a stage just confirmed, and that run's next step fails over. Not closed: the
        agent cannot tell this release from a deploy's."""
        agent_id = link.peer.agent_id
        grace = True  # stages a run is to take this PC back with are kept, once
        while stages:
            waited = False
            while (found := await asyncio.to_thread(self._undeployed_now, agent_id, stages, grace)) is None:
                if not waited:
                    waited = True
                    log.info("agent %s's stages are looked at once the deploy under way from %s is done", agent_id[:12],
                             self.store.data_dir)
                await asyncio.sleep(DEPLOY_UNDER_WAY_RECHECK_S)
            stale, kept = found
            for stage in stale:
                try:
                    await link.send(ReleaseStage(stage))
                except LinkError as error:
                    log.info("agent %s keeps the stage %s[%d:%d] that no deployment places on it (cannot tell it to "
                             "release it: %s)", agent_id[:12], stage.model_id, stage.layer_start, stage.layer_end,
                             error)
                    return
                log.info("agent %s told to release %s[%d:%d]: no deployment places it there (a run re-planned "
                         "without this PC, or its model's folder was deployed again, while the PC could not be "
                         "reached)", agent_id[:12], stage.model_id, stage.layer_start, stage.layer_end)
            for key in [key for key in self._graced if key[0] == agent_id and key[1] not in kept]:
                del self._graced[key]  # placed again, or released
            if kept:
                now = time.monotonic()
                began = min(self._graced.setdefault((agent_id, stage), now) for stage in kept)
                log.info("agent %s keeps %s for %.0f minutes more: the next run of its model takes this PC back, and "
                         "finds it built", agent_id[:12], ", ".join(f"{stage.model_id}[{stage.layer_start}:"
                                                                    f"{stage.layer_end}]" for stage in kept),
                         max(0.0, began + TAKE_BACK_GRACE_S - now) / 60)
                await asyncio.sleep(max(0.0, began + TAKE_BACK_GRACE_S - now))
            stages, grace = kept, False

    def _undeployed_now(self, agent_id: str, stages: tuple[StageRef, ...], grace: bool
                        ) -> tuple[list[StageRef], tuple[StageRef, ...]] | None:
        """Of `stages`, (those no deployment places on `agent_id`, those of them a run is to take it back with
        (awaiting_take_back), kept where `grace`); None while a deploy is under way. Where deployments.json cannot be
        read, none (logged: `fleet ls` says so too)."""
        with self._looking:
            under_way = self.store.deploy_under_way()
        if under_way:
            return None
        try:
            stale = undeployed_stages(self.store, {agent_id: stages}).get(agent_id, [])
            pending = awaiting_take_back(self.store, agent_id) if stale and grace else frozenset()
        except (DeployError, FleetStoreError, OSError) as error:
            log.warning("cannot tell whether agent %s's stages are deployed: %s", agent_id[:12], error)
            return [], ()
        return ([stage for stage in stale if stage.model_id not in pending],
                tuple(stage for stage in stale if stage.model_id in pending))

    async def _record(self, agent_id: str, addresses: tuple[str, ...], registered: bool = True) -> None:
        """Record in the roster where the agent listens, and, where it `registered` (or called in), when
        (`registered_at`, which the runs read as the PC able to take stages again); returns once agents.json says
        so, or raises what the write raised (OSError, FleetStoreError). The registrations of ROSTER_BATCH_S share
        one write: an address change in the same batch as the agent's registration keeps the registration's time."""
        pending = self._unrecorded.get(agent_id)
        came_at = utc_now().isoformat() if registered else None if pending is None else pending[1]
        self._unrecorded[agent_id] = (addresses, came_at)
        if self._recorded is None:
            loop = asyncio.get_running_loop()
            self._recorded = loop.create_future()
            self._next_write = loop.call_later(ROSTER_BATCH_S, self._start_write)
        await asyncio.shield(self._recorded)  # one registration's link closing cancels no other's

    def _start_write(self) -> None:
        task = asyncio.get_running_loop().create_task(self._write_roster(), name="write-roster")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_roster(self) -> None:
        """Write the registrations gathered so far, in a thread: the data dir's lock is a blocking file lock,
        and a `fleet token` or `fleet remove` suspended (Ctrl-Z) while it held it stalled this event loop, and
        with it every agent's link and ping."""
        unrecorded, self._unrecorded = self._unrecorded, {}
        recorded, self._recorded, self._next_write = self._recorded, None, None
        try:
            await asyncio.to_thread(self._save_addresses, unrecorded)
        except (OSError, FleetStoreError) as error:
            if recorded is not None:
                recorded.set_exception(error)
                recorded.exception()  # each registration waiting logs it; none waiting (all gone) is no fault
        else:
            if recorded is not None:
                recorded.set_result(None)

    def _save_addresses(self, unrecorded: dict[str, tuple[tuple[str, ...], str | None]]) -> None:
        with self.store.locked():  # the lock `fleet remove` takes: a removal is either seen here or comes after
            roster = self.store.roster()
            try:
                revoked: pki.RevocationSet | None = self.revocations()
            except pki.PkiError:  # the watcher says so, and refuses new links meanwhile
                revoked = None
            # every call-in is recorded later than every time on record, whatever the clock did (FleetStore.stamp):
            # the files are read once a batch (they do not change under the lock)
            after = self.store.stamp(datetime.datetime.min.replace(tzinfo=datetime.UTC))
            for agent_id, (addresses, came_at) in unrecorded.items():
                if revoked is not None and revoked.is_revoked(agent_id):  # removed since it registered
                    continue
                entry = roster.get(agent_id)
                if entry is None:  # its certificate is the fleet's: the roster lost it, or never had it
                    log.warning("agent %s %s, but %s does not list it: the data dir was restored from an older backup "
                                "made before it joined, or the file was lost; it is listed from now on with host '?' "
                                "(join it again to name it)", agent_id[:12],
                                "registered" if came_at is not None else "said its addresses changed",
                                self.store.data_dir / "agents.json")
                    entry = RosterEntry(agent_id, UNKNOWN_HOSTNAME, came_at or utc_now().isoformat())
                if came_at is None:  # its addresses changed: no call-in, so no run takes it back for this
                    roster[agent_id] = replace(entry, addresses=addresses)
                    continue
                stamped = max(datetime.datetime.fromisoformat(came_at), after).isoformat()
                roster[agent_id] = replace(entry, addresses=addresses, registered_at=stamped)
            self.store.save_roster(roster)

    async def _watch_revocations(self) -> None:
        told = self._revoked_at_start  # what registering agents were told; the file may have changed since
        unreadable: str | None = None
        unsigned: str | None = None
        while True:
            try:
                revoked = self.revocations()
            except pki.PkiError as error:
                # Lost or damaged: the agents keep what they were told, new links are refused (start_server
                # asks the same source), and nothing is sent until the file reads again.
                if str(error) != unreadable:
                    log.error("%s; refusing new agent links until it is fixed", error)
                    unreadable = str(error)
                await asyncio.sleep(REVOCATION_POLL_S)
                continue
            if unreadable is not None:
                log.warning("the fleet's list of removed agents reads again")
                unreadable = None
            if revoked != told:
                try:
                    update = self.revocations.update()
                except pki.PkiError as error:  # the CA key is unreadable: told again once it reads
                    if str(error) != unsigned:
                        log.error("%s; the agents are not told of the change until it reads", error)
                        unsigned = str(error)
                else:
                    told, unsigned = revoked, None
                    for link in list(self.live.values()):
                        if not revoked.is_revoked(link.peer.agent_id):
                            try:
                                await link.send(update)
                            except LinkError as error:
                                log.info("%s", error)
            for agent_id, link in list(self.live.items()):
                if revoked.is_revoked(agent_id):
                    log.warning("agent %s was removed from the fleet: dropping its link", agent_id[:12])
                    await link.refuse(ErrorCode.UNAUTHORIZED, "this agent was removed from the fleet")
                    self.live.pop(agent_id, None)
                    self._live_at.pop(agent_id, None)
                    self._changed()
            await asyncio.sleep(REVOCATION_POLL_S)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change({agent_id: (link.address,) for agent_id, link in self.live.items()})
