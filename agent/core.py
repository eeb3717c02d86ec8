"""The agent core: what one enrolled PC does with the messages its fleet links carry.

One `AgentCore` per process. Every link (from the controller, from the previous stage's agent, and the
agent's own registration link to the controller) is served by `serve_link`, which reads messages in
order and acts on them:
- StatusRequest -> StatusReport (monitor reading + availability + hosted stages + cache use);
- ShardQuery -> ShardHave; ShardChunk / ShardComplete -> the shard cache (a bad shard -> Error);
- AssignStage -> materialize the stage's files from the cache, build and compile the Stage in a worker
  thread, StageReady; ReleaseStage -> drop it;
- Forward -> the stage's executor in a worker thread (KV mirror deltas, one infer call), then the
  hidden states go to the next hop over an agent-to-agent link, or the ForwardResult to the controller;
- ReleaseMicroBatch -> free that micro-batch's KV state, then relay it to the next hop (it travels
  the chain behind the micro-batch's last Forward);
- ResultsHere -> this controller link receives the ForwardResults of the micro-batch ids it names (the
  driver's return path; several drivers may run on one deployment, each in its own id range);
- RevocationUpdate -> links from removed agents are dropped, and their Forwards refused.
Only a peer with the controller role may command; an agent peer (the previous stage) may only send
Forward, ReleaseMicroBatch and Error. A stage failure travels DOWN the chain as an Error (relayed by
every later stage) to the driver's results link, naming the agent and the stage that failed.

Steps are taken only from a stage's rightful previous hop (AssignStage.previous_agent_id; the controller for
a first stage): any enrolled PC can open a link here, and one that is not the previous hop has its Forward,
ReleaseMicroBatch and Error refused with Error(UNAUTHORIZED), answered to it alone and logged once, so the
rightful chain's KV state and its driver never hear of it. A relayed Error's blame (Error.agent_id) is checked
per hop too (_checked_blame).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TypeVar

from cryptography import x509

from deskfleet.agent.advertise import dialable_here, lan_sources
from deskfleet.agent.cache_health import UNWRITABLE_ERRNOS, CacheHealth
from deskfleet.agent.kv_memory_guard import KvMemoryGuard, KvMemoryRefused
from deskfleet.agent.link import Link, LinkError, TlsFiles, open_first, open_link
from deskfleet.agent.monitor import SystemMonitor, available_memory_reader
from deskfleet.agent.opt_out import OPT_OUT_FILE, OptOutReader
from deskfleet.agent.paths import AgentSettings
from deskfleet.agent.shard_cache import CacheFull, ShardCache, ShardCacheError
from deskfleet.agent.speed_probe import SpeedMeasurement
from deskfleet.agent.stage import CompileSettings, LayerRange, Stage
from deskfleet.agent.stage import Precision as StagePrecision
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.agent.status import AgentStatus, PauseSource, make_status
from deskfleet.common import pki
from deskfleet.common.agent_state import AgentState
from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.availability import (
    AvailabilityPolicy,
    CallInWatch,
    MonitorReading,
    StageReleaseWatch,
    decide_availability,
)
from deskfleet.common.json_file import JsonFileError, read_json_object
from deskfleet.common.kv_cache_size import kv_cache_bytes_per_token_per_layer, kv_cache_precision
from deskfleet.common.kv_ledger import Compact, LedgerError
from deskfleet.common.log_limit import LogEvery
from deskfleet.common.model_spec import MANIFEST_NAME, ExportMismatchError, Manifest, ManifestError, ModelSpec
from deskfleet.common.prefill_scratch import layer_width, prefill_scratch_per_token
from deskfleet.common.wire import (
    MAX_KNOWN_REMOVALS,
    MICRO_BATCH_IDLE_S,
    REMOVAL_SIGNATURE_BYTES,
    AssignStage,
    Error,
    ErrorCode,
    Forward,
    ForwardResult,
    KnownRemovals,
    ManifestEntry,
    Message,
    NextHop,
    Precision,
    ProtocolError,
    ReleaseMicroBatch,
    ReleaseStage,
    ResultsHere,
    RevocationUpdate,
    Role,
    ShardChunk,
    ShardComplete,
    ShardQuery,
    StageReady,
    StageRef,
    StatusReport,
    StatusRequest,
    is_agent_id,
)
from deskfleet.common.wire_messages import check_devices

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# A stage key keeps this much of a longer model id, then a digest of all of it (see _stage_key)
_STAGE_KEY_NAME_CHARS = 80
_UNSAFE_IN_KEY = re.compile(r"[^A-Za-z0-9._-]")
_REMOVAL_SIGNATURE_HEX = re.compile(r"[0-9a-f]{128}")  # a removal's signature as revoked.json keeps it
# Rows x new tokens of the largest step that runs on the event loop's thread (runs_inline): 8 rows verifying
# 7 draft tokens each, or 64 rows of plain decoding.
INLINE_STEP_TOKENS = 64
# A send to the next hop that makes no progress for this long gives the hop up as unreachable: a firewall that cut an
# established link mid-run left the sends waiting for a peer that acknowledged nothing (websockets' keepalive waits
# on the same full buffer), the run stalled 6 minutes and failed without naming the link. A step's hidden states
# (a long prompt's, tens of MB) cross a LAN in a few seconds.
HOP_SEND_TIMEOUT_S = 30.0
# A next hop found unreachable is not dialled again for this long (or until a stage is assigned anew): every queued
# step dialled it anew (two 10 s dials each), so the new chain's step waited behind the old chain's for minutes
# before its Error reached the driver.
HOP_RETRY_AFTER_S = 3.0
# How long a stage holding no micro-batch runs no step before the memory of its calls is given back (trim_idle_stages)
STAGE_TRIM_IDLE_S = 60.0
# How long a re-assigned stage's open link to its next hop gets to answer a ping before it is dropped and dialled anew
NEXT_HOP_CHECK_S = 2.0
# A next hop of several addresses is dialled at the next one this long after the one before it stays silent (RFC
# 8305 gives 250 ms between a name's addresses)
NEXT_HOP_DIAL_STAGGER_S = 0.25
# How long a stopping agent waits for its next hops' watchers once their links are closed (each ends at once as its
# link closes; the link's close handshake takes up to its close timeout) before it cancels them
HOP_WATCHERS_CLOSE_S = 5.0
# A step from an agent that failed or was refused is a warning at most this often per sending PC and error code
# (a debug line between); the driver hears each one
CHAIN_FAULT_LOG_EVERY_S = 60.0
# A status waits this long for the agent's first speed probe, then answers without a speed (an unmeasured PC plans as
# the slowest one measured), and the next status has it: a survey gives up on a status after 5 s
# (controller/fleet_survey.STATUS_TIMEOUT_S), and the probe took 29 s on a loaded PC, which `fleet plan` then
# listed as unreachable.
SPEED_PROBE_WAIT_S = 3.0


class CommandError(Exception):
    """A command cannot be carried out; answered to the sender as Error(code, message), naming the agent at
    fault where the driver must leave it out (`agent_id`: an unreachable next hop, or this agent once it gave
    its stages up)."""

    def __init__(self, code: ErrorCode, message: str, agent_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.agent_id = agent_id


class NotPreviousHop(CommandError):
    """A step or relayed Error from a peer that is not the stage's previous hop. Answered to that peer alone,
    never down the chain (a stranger must not reach the driver, nor break its chain); `close_link` when the
    peer is the previous hop of none of this agent's stages. `about` keys the log-once record."""

    def __init__(self, message: str, about: str, close_link: bool) -> None:
        super().__init__(ErrorCode.UNAUTHORIZED, message)
        self.about = about
        self.close_link = close_link


@dataclass(frozen=True)
class HostedStage:
    assignment: AssignStage
    executor: StageExecutor
    lock: asyncio.Lock  # one infer at a time per stage: the executor is not thread-safe
    cache_key: str  # the shard cache's pin owner and view name of this stage's files


class AgentCore:
    """The agent's state and message handling; owns no sockets of its own except next-hop links."""

    def __init__(self, files: TlsFiles, settings: AgentSettings, cache: ShardCache,
                 monitor: SystemMonitor, num_threads: int | None = None,
                 speed_probe: Callable[[], SpeedMeasurement] | None = None,
                 revocations_file: Path | None = None, opt_out_dir: Path | None = None,
                 device_probe: Callable[[], tuple[str, ...]] | None = None) -> None:
        self.files = files
        self._speed_probe = speed_probe  # run once, off the event loop, at the first status request
        self._speed: SpeedMeasurement | None = None
        self._speed_measuring: asyncio.Future[SpeedMeasurement] | None = None  # the probe, running
        self._device_probe = device_probe  # the devices OpenVINO finds: asked once, like the speed
        self._devices: tuple[str, ...] = ()
        self._device_probe_lock = asyncio.Lock()
        self.num_threads = num_threads  # inference threads per stage; None: the device's default
        self.settings = settings
        self.cache = cache
        self.cache_health = CacheHealth(cache)  # a disk that refused the cache's writes, in the status until it passes
        self.monitor = monitor
        # every stage's KV cache growth is asked of it first: no step may take the PC's last memory
        self.kv_memory = KvMemoryGuard(available_memory_reader(monitor))
        self.agent_id = files.own_identity().agent_id
        self.stages: dict[StageRef, HostedStage] = {}
        self.last_error: str | None = None
        self._controller_links: list[Link] = []
        self._registration_links: set[Link] = set()  # this agent's own links to `fleet serve`: never a driver
        self._results_links: dict[Link, ResultsHere] = {}  # each driver's return path, the latest last
        # (link, shard) whose chunk was refused: the chunks already on their way after it are dropped unanswered
        self._refused_streams: set[tuple[Link, str]] = set()
        self._links: set[Link] = set()  # every link being served
        self._memory_releases: set[asyncio.Task[None]] = set()  # released stages waiting for their step to end
        # every removal the controllers told of, kept across restarts (a restarted agent refuses them even while
        # the controller is out of reach), with the CA's signature of each (none for a list saved before
        # signatures), given back to a controller that lacks them (a data dir restored from an older backup)
        self._revocations_file = revocations_file
        self._revoked, self._removal_signatures, self._revocations_unknown = _load_revocations(
            revocations_file, files.ca_certificate())
        self._next_hops: dict[str, Link] = {}
        # the IP versions this PC reaches other PCs over (StatusReport.ip_families): the service's looks towards the
        # controller's addresses first (advertise.lan_sources)
        self.dial_families: Callable[[], tuple[int, ...]] = lambda: tuple(sorted(lan_sources()))
        self._closing = asyncio.Event()  # close() began: no next hop is dialled or waited on any more
        # next hops found unreachable: agent id -> (time.monotonic(), the error said), not dialled again for a while
        self._unreachable_hops: dict[str, tuple[float, str]] = {}
        self._hop_watchers: set[asyncio.Task[None]] = set()  # one reader on each next-hop link (_watch_next_hop)
        self._assign_lock = asyncio.Lock()
        self._shard_writers: dict[str, Link] = {}  # shard being received -> the link sending it
        self._release_watch = StageReleaseWatch()
        self._monitor_lock = asyncio.Lock()  # the monitor is read from one thread at a time (agent/monitor.py)
        self._opt_out = OptOutReader(opt_out_dir)  # the employee's pause (agent/opt_out.py); None: never paused
        # when to tell the controller this PC can take stages again (the service says it on its registration link)
        self.call_in = CallInWatch()
        self._released_because: str | None = None  # why the stages were given up, until the next assignment
        self._released_for_good = False  # given up as this PC was removed from the fleet: the reason never passes
        # the controller link whose AssignStage made or last confirmed each hosted stage, and the stages each open
        # controller link assigned: a ReleaseStage that undoes a link's own assignment after another link assigned
        # the stage again is stale (_superseded_release)
        self._assigned_by: dict[StageRef, Link] = {}
        self._assigned_over: dict[Link, set[StageRef]] = {}
        self._refusals_logged: set[tuple[str, str]] = set()  # (peer, what) refused and logged since the last assign
        self._chain_faults_said = LogEvery()  # (peer, error code): a step from an agent that failed or was refused

    # Public methods

    def takes_large_frames(self, peer: pki.PeerIdentity) -> bool:
        """Whether a link from `peer` may carry frames past link.SMALL_FRAME_BYTES (start_server's `large_frames`):
        the controller's (shards, a first stage's prompts) and a hosted stage's previous hop's (hidden states).
        Another enrolled PC's steps are refused whatever their size, so it sends nothing large that is read."""
        return peer.role is Role.CONTROLLER or any(
            peer.role is Role.AGENT and hosted.assignment.previous_agent_id == peer.agent_id
            for hosted in self.stages.values())

    def revocations(self) -> pki.RevocationSet:
        """The removed agents the controller told us about (a `link.RevocationSource`)."""
        return self._revoked

    async def serve_link(self, link: Link, registration: bool = False) -> None:
        """Read and act on `link`'s messages until it closes. Never raises for the peer's faults.

        `registration`: the link is this agent's registration with `fleet serve` (agent/service.py), which runs
        no chain, so errors about steps go there only when no other controller link is open."""
        if link.peer.role is Role.AGENT and self._revocations_unknown is not None:
            self._note_error(f"refused {link.describe()}: {self._revocations_unknown}")
            await link.refuse(ErrorCode.UNAUTHORIZED, f"agent {self.agent_id[:12]} refuses agents until the "
                                                      "controller sends its list of removed agents")
            return
        if link.peer.role is Role.CONTROLLER:
            self._controller_links.append(link)
            if registration:
                self._registration_links.add(link)
        if not registration and self.takes_large_frames(link.peer):  # a stage assigned since its Hello was read
            link.take_large_frames()
        self._links.add(link)
        try:
            while True:
                try:
                    message = await link.receive()
                except LinkError as error:
                    # a driver's link closed at the end of its run: every run's, two thirds of an agent's log lines
                    log.log(logging.DEBUG if error.closed_normally else logging.INFO, "%s", error)
                    return
                if self._revoked.is_revoked(link.peer.agent_id):
                    self._note_error(f"refused {type(message).__name__} from removed {link.describe()}")
                    await link.refuse(ErrorCode.UNAUTHORIZED, "this agent was removed from the fleet")
                    return
                if link in self._controller_links:  # results go to the controller that spoke last
                    self._controller_links.remove(link)
                    self._controller_links.append(link)
                try:
                    reply = await self.handle(link, message)
                except NotPreviousHop as refusal:
                    if not await self._refuse_sender(link, message, refusal):
                        return
                    continue
                except Exception as error:  # a refusal (CommandError), or a fault of ours: answer, keep serving
                    if not isinstance(error, CommandError):
                        log.exception("%s from %s failed", type(message).__name__, link.describe())
                    chain_step = message if isinstance(message, Forward | ReleaseMicroBatch) else None
                    refused = link.peer.role is Role.AGENT and chain_step is None and not isinstance(message, Error)
                    said = (link.peer.agent_id, type(message).__name__)
                    code = error.code if isinstance(error, CommandError) else ErrorCode.INTERNAL
                    text = f"{type(message).__name__} from {link.describe()}: {error}"
                    if refused:  # a PC refused so again and again is logged once: walk's rogue PC wrote 1,344 lines
                        if said not in self._refusals_logged:  # in 24 s
                            self._note_error(text)
                        self._refusals_logged.add(said)
                    elif link.peer.role is Role.AGENT and chain_step is not None:
                        # a step an agent sent is answered (down the chain) each time, and logged as a warning once
                        # a minute per PC and fault: any enrolled PC's Forwards to a PC hosting no stage wrote a
                        # warning each, here and in `fleet serve`'s log
                        due = self._chain_faults_said.due((link.peer.agent_id, code), CHAIN_FAULT_LOG_EVERY_S)
                        self._note_error(text, logging.WARNING if due else logging.DEBUG)
                    else:
                        self._note_error(text)
                    reply = Error(code, f"agent {self.agent_id[:12]}: {error}",
                                  micro_batch_id=chain_step.micro_batch_id if chain_step is not None else None,
                                  agent_id=error.agent_id if isinstance(error, CommandError) else None)
                    if refused:
                        # what no previous hop sends (a StatusRequest, an AssignStage...; it relays Errors): refused
                        # to the sender alone. Sent down the chain, it named no micro-batch and so broke every
                        # driver's run: any enrolled PC could end every generation through this one, again after
                        # each re-plan.
                        await link.refuse(code, reply.message)
                        return
                    if link.peer.role is Role.AGENT:  # the previous stage reads nothing back: tell the driver
                        await self._send_down(reply)
                        reply = None
                if reply is not None:
                    try:
                        await link.send(reply)
                    except LinkError as error:
                        # what the peer sent before it closed is still read (the next receive ends the loop once
                        # none is left): a deploy stopped by Ctrl-C while this agent compiled its stage closed the
                        # link after asking it to release that stage, and the stage stayed, unused, as the release
                        # was never read
                        log.info("%s", error)
        finally:
            self.cache.unpin(_deploy_pin(link))
            self._links.discard(link)
            for sha256 in [sha256 for sha256, writer in self._shard_writers.items() if writer is link]:
                del self._shard_writers[sha256]  # a later deploy resumes the shard from what arrived
            self._refused_streams = {(writer, sha256) for writer, sha256 in self._refused_streams if writer is not link}
            if link in self._controller_links:
                self._controller_links.remove(link)
            self._assigned_over.pop(link, None)
            for ref in [ref for ref, by in self._assigned_by.items() if by is link]:
                del self._assigned_by[ref]
            self._registration_links.discard(link)
            self._results_links.pop(link, None)

    async def handle(self, link: Link, message: Message) -> Message | None:
        """Act on one message; return the reply (if any). CommandError for a refusal."""
        if isinstance(message, Forward):
            await self._forward(link, message)
            return None
        if isinstance(message, ReleaseMicroBatch):
            await self._release_micro_batch(link, message)
            return None
        if isinstance(message, Error) and link.peer.role is Role.AGENT:
            fed = self._fed_by(link, message)  # a failure upstream: on to the driver, from the previous hop only
            await self._send_down(self._checked_blame(link, message, fed), fed[0] if len(fed) == 1 else None)
            return None
        if link.peer.role is not Role.CONTROLLER:
            raise CommandError(ErrorCode.UNAUTHORIZED, f"only the controller may send {type(message).__name__}; "
                               "agents send Forward, ReleaseMicroBatch and Error")
        if isinstance(message, ResultsHere):
            self._results_links.pop(link, None)  # said again: its range now, and the latest
            for other, claimed in self._results_links.items():
                if claimed.holds(message.first_micro_batch_id) or message.holds(claimed.first_micro_batch_id):
                    log.warning("%s and %s drive one range of micro-batch ids (one in 8 million): their results "
                                "may cross; run one of them again", link.describe(), other.describe())
            self._results_links[link] = message
            return None
        if isinstance(message, RevocationUpdate):
            await self._revoke(message)
            await self._tell_known_removals(link, message)
            return None
        if isinstance(message, StatusRequest):
            return await self.status()
        if isinstance(message, ShardQuery):  # a deploy's new round: it sends from what the answer says is held
            self._refused_streams = {(writer, sha256) for writer, sha256 in self._refused_streams if writer is not link}
            if message.sizes:  # a deploy's stage: keep all of it until assigned, or refuse it whole now
                try:
                    self.cache.reserve(_deploy_pin(link), dict(zip(message.sha256s, message.sizes, strict=True)))
                except CacheFull as error:
                    raise _cache_limit_refusal(error) from None
            return self.cache.have(message.sha256s)
        if isinstance(message, ShardChunk):
            self._receive_chunk(link, message)
            return None
        if isinstance(message, ShardComplete):
            if (link, message.sha256) in self._refused_streams:  # its refusal was the answer
                self._refused_streams.discard((link, message.sha256))
                return None
            self._check_shard_writer(link, message.sha256)
            self._shard_writers.pop(message.sha256, None)
            try:
                await asyncio.to_thread(self.cache.complete, message.sha256)
            except ShardCacheError as error:
                raise CommandError(ErrorCode.SHARD_MISMATCH, str(error)) from None
            return None
        if isinstance(message, AssignStage):
            try:
                ready = await self._assign(message)
            finally:
                self.cache.unpin(_deploy_pin(link))  # the stage pins its own files now, or failed
                await self.close_unused_next_hops()  # a re-plan may have given this stage another next hop
            self._assigned_by[message.stage] = link
            self._assigned_over.setdefault(link, set()).add(message.stage)
            return ready
        if isinstance(message, ReleaseStage):
            if self._superseded_release(link, message.stage):
                log.info("kept %s: %s asked to release the stage it had assigned, but another deploy has assigned it "
                         "again since", _stage_key(message.stage), link.describe())
                return None
            self._release(message.stage)
            await self.close_unused_next_hops()
            return None
        if isinstance(message, Error):
            log.warning("%s reported %s: %s", link.describe(), message.code.value, message.message)
            return None
        raise CommandError(ErrorCode.BAD_MESSAGE, f"an agent does not act on {type(message).__name__}")

    async def local_status(self) -> AgentStatus:
        """This PC's status now, as the tray shows it (status_file.py) and `status` reports it."""
        reading = await self._read_monitor()
        policy = self.policy()
        snapshot = make_status(reading, policy, tuple(self.stages), self.cache.usage(), self.last_error, time.time())
        # who paused it, first: the admin's `fleet ls` and plan tell a user's opt-out from theirs; then a disk that
        # refused the shard cache's writes, then the limits' numbers (the wire keeps MAX_STATUS_DETAIL characters:
        # what is cut is the end, and the numbers are what the reasons also say)
        parts = (f"paused {self.paused_by()}" if policy.paused else "", self.cache_health.note(), snapshot.detail)
        return replace(snapshot, detail="; ".join(part for part in parts if part))

    async def status(self) -> StatusReport:
        snapshot = await self.local_status()
        if self._speed is None and self._speed_probe is not None:
            if self._speed_measuring is None:
                self._speed_measuring = asyncio.ensure_future(asyncio.to_thread(self._speed_probe))
            try:
                self._speed = await asyncio.wait_for(asyncio.shield(self._speed_measuring), SPEED_PROBE_WAIT_S)
            except TimeoutError:  # still measuring: this status goes without a speed, the next one has it
                pass
            except (RuntimeError, OSError) as error:  # an unusable device: report no speed, say why
                self._speed_probe = None
                self._note_error(f"speed probe failed: {error}")
            except Exception as error:  # anything else (short of memory a moment): the next status measures again
                self._speed_measuring = None
                self._note_error(f"speed probe failed, to be tried again: {error!r}")
        speed = self._speed.weight_gb_per_s if self._speed is not None else None
        # a plan that asked now leaves it out (a stage's own inference crossing the limits leaves it where it is)
        if snapshot.state is AgentState.PAUSED or (snapshot.state is AgentState.UNAVAILABLE and not self.stages):
            self.call_in.went_away()
        return replace(snapshot.to_wire(), weight_gb_per_s=speed, devices=await self._reported_devices(),
                       shard_room_bytes=self.cache.room_for_new_bytes(), clock_s=time.time(),
                       ip_families=self.dial_families())

    async def _reported_devices(self) -> tuple[str, ...]:
        """The devices OpenVINO finds, asked once (off the event loop); () when the probe failed or listed names
        the wire cannot carry: reported as not known, which no plan leaves out. A status asked for while the
        probe runs (the mDNS record's, a survey's, at start) waits for it: it was reported as () and a plan
        for a device the PC lacks did not leave it out."""
        async with self._device_probe_lock:
            if self._device_probe is not None:
                probe, self._device_probe = self._device_probe, None
                try:
                    devices = tuple(await asyncio.to_thread(probe))
                    check_devices(devices)
                    self._devices = devices
                except (RuntimeError, OSError, ValueError) as error:  # ProtocolError is a ValueError
                    self._note_error(f"cannot list the OpenVINO devices: {error}")
        return self._devices

    async def _read_monitor(self) -> MonitorReading:
        """One monitor reading, in a worker thread, one at a time: a status request that came while the limits
        check read (the mDNS refresh, a survey) read it in a second thread at once, against the monitor's
        contract (its GPU samplers keep the last reading to make a rate; a Windows PDH query is not shared
        between threads)."""
        async with self._monitor_lock:
            return await asyncio.to_thread(self.monitor.read)

    def policy(self) -> AvailabilityPolicy:
        """The admin's settings, paused also where the employee paused this PC (`deskfleet-agent pause`)."""
        policy = self.settings.policy()
        return policy if policy.paused or not self._opt_out.read().paused else replace(policy, paused=True)

    async def enforce_limits(self, now: float | None = None) -> tuple[StageRef, ...]:
        """Give every hosted stage up once the PC has been on battery or too hot for the employee's
        `release_stages_after_s` (common/availability.py, StageReleaseWatch); returns the stages given up.

        The next step sent to one is refused as not assigned, naming this agent and why, so the controller
        re-plans without it and the generation goes on from its history (controller/fleet_failover.py); the
        agent reports itself unavailable meanwhile, so no plan takes it until the limit clears."""
        if not self.stages:  # nothing to give up, and no sensor to read
            self._release_watch.reset()
            return ()
        policy = self.policy()
        if policy.paused:  # the PC's user wants it back: at once, not after release_stages_after_s
            return await self.give_up_stages(f"paused {self.paused_by()}")
        reading = await self._read_monitor()
        availability = decide_availability(reading, policy, serving=bool(self.stages))
        because = self._release_watch.update(availability, policy, bool(self.stages),
                                             time.monotonic() if now is None else now)
        if because is None:
            return ()
        return await self.give_up_stages(because)

    async def give_up_stages(self, because: str, for_good: bool = False) -> tuple[StageRef, ...]:
        """Release every hosted stage (a step under way finishes first), say why in the error the next step gets
        and in `last_error`; returns what was released. `for_good` (this PC was removed from the fleet): the reason
        never passes, so every later step hears it (it passed at once, no limit being crossed, and the driver read
        "this agent hosts no stage")."""
        self._released_for_good = self._released_for_good or for_good
        released = tuple(self.stages)
        for ref in released:
            hosted = self.stages.get(ref)
            if hosted is not None:
                async with hosted.lock:  # a step under way finishes first
                    self._release(ref)
        self._released_because = because
        self.call_in.went_away()
        which = f" ({', '.join(_stage_key(ref) for ref in released)})" if released else ""
        self._note_error(f"gave up {len(released)} stage(s){which}: {because}")
        await self.close_unused_next_hops()
        return released

    async def close_unused_next_hops(self) -> list[str]:
        """Close the links to next hops that no hosted stage sends to any more (its stage was released, given
        up, or re-planned onto another next hop); returns their agent ids. They stayed open, with their pings
        every few seconds on both PCs, for as long as both agents ran: one for every agent this PC ever fed."""
        wanted = {hosted.assignment.next_hop.agent_id for hosted in self.stages.values()
                  if hosted.assignment.next_hop is not None}
        unused = [agent_id for agent_id in self._next_hops if agent_id not in wanted]
        for agent_id in unused:
            link = self._next_hops.pop(agent_id)
            try:
                await link.close()
            except Exception as error:  # a link that is gone already closes nothing
                log.debug("closing the link to former next hop %s: %s", agent_id[:12], error)
        if unused:
            log.debug("closed the links to %d former next hop(s)", len(unused))
        return unused

    async def trim_idle_stages(self, min_idle_s: float = STAGE_TRIM_IDLE_S) -> int:
        """Give back the call buffers of every hosted stage that holds no micro-batch and ran no step for
        `min_idle_s` (StageExecutor.trim_if_idle), each under its lock, in a worker thread; returns how many."""
        trimmed = 0
        for hosted in list(self.stages.values()):
            if not isinstance(hosted.executor, StageExecutor):  # a stage entered by hand (tests)
                continue
            async with hosted.lock:
                if self.stages.get(hosted.assignment.stage) is not hosted:  # released, or rebuilt, meanwhile
                    continue
                try:
                    done = await asyncio.to_thread(hosted.executor.trim_if_idle, min_idle_s)
                except Exception:  # the plugin's: the stage serves on as it was, and the others are still trimmed
                    log.warning("could not give back the call buffers of %s", _stage_key(hosted.assignment.stage),
                                exc_info=True)
                    continue
                if done:
                    log.info("gave back the call buffers of %s, idle for %.0f s", _stage_key(hosted.assignment.stage),
                             min_idle_s)
                    trimmed += 1
        return trimmed

    async def release_idle_micro_batches(self, max_idle_s: float = MICRO_BATCH_IDLE_S) -> int:
        """Free the KV state of micro-batches idle for `max_idle_s` on every hosted stage; returns how many.
        Nothing else frees the state of a driver that vanished mid-generation."""
        freed = 0
        for hosted in list(self.stages.values()):
            async with hosted.lock:
                idle = hosted.executor.release_idle(max_idle_s)
            if idle:
                log.info("freed %d micro-batch(es) idle for %.0f s on %s", len(idle), max_idle_s,
                         _stage_key(hosted.assignment.stage))
                freed += len(idle)
        return freed

    def begin_closing(self) -> None:
        """From now on no next hop is dialled or waited on: a step stuck so gives up (see _unless_closing). The
        service calls it as it stops, before its server waits for the links' handlers to end."""
        self._closing.set()

    async def close(self) -> None:
        self.begin_closing()
        links, self._next_hops = list(self._next_hops.values()), {}
        for link in links:
            await link.close()
        # each ends as its link closes; one whose link is still open (a bug) must not hold the agent's stop for good
        _, left = await asyncio.wait(self._hop_watchers, timeout=HOP_WATCHERS_CLOSE_S) if self._hop_watchers \
            else (set(), set())
        for watcher in left:
            log.warning("a next hop's link was still open as the agent stopped: its watcher is cancelled")
            watcher.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    async def _unless_closing(self, work: Awaitable[_T], timeout: float | None) -> _T:
        """`work`, or TimeoutError after `timeout` (None: none), or LinkError as soon as close() begins: a stopping
        agent waited for every queued step's dial of an unreachable next hop (10 s each), and ignored SIGTERM for
        minutes."""
        task = asyncio.ensure_future(work)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            done, _ = await asyncio.wait({task, closing}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if closing in done:
            raise LinkError("this agent is stopping")
        raise TimeoutError

    # Private methods: shards and stages

    def _check_shard_writer(self, link: Link, sha256: str) -> None:
        """Refuse (BUSY) a shard's chunks from a second link while another live link sends it: two controllers
        deploying to this PC at once interleaved the chunks of a shared shard, and both deploys failed."""
        writer = self._shard_writers.get(sha256)
        if writer is not None and writer is not link and writer in self._links:
            raise CommandError(ErrorCode.BUSY, f"shard {sha256[:12]}… is being received from {writer.describe()} "
                                               "(another deploy to this PC): deploy again once it has finished")

    def _receive_chunk(self, link: Link, chunk: ShardChunk) -> None:
        """Store a chunk; a refusal is answered once per shard and stream: the deploy sends a shard's chunks without
        waiting, so the ones after a refused chunk (a full disk) were each refused again as out of order, a warning
        in the agent's log per megabyte. They are dropped until the stream resumes where the cache stopped."""
        stream = (link, chunk.sha256)
        if stream in self._refused_streams:
            if chunk.offset != (self.cache.partial_offset(chunk.sha256) or 0):
                log.debug("dropped a chunk of shard %s… at %d after its stream was refused", chunk.sha256[:12],
                          chunk.offset)
                return
            self._refused_streams.discard(stream)
        self._check_shard_writer(link, chunk.sha256)
        self._shard_writers[chunk.sha256] = link
        try:
            self._store_chunk(chunk)
        except CommandError:
            self._refused_streams.add(stream)
            raise

    def _store_chunk(self, chunk: ShardChunk) -> None:
        try:
            self.cache.receive(chunk)
            self.cache_health.stored()
        except CacheFull as error:  # what hosted stages, deploys and builds hold leaves it no room
            raise _cache_limit_refusal(error) from None
        except ShardCacheError as error:
            raise CommandError(ErrorCode.SHARD_MISMATCH, str(error)) from None
        except OSError as error:  # the cache's disk full or not writable
            what = (f"cannot store shard {chunk.sha256[:12]}… (bytes {chunk.offset} to "
                    f"{chunk.offset + len(chunk.data)} of {chunk.total_size})")
            refusal = self._cache_refusal(error, what) or CommandError(
                ErrorCode.INTERNAL, f"{what} in the shard cache {self.cache.root}: {error.strerror or error}")
            dropped = 0
            if error.errno == errno.ENOSPC:  # another program filled the disk meanwhile: give the PC its bytes back
                with contextlib.suppress(OSError):
                    dropped = self.cache.drop_partial(chunk.sha256)
            self.cache_health.refused(error, chunk.total_size - (0 if dropped else chunk.offset))
            if dropped:
                refusal = CommandError(refusal.code, f"{refusal}. The {dropped} bytes received of the shard were "
                                                     "deleted, to give the disk back: the next deploy sends it whole")
            raise refusal from None

    def _cache_refusal(self, error: OSError, what: str) -> CommandError | None:
        """The refusal of a write into the shard cache that its disk refused: full (DISK_FULL) or not writable,
        naming the cache's folder and what this PC's owner can do; None for another OSError."""
        if error.errno == errno.ENOSPC:
            return CommandError(ErrorCode.DISK_FULL, f"{what}: the disk of this PC's shard cache {self.cache.root} "
                                f"is full ({error.strerror or error}): free space there, or lower cache_limit_bytes "
                                f"in the agent's settings below what the disk has free; until then pause this PC "
                                f"(`deskfleet-agent pause`) to deploy without it")
        if error.errno in UNWRITABLE_ERRNOS:
            return CommandError(ErrorCode.INTERNAL, f"{what}: this PC's shard cache {self.cache.root} is not "
                                f"writable ({error.strerror or error}): make it writable, or start the agent with "
                                f"a --data-dir on a writable disk")
        return None

    async def _assign(self, message: AssignStage) -> StageReady:
        if self.policy().paused:  # a plan made before the pause: that deploy fails naming this PC
            raise CommandError(ErrorCode.BUSY, f"this PC is paused {self.paused_by()}: it takes no stage",
                               agent_id=self.agent_id)
        async with self._assign_lock:
            hosted = self.stages.get(message.stage)
            if hosted is not None and _builds_the_same_stage(hosted.assignment, message):
                self.stages[message.stage] = replace(hosted, assignment=message)  # new neighbours at most
                self._refusals_logged.clear()
                self._unreachable_hops.clear()  # a re-plan's chain dials its next hop afresh
                if hosted.assignment.previous_agent_id != message.previous_agent_id:
                    self._narrow_links_of(hosted.assignment.previous_agent_id)  # the hop before it moved
                self._widen_links_of(message.previous_agent_id)
                if message.next_hop is not None:
                    await self._check_next_hop_link(message.next_hop)
                return StageReady(message.stage)
            manifest, names = self._check_assignment(message)
            # A rebuild of a hosted stage pins and materializes under a key of its own, so that a failure
            # leaves the stage being served as it was, and a success can release the old one by its key.
            key = _stage_key(message.stage)
            if hosted is not None and hosted.cache_key == key:
                key += ".next"
            self.cache.pin(key, [entry.sha256 for entry in message.manifest])
            try:
                view = await asyncio.to_thread(self.cache.materialize_manifest, key, manifest, names)
                layers = LayerRange(message.stage.layer_start, message.stage.layer_end, manifest.spec.num_layers)
                precision = StagePrecision.F32 if message.precision is Precision.F32 else StagePrecision.FAST
                settings = CompileSettings(device=message.device, precision=precision, num_threads=self.num_threads,
                                           kv_cache=message.kv_cache)
                stage = await asyncio.to_thread(Stage, view, manifest, layers, settings)
            except (ShardCacheError, ManifestError, ValueError, RuntimeError, KeyError, OSError) as error:
                # OSError: the cache's disk is full or not writable while the view is made
                self.cache.unpin(key)
                self.cache.remove_view(key)
                if isinstance(error, OSError):  # at most the stage's files, copied into its view
                    self.cache_health.refused(error, sum(manifest.files[name].size for name in names
                                                         if name in manifest.files))
                if isinstance(error, OSError) and (
                        refusal := self._cache_refusal(error, f"cannot host {_stage_key(message.stage)}")) is not None:
                    raise refusal from None
                if isinstance(error, ExportMismatchError):  # the export's fault: its files are as sent
                    raise CommandError(ErrorCode.BAD_MESSAGE, f"cannot host {_stage_key(message.stage)}: {error}"
                                       ) from None
                if isinstance(error, ManifestError):  # a file failed its check: the next deploy resends it
                    await asyncio.to_thread(self.cache.drop_corrupted, [entry.sha256 for entry in message.manifest])
                raise CommandError(ErrorCode.SHARD_MISMATCH if isinstance(error, ShardCacheError | ManifestError)
                                   else ErrorCode.INTERNAL, f"cannot host {_stage_key(message.stage)}: {error}"
                                   ) from None
            self.cache_health.stored()  # its view was made in the cache
            for other in [ref for ref in self.stages if ref.model_id == message.stage.model_id]:
                self._release(other)  # a re-plan of the same model replaces what this agent held
            executor = StageExecutor(stage, manifest.spec.max_context, self.kv_memory,
                                     kv_bytes_per_slot(message, manifest.spec),
                                     prefill_scratch_per_token(message.device, layer_width(manifest.spec),
                                                               first=message.is_first))
            self.stages[message.stage] = HostedStage(message, executor, asyncio.Lock(), key)
            self._released_because = None
            self._refusals_logged.clear()
            self._unreachable_hops.clear()
            self._widen_links_of(message.previous_agent_id)
            log.info("hosting %s", key)
            return StageReady(message.stage)

    def _narrow_links_of(self, previous_agent_id: str | None) -> None:
        """Read small frames again on the links of a released stage's previous hop, unless it feeds another stage
        here: it was left able to make this agent hold a frame of up to 320 MB for as long as its link stayed open."""
        for link in self._links:
            if previous_agent_id is not None and link.peer.role is Role.AGENT and \
                    link.peer.agent_id == previous_agent_id and not self.takes_large_frames(link.peer):
                link.take_small_frames()

    def _widen_links_of(self, previous_agent_id: str | None) -> None:
        """Let the links already open from a stage's new previous hop carry its hidden states (takes_large_frames):
        a re-plan may make a PC that had a link open to this one, read at small frames, its previous hop."""
        for link in self._links:
            if previous_agent_id is not None and link.peer.role is Role.AGENT and \
                    link.peer.agent_id == previous_agent_id:
                link.take_large_frames()

    def _check_assignment(self, message: AssignStage) -> tuple[Manifest, list[str]]:
        """The model manifest (itself a shard) and the file names to materialize; all must be cached."""
        entries = {entry.file_name: entry for entry in message.manifest}
        missing = [entry.file_name for entry in message.manifest if not self.cache.has(entry.sha256)]
        if missing:
            raise CommandError(ErrorCode.SHARD_MISMATCH, f"shards not in the cache: {', '.join(sorted(missing))}")
        if MANIFEST_NAME not in entries:
            raise CommandError(ErrorCode.BAD_MESSAGE, f"the assignment lists no {MANIFEST_NAME}")
        manifest_sha = entries[MANIFEST_NAME].sha256
        if self.cache.drop_corrupted([manifest_sha]):  # the stage build checks the other files, not this one
            raise CommandError(ErrorCode.SHARD_MISMATCH, f"the cached {MANIFEST_NAME} changed on disk since it was "
                                                         "verified; it was dropped, send it again")
        try:
            manifest = Manifest.from_json(self.cache.path(manifest_sha).read_text("utf-8"))
        except (ManifestError, UnicodeDecodeError) as error:
            raise CommandError(ErrorCode.SHARD_MISMATCH, f"the assigned {MANIFEST_NAME} is unusable: {error}") from None
        names = [name for name in entries if name != MANIFEST_NAME]
        for name in names:
            listed = manifest.files.get(name)
            if listed is None or listed.sha256 != entries[name].sha256:
                raise CommandError(ErrorCode.SHARD_MISMATCH, f"{name} does not match the model manifest")
        stage = message.stage
        if not stage.layer_end <= manifest.spec.num_layers or message.is_last != (
                stage.layer_end == manifest.spec.num_layers) or message.is_first != (stage.layer_start == 0):
            raise CommandError(ErrorCode.BAD_MESSAGE, f"layers [{stage.layer_start}:{stage.layer_end}] and the "
                               f"first/last flags do not fit a {manifest.spec.num_layers}-layer model")
        return manifest, names

    def _superseded_release(self, link: Link, ref: StageRef) -> bool:
        """Whether `link`'s ReleaseStage of `ref` undoes an assignment of its own that another controller link has
        made again since. A deploy that fails releases the stages it assigned, and its release is read after its
        last assignment, however long that took to build: a failover's re-plan that began meanwhile found the stage
        hosted, was told it was ready, and saved a chain whose stage the old release then took away (two runs
        starting together after a PC came back: both ended). A release from a link that never assigned the stage
        (a later deploy that leaves this PC out) is not such a one."""
        by = self._assigned_by.get(ref)
        return ref in self.stages and ref in self._assigned_over.get(link, ()) and by is not None and by is not link

    def _release(self, ref: StageRef) -> None:
        self._assigned_by.pop(ref, None)
        hosted = self.stages.pop(ref, None)
        if hosted is not None:
            self.cache.unpin(hosted.cache_key)
            self.cache.remove_view(hosted.cache_key)
            self._narrow_links_of(hosted.assignment.previous_agent_id)
            self._free_stage_memory(hosted)
            log.info("released %s", hosted.cache_key)

    def _free_stage_memory(self, hosted: HostedStage) -> None:
        """Have the plugin free a released stage's call buffers (Stage.release_memory) once no step of it runs or waits
        to: after the steps that hold or wait for its lock."""
        if not isinstance(hosted.executor, StageExecutor):  # a stage entered by hand (tests)
            return
        stage = hosted.executor.stage

        def release() -> None:
            try:
                stage.release_memory()
            except Exception:  # kept, not lost: the memory stays with the process, as it did before
                log.warning("could not free the call buffers of released %s", hosted.cache_key, exc_info=True)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside the agent's loop (tests): no step can run
            release()
            return

        async def after_its_step() -> None:  # the lock's waiters go first in, first out: after every queued step
            async with hosted.lock:  # (a lock just let go is not locked() while its next waiter has yet to run)
                release()

        task = loop.create_task(after_its_step())
        self._memory_releases.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._memory_releases.discard)

    # Private methods: forwarding

    async def _forward(self, link: Link, message: Forward) -> None:
        fed = self._fed_by(link, message)
        if not self.stages and self._released_because is not None and not self._released_for_good and \
                not await self.unavailable_now():
            # it gave its stages up, and the reason has passed (resumed, plugged in again): the refusal below
            # blames no one, so the driver's re-plan may give this PC a stage again
            self._released_because = None
        hosted = self._stage_for(message)
        if not any(stage is hosted for stage in fed):  # the sender feeds another stage here, not this one
            key = _stage_key(hosted.assignment.stage)
            raise NotPreviousHop(f"Forward for {key} refused: it came from {link.describe()}, but the stage takes "
                                 f"steps only from {_previous_hop(hosted.assignment)}", key, close_link=False)
        try:
            async with hosted.lock:
                if runs_inline(message):
                    output = hosted.executor.run(message, message.return_logits)
                else:
                    output = await asyncio.to_thread(hosted.executor.run, message, message.return_logits)
        except Exception as error:  # refused (LedgerError, ProtocolError) or failed: the driver hears why
            if not isinstance(error, LedgerError | ProtocolError | ValueError | RuntimeError | KvMemoryRefused):
                log.exception("micro-batch %d step %d failed", message.micro_batch_id, message.step_id)
            text = f"agent {self.agent_id[:12]}: micro-batch {message.micro_batch_id} step {message.step_id} " \
                   f"failed on {_stage_key(hosted.assignment.stage)}: {error}"
            self._note_error(text)
            if isinstance(error, KvMemoryRefused):  # this PC has no room for the run: the re-plan leaves it out
                failure = Error(ErrorCode.OUT_OF_MEMORY, text, micro_batch_id=message.micro_batch_id,
                                agent_id=self.agent_id)
            else:
                failure = Error(ErrorCode.BAD_MESSAGE if isinstance(error, LedgerError | ProtocolError)
                                else ErrorCode.INTERNAL, text, micro_batch_id=message.micro_batch_id)
            if link.peer.role is Role.CONTROLLER:
                # a first stage: its sender is the step's driver, told at once. Sent down the chain instead, the
                # error reached a driver only through stages that knew it: a deploy that reshaped the chain
                # under a running generate gave this stage a new next hop, which had no driver of that run and
                # passed the error to `fleet serve`, while the run waited out its 120 s step timeout
                await self._answer(link, failure)
            else:
                await self._send_down(failure, hosted)
            return
        if isinstance(output, ForwardResult):
            await self._tell_controller(output)
            return
        hop = hosted.assignment.next_hop
        if hop is None:
            raise CommandError(ErrorCode.INTERNAL, "a middle stage has no next hop")
        await self._send_next(hop, output)

    async def unavailable_now(self) -> bool:
        """Whether a plan would leave this PC out now: paused (no sensor read), or a limit crossed."""
        policy = self.policy()
        if policy.paused:
            return True
        reading = await self._read_monitor()
        return decide_availability(reading, policy, serving=False).state is AgentState.UNAVAILABLE

    async def takes_stages_now(self) -> bool:
        """Whether this PC is in the fleet's service now: hosting a stage (its own inference crosses the CPU and
        memory limits, which is no reason to call in again), or free to take one; never while paused."""
        if self.policy().paused:
            return False
        return bool(self.stages) or not await self.unavailable_now()

    def pause_source(self) -> PauseSource | None:
        """Who keeps this PC out of the fleet now; None when nobody does."""
        if self.settings.paused:
            return PauseSource.SETTINGS
        opt_out = self._opt_out.read()
        if opt_out.problem is not None:  # not the employee's wish: the admin must see the file is bad
            return PauseSource.UNREADABLE_OPT_OUT
        return PauseSource.USER if opt_out.paused else None

    def paused_by(self) -> str:
        """Who paused this PC, in words (for a PC that is paused)."""
        source = self.pause_source()
        if source is PauseSource.SETTINGS:
            return "in its settings (paused: true)"
        if source is PauseSource.UNREADABLE_OPT_OUT:
            return (f"as its {OPT_OUT_FILE} cannot be read (this agent's log says why; "
                    "`deskfleet-agent resume` or `pause` writes it anew)")
        return "by its user, until `deskfleet-agent resume`"

    def _stage_for(self, message: Forward) -> HostedStage:
        if not self.stages:
            if self._released_because is not None:  # named as the agent at fault: the driver re-plans without it
                raise CommandError(ErrorCode.NOT_ASSIGNED, f"this agent gave its stages up: {self._released_because}",
                                   agent_id=self.agent_id)
            raise CommandError(ErrorCode.NOT_ASSIGNED, "this agent hosts no stage")
        first = message.input_ids is not None
        matching = [hosted for ref, hosted in self.stages.items()
                    if hosted.assignment.is_first == first and message.model_id in ("", ref.model_id)]
        if len(matching) != 1:
            hosted_models = ", ".join(sorted({ref.model_id for ref in self.stages}))
            wanted = f"model {message.model_id}" if message.model_id else "a step that names no model"
            raise CommandError(ErrorCode.NOT_ASSIGNED, f"{len(matching)} of this agent's stages could take {wanted} "
                                                       f"as a {'first' if first else 'later'} stage (it hosts "
                                                       f"{hosted_models})")
        return matching[0]

    async def _release_micro_batch(self, link: Link, message: ReleaseMicroBatch) -> None:
        hops: dict[str, NextHop] = {}
        for hosted in self._fed_by(link, message):  # only the stages the sender feeds: a stranger frees nothing
            async with hosted.lock:  # after any step of it still running here
                hosted.executor.release(message.micro_batch_id)
            if hosted.assignment.next_hop is not None:
                hops[hosted.assignment.next_hop.agent_id] = hosted.assignment.next_hop
        for hop in hops.values():
            await self._send_next(hop, message)

    def _fed_by(self, link: Link, message: Forward | ReleaseMicroBatch | Error) -> list[HostedStage]:
        """The hosted stages whose rightful previous hop is `link`'s peer (see _is_previous_hop). NotPreviousHop
        when there are stages but the peer feeds none of them; none hosted: [] (a step is then refused as not
        assigned, naming why this agent gave its stages up; a release frees nothing; an Error is refused)."""
        fed = [hosted for hosted in self.stages.values() if _is_previous_hop(link, hosted.assignment)]
        if fed or (not self.stages and not isinstance(message, Error)):
            return fed
        expected = "; ".join(f"{_stage_key(ref)} from {_previous_hop(hosted.assignment)}"
                             for ref, hosted in self.stages.items()) or "none: this agent hosts no stage"
        raise NotPreviousHop(f"{type(message).__name__} refused: {link.describe()} is the previous hop of none of "
                             f"this agent's stages (each takes steps only from its previous hop: {expected})", "",
                             close_link=link.peer.role is Role.AGENT)

    def _checked_blame(self, link: Link, error: Error, fed: list[HostedStage]) -> Error:
        """`error` as relayed from its previous hop, without a blame that the sender cannot truthfully make.

        Errors travel down the chain, and an agent observes only itself (it gave its stages up) and its next
        hop (unreachable); so an Error from the previous hop may blame the sender, or an earlier stage whose
        error the sender relayed (unknown here: the driver checks those against the whole chain, in
        controller/fleet_pipeline.py). It may not blame this agent (it is reading the error, so it is reachable
        and hosting: the sender's link to it failed for a moment at most) nor this stage's next hop or anything
        further down, which the sender knows nothing of. Such a blame is dropped and logged; the error itself
        goes on, so that the driver learns its step was lost."""
        blamed = error.agent_id
        if blamed is None or blamed == link.peer.agent_id:
            return error
        downstream = {self.agent_id} | {hosted.assignment.next_hop.agent_id for hosted in fed
                                        if hosted.assignment.next_hop is not None}
        if blamed not in downstream:
            return error
        where = "this agent" if blamed == self.agent_id else "this stage's next hop"
        note = (f"agent {self.agent_id[:12]} dropped the blame of agent {blamed[:12]} ({where}) that "
                f"{link.describe()} relayed: a previous hop cannot know it to be at fault")
        self._note_error(note)
        return replace(error, agent_id=None, message=f"{error.message} [{note}]")

    async def _refuse_sender(self, link: Link, message: Message, refusal: NotPreviousHop) -> bool:
        """Answer `refusal` to the sender alone, logging it once per peer and stage; False when the link is
        closed (a peer that feeds none of this agent's stages) or gone."""
        logged = (link.peer.agent_id, refusal.about)
        if logged not in self._refusals_logged:
            self._refusals_logged.add(logged)
            self._note_error(str(refusal))
        text = f"agent {self.agent_id[:12]}: {refusal}"
        if refusal.close_link:
            await link.refuse(ErrorCode.UNAUTHORIZED, text)
            return False
        try:
            await link.send(Error(ErrorCode.UNAUTHORIZED, text, micro_batch_id=message.micro_batch_id
                                  if isinstance(message, Forward | ReleaseMicroBatch) else None))
        except LinkError as error:
            log.info("%s", error)
            return False
        return True

    async def _answer(self, link: Link, error: Error) -> None:
        """Send `error` back on `link`; a link gone meanwhile is logged (its driver's run has ended)."""
        try:
            await link.send(error)
        except LinkError as gone:
            log.info("%s", gone)

    async def _send_down(self, error: Error, hosted: HostedStage | None = None) -> None:
        """Send an Error toward the driver: to the next hop when this stage has one, else back (a first stage's
        refusal of its driver's step goes back on the driver's own link instead: see _forward)."""
        if hosted is None and len(self.stages) == 1:
            hosted = next(iter(self.stages.values()))
        hop = hosted.assignment.next_hop if hosted is not None else None
        if hop is None:
            await self._tell_controller(error)
            return
        try:
            await self._send_next(hop, error)
        except CommandError:
            await self._tell_controller(error)  # the next hop is gone too: straight back to the controller

    async def _revoke(self, update: RevocationUpdate) -> None:
        """Add the controller's list to the removals kept (never shrunk: a removal is for good, and a controller
        restored from an older backup must not make agents forget one), and drop the removed agents' links.
        CommandError, and nothing changes, if a removal new here is not signed by this fleet's CA. Ids saved
        before removals were signed are kept until this first list, which replaces them, as lists did then."""
        ca_certificate = self.files.ca_certificate()
        new = {agent_id: signature for agent_id, signature in zip(update.agent_ids, update.signatures, strict=True)
               if agent_id not in self._removal_signatures}  # one held is kept (each controller signs anew)
        for agent_id, signature in new.items():
            try:
                pki.check_removal(ca_certificate, agent_id, signature)
            except pki.PkiError as error:
                raise CommandError(ErrorCode.BAD_MESSAGE, f"{error}: the list of removed agents is ignored") from None
        signatures = {**self._removal_signatures, **new}
        revoked = frozenset(signatures)  # the controller's list and every removal kept, all signed
        if (revoked, signatures) != (self._revoked.agent_ids, self._removal_signatures) \
                and self._revocations_file is not None:
            try:
                write_atomic(self._revocations_file, json.dumps(
                    {"revoked_agent_ids": sorted(revoked),
                     "signatures": {agent_id: signatures[agent_id].hex() for agent_id in sorted(signatures)}},
                    indent=1).encode())
            except OSError as error:  # still refused in this run; only a restart could forget them
                log.error("cannot save the removed agents to %s: %s", self._revocations_file, error)
        self._revoked = pki.RevocationSet(revoked)
        self._removal_signatures = signatures
        self._revocations_unknown = None  # the controller's list: known again
        for agent_id in revoked:
            hop = self._next_hops.pop(agent_id, None)
            if hop is not None:
                await hop.close()
        for link in list(self._links):
            if self._revoked.is_revoked(link.peer.agent_id):
                log.warning("dropping the link of removed %s", link.describe())
                await link.refuse(ErrorCode.UNAUTHORIZED, "this agent was removed from the fleet")

    async def _tell_known_removals(self, link: Link, update: RevocationUpdate) -> None:
        """Give the controller that sent `update` the signed removals kept here that it lacks, MAX_KNOWN_REMOVALS a
        message (`fleet serve` and surveys add them to its list)."""
        listed = set(update.agent_ids)
        missing = sorted(agent_id for agent_id in self._removal_signatures if agent_id not in listed)
        if missing:
            log.warning("the controller's list of removed agents lacks %d this agent keeps (its data dir was "
                        "restored from an older backup?): telling it", len(missing))
        for start in range(0, len(missing), MAX_KNOWN_REMOVALS):
            chunk = tuple(missing[start:start + MAX_KNOWN_REMOVALS])
            try:
                await link.send(KnownRemovals.of(chunk, [self._removal_signatures[agent_id] for agent_id in chunk]))
            except LinkError as error:
                log.info("%s", error)
                return

    async def _send_next(self, hop: NextHop, message: Forward | ReleaseMicroBatch | Error) -> None:
        failed = self._unreachable_hops.get(hop.agent_id)
        if failed is not None and time.monotonic() - failed[0] < HOP_RETRY_AFTER_S:
            raise CommandError(ErrorCode.INTERNAL, failed[1], agent_id=hop.agent_id)
        for attempt in range(2):  # a cached link may have died since the last step: reconnect once
            link = self._next_hops.get(hop.agent_id)
            try:
                if self._revoked.is_revoked(hop.agent_id):
                    raise LinkError("it was removed from the fleet")
                if self._revocations_unknown is not None:
                    raise LinkError(f"next hop {hop.agent_id[:12]} not dialled: {self._revocations_unknown}")
                if self._closing.is_set():
                    raise LinkError("this agent is stopping")
                if link is None:
                    link = await self._unless_closing(self._open_next_hop(hop), None)
                    self._next_hops[hop.agent_id] = link
                    watcher = asyncio.create_task(self._watch_next_hop(hop, link))
                    self._hop_watchers.add(watcher)
                    watcher.add_done_callback(self._hop_watchers.discard)
                try:
                    await self._unless_closing(link.send(message), HOP_SEND_TIMEOUT_S)
                except TimeoutError:
                    await self._drop_hop_link(hop, link)
                    raise LinkError(f"a step sent to it made no progress in {HOP_SEND_TIMEOUT_S:.0f} s (it "
                                    "acknowledges nothing: a firewall or a network fault between the two "
                                    "PCs?)") from None
                self._unreachable_hops.pop(hop.agent_id, None)
                return
            except LinkError as error:
                if link is not None and self._next_hops.get(hop.agent_id) is link:
                    # closed as it is given up: its watcher reads it until it closes, and close() waits for every
                    # watcher. Dropped from the map alone, a link alive under a step that the agent's stopping cut
                    # short stayed open, and the agent hung at its stop for good (2-3 of 5 SIGINTs mid-run)
                    await self._drop_hop_link(hop, link)
                self._next_hops.pop(hop.agent_id, None)
                if self._closing.is_set():  # this PC is going, not its next hop: the re-plan leaves this one out
                    raise CommandError(ErrorCode.INTERNAL, f"agent {self.agent_id[:12]} dropped the step: this agent "
                                       "is stopping", agent_id=self.agent_id) from None
                if attempt and error.too_big:  # it answered, refusing the step: blame no one
                    raise CommandError(ErrorCode.NOT_ASSIGNED, _refused_as_too_big(
                        hop, link.address if link is not None else hop.address)) from None
                if attempt:  # the Error that answers it starts with this agent's id
                    dialled = " or ".join(dialable_here(hop.addresses) or hop.addresses)
                    text = f"next hop agent {hop.agent_id[:12]} at {dialled} is unreachable: {error}"
                    self._unreachable_hops[hop.agent_id] = (time.monotonic(), text)
                    raise CommandError(ErrorCode.INTERNAL, text, agent_id=hop.agent_id) from None

    async def _open_next_hop(self, hop: NextHop) -> Link:
        """A link to `hop` at the first of its addresses to answer, of those of an IP family this PC has an address
        of (every one where it has none of theirs), `hop.address` first, each NEXT_HOP_DIAL_STAGGER_S after the one
        before it."""
        addresses = dialable_here(hop.addresses)
        try:
            return await open_first(addresses or hop.addresses, lambda address: open_link(
                address, self.files, expected_agent_id=hop.agent_id, revocations=self.revocations),
                NEXT_HOP_DIAL_STAGGER_S)
        except LinkError as error:
            if addresses:
                raise
            raise LinkError(f"{error} (this PC has no address of their IP family: a PC of the other family, or "
                            "one of both, must stand between them in the chain)") from None

    async def _check_next_hop_link(self, hop: NextHop) -> None:
        """Drop the open link to `hop` unless it answers a ping within NEXT_HOP_CHECK_S, so that the next step dials it
        afresh. A re-plan onto the same chain (a network drop broke it) kept the link opened before the drop, still
        waiting out TCP's back-off: its keepalive closed it seconds into the new chain's run, a second failover that
        left a healthy PC out (from an exploratory test of link blips)."""
        link = self._next_hops.get(hop.agent_id)
        # one still sending (another driver's hidden states) would queue the pong behind them: busy is alive enough
        if link is None or link.sending() or await link.answers_within(NEXT_HOP_CHECK_S):
            return
        if self._next_hops.get(hop.agent_id) is link:
            log.info("dropped the link to next hop %s: it answered no ping within %.0f s; the next step dials it "
                     "anew", link.describe(), NEXT_HOP_CHECK_S)
            await self._drop_hop_link(hop, link)

    async def _drop_hop_link(self, hop: NextHop, link: Link) -> None:
        """Give up a next-hop link that stalled: a send cut mid-frame leaves it unusable, and a close handshake waits
        on the same full buffer (bounded by the link's close timeout)."""
        self._next_hops.pop(hop.agent_id, None)
        try:
            await asyncio.wait_for(link.close(), 5.0)
        except (TimeoutError, LinkError, OSError):
            link.connection.transport.abort()

    async def _watch_next_hop(self, hop: NextHop, link: Link) -> None:
        """Read what the next hop sends back on the link this agent opened to it: only a refusal comes (its stage
        takes steps from another previous hop now), and the steps it refused are lost there, so the drivers are told
        at once: of the micro-batch it names, else every driver of this agent, whose chains through it are stale.
        Before, nobody read the link: a deploy that made this stage's next hop a first stage, while the old stage
        here still forwarded the steps in flight, left the run waiting out its 120 s step timeout."""
        try:
            while True:
                message = await link.receive()
                if isinstance(message, Error):
                    await self._tell_controller(Error(
                        message.code, f"agent {self.agent_id[:12]}: next hop agent {hop.agent_id[:12]} at "
                                      f"{link.address} refused this stage's step: {message.message}",
                        micro_batch_id=message.micro_batch_id))
                else:
                    log.debug("ignoring %s from next hop %s", type(message).__name__, link.describe())
        except LinkError as error:
            if self._closing.is_set() or self._next_hops.get(hop.agent_id) is not link:
                return  # closed here: a stage released or re-planned, the agent stopping, or a send that said so
            self._next_hops.pop(hop.agent_id, None)  # the next step dials it anew
            await self._report_lost_hop(hop, link.address, error)

    async def _report_lost_hop(self, hop: NextHop, address: str, error: LinkError) -> None:
        """Tell the drivers of the micro-batches this agent's stages hold, whose steps went to `hop` (at `address`),
        that the link to it died under them (its keepalive went unanswered: a firewall that cut it mid-run, a PC
        gone): the steps sent on it are lost. Before, a link whose last steps had fitted in the send buffer died
        without a word, the run waited out its 120 s step timeout and re-planned onto the same chain, and only a
        second re-plan found the link. The driver weighs the blame (the controller reaching both PCs marks the link
        broken). A link the next hop closed as a step was too large for it (LinkError.too_big) is a refusal, told as
        one, blaming no one: it read as the hop lost, and a healthy PC or link was left out of the re-plan. So is a
        link that died as this PC lost the address it ran from (LinkError.own_address_gone: a renewed lease)."""
        if error.too_big:
            text = f"agent {self.agent_id[:12]}: {_refused_as_too_big(hop, address)}"
            await self._report_hop_steps(hop, Error(ErrorCode.NOT_ASSIGNED, text))
            return
        if error.own_address_gone is not None:  # this PC's own address went: blamed its healthy next hop
            text = (f"agent {self.agent_id[:12]}: the link to its next hop agent {hop.agent_id[:12]} at {address} "
                    f"died with steps in flight as this PC lost its address {error.own_address_gone} (its address "
                    "changed, or it left the network): no PC is blamed")
            await self._report_hop_steps(hop, Error(ErrorCode.INTERNAL, text))
            return
        text = (f"agent {self.agent_id[:12]}: next hop agent {hop.agent_id[:12]} at {address} is unreachable: "
                f"the link to it died with steps in flight ({error})")
        await self._report_hop_steps(hop, Error(ErrorCode.INTERNAL, text, agent_id=hop.agent_id))

    async def _report_hop_steps(self, hop: NextHop, error: Error) -> None:
        """`error`, for each micro-batch this agent's stages hold whose steps go to `hop`, to its driver."""
        for hosted in list(self.stages.values()):
            next_hop = hosted.assignment.next_hop
            if next_hop is None or next_hop.agent_id != hop.agent_id:
                continue
            for micro_batch_id in hosted.executor.micro_batch_ids():
                await self._tell_controller(replace(error, micro_batch_id=micro_batch_id))

    async def _tell_controller(self, message: Message) -> None:
        """Send a ForwardResult, or an Error travelling down the chain, back to its driver.

        - It names a micro-batch and drivers said ResultsHere: to the driver whose range holds the id and to no
          other (one user's tokens are not another's to see); where none does (the late result of a driver
          gone), it is dropped.
        - An Error that names no micro-batch (this stage failed as a whole): to every driver, whose chains it
          breaks.
        - No driver said ResultsHere: the open controller links, the one that spoke last first, and this agent's
          own registration link last (a registration that `fleet serve` answered after a chain opened spoke
          last, and a paused stage's refusal went there, where it was only logged, while the driver waited out
          its step timeout). Log when no link takes it."""
        micro_batch_id = getattr(message, "micro_batch_id", None)
        drivers = list(reversed(self._results_links))
        if micro_batch_id is None and isinstance(message, Error) and len(drivers) > 1:
            for link in drivers:
                await self._send_to_controller([link], message)
            return
        if micro_batch_id is not None and drivers:
            owners = [link for link in drivers if self._results_links[link].holds(micro_batch_id)]
            if owners:
                await self._send_to_controller(owners, message)
            else:
                log.debug("dropped a %s for micro-batch %d: no driver's range holds it (its driver is gone)",
                          type(message).__name__, micro_batch_id)
            return
        others = sorted(reversed(self._controller_links), key=lambda link: link in self._registration_links)
        await self._send_to_controller(drivers + [link for link in others if link not in self._results_links],
                                       message)

    async def _send_to_controller(self, links: list[Link], message: Message) -> None:
        """Send on the first of `links` that takes it; log when none does."""
        for link in links:
            try:
                await link.send(message)
                return
            except LinkError:
                continue
        what = "a step's result" if isinstance(message, ForwardResult) else "an error report"
        batch = getattr(message, "micro_batch_id", None)
        of = f" of micro-batch {batch}" if batch is not None else ""
        self._note_error(f"dropped {what}{of}: no link to a controller is open to take it (the run it belonged to has "
                         "ended or moved on, e.g. while this PC did not answer); nothing to do")

    def _note_error(self, text: str, level: int = logging.WARNING) -> None:
        self.last_error = text[:500]
        log.log(level, "%s", text)


def _cache_limit_refusal(error: CacheFull) -> CommandError:
    """The refusal of shards the shard cache's limit, or its disk, has no room for: DISK_FULL (it was
    OUT_OF_MEMORY, which sent the admin looking at the PC's memory), with what the PC's owner can do."""
    fix = "free space on that disk" if error.by_disk else \
        "raise cache_limit_bytes in the agent's settings (and restart it)"
    return CommandError(ErrorCode.DISK_FULL, f"{error}; {fix}, or pause this PC (`deskfleet-agent pause`) to deploy "
                                             "without it")


def kv_bytes_per_slot(assignment: AssignStage, spec: ModelSpec) -> int:
    """What one row's token takes in the KV cache of every layer of the stage `assignment` asks for, as the agent's
    KV memory guard counts it. A GPU's or NPU's own precision is f16 (counted as f32, the guard refused early); an
    AI PC's iGPU and NPU keep their caches in the PC's shared memory, which the guard reads."""
    precision = kv_cache_precision(assignment.precision, assignment.device, assignment.kv_cache) or "f16"
    layers = assignment.stage.layer_end - assignment.stage.layer_start
    return kv_cache_bytes_per_token_per_layer(spec, precision) * layers


def runs_inline(message: Forward) -> bool:
    """Whether a step runs on the event loop's own thread rather than a worker thread.

    Decoding and verification steps (a few tokens a row) do: their calls are short, and the hand-off to a
    worker thread and back cost a step as much as a tenth of its time (demo pair over the fleet, one core
    per PC: 1 PC 283 -> 311 tok/s, 2 PCs with prompt lookup 648 -> 698 tok/s inline). Prompts, and steps
    that edit KV state on the host (admitting a prefilled row, compacting, copying a row out), go to a worker
    thread: a long call on the loop's thread would leave the links' pings unanswered (PING_TIMEOUT_S) and status late.
    """
    rows, tokens = message.position_ids.shape
    if rows * tokens > INLINE_STEP_TOKENS or message.admit_from or message.copy_into:
        return False
    return not any(isinstance(delta, Compact) for delta in message.slot_deltas)


def _builds_the_same_stage(hosted: AssignStage, wanted: AssignStage) -> bool:
    """True when `wanted` asks for the stage `hosted` built: equal but for the next and previous hops and the
    order in which the manifest lists its files. A change of device, precision or KV cache needs a rebuild."""
    def files(assignment: AssignStage) -> list[ManifestEntry]:
        return sorted(assignment.manifest, key=lambda entry: entry.file_name)
    return files(hosted) == files(wanted) and all(getattr(hosted, field.name) == getattr(wanted, field.name)
                                                  for field in fields(AssignStage)
                                                  if field.name not in ("next_hop", "previous_agent_id", "manifest"))


def _refused_as_too_big(hop: NextHop, address: str) -> str:
    """Why a next hop closed this agent's link (open at `address`) as a step was too large (websocket 1009): it reads
    large steps only from the previous hop of a stage it hosts, and hosts none fed by this agent, which no PC is at
    fault for."""
    return (f"next hop agent {hop.agent_id[:12]} at {address} refused this stage's step as too large: it reads "
            "large steps only from the previous hop of a stage it hosts, and hosts none fed by this agent (not "
            "assigned this chain yet, restarted, or re-planned)")


def _is_previous_hop(link: Link, assignment: AssignStage) -> bool:
    """Whether `link`'s peer is the stage's rightful previous hop: a controller for a first stage, else the
    agent the assignment names, as its certificate proves (the link's Hello matched it)."""
    if assignment.previous_agent_id is None:
        return link.peer.role is Role.CONTROLLER
    return link.peer.role is Role.AGENT and link.peer.agent_id == assignment.previous_agent_id


def _previous_hop(assignment: AssignStage) -> str:
    if assignment.previous_agent_id is None:
        return "the controller"
    return f"agent {assignment.previous_agent_id[:12]}"


def _stage_key(ref: StageRef) -> str:
    """The stage's name in the shard cache (pin owner and view folder): a plain file name, one per model id.

    The model id is the export's checkpoint folder name and its manifest digest. Letters outside ASCII and
    a leading dot made a name the cache refuses (every assignment of such a model failed), and cutting a
    long id at 80 characters cut off the digest, so two exports of one checkpoint took each other's pins
    and views: a long id keeps its start and a digest of all of it."""
    safe = _UNSAFE_IN_KEY.sub("_", ref.model_id).replace("..", "__")
    if len(safe) > _STAGE_KEY_NAME_CHARS:
        digest = hashlib.sha256(ref.model_id.encode()).hexdigest()[:12]
        safe = f"{safe[:_STAGE_KEY_NAME_CHARS - len(digest) - 1]}.{digest}"
    if safe.startswith((".", "-")):
        safe = f"_{safe}"
    return f"{safe}-{ref.layer_start}-{ref.layer_end}"


def _deploy_pin(link: Link) -> str:
    """The shard cache's pin owner for the stage a deploy is sending over `link`."""
    return f"\0deploy:{id(link)}"


def _load_revocations(path: Path | None, ca_certificate: x509.Certificate
                      ) -> tuple[pki.RevocationSet, dict[str, bytes], str | None]:
    """(The removed agents saved, the CA's signatures of their removals, None), or (none, none, why) when the
    saved list cannot be read. No file: nobody was removed yet. A damaged one is not read as "nobody removed":
    that would let removed agents in again; the agent refuses every agent link until the controller sends its
    list (at registration, or a survey's first message), while the controller's links work as ever.

    A removal signed by another CA is dropped: the PC joined another fleet since (its removals mean nothing
    here, and the same key may join this one). A list saved before removals were signed has ids alone: they
    are refused until the controller's list replaces them."""
    if path is None or not path.exists():
        return pki.RevocationSet(), {}, None
    try:
        saved = read_json_object(path)
        agent_ids, signatures = saved.get("revoked_agent_ids"), saved.get("signatures", {})
        if not isinstance(agent_ids, list):
            raise JsonFileError(f"{path} holds no list revoked_agent_ids")
        if not isinstance(signatures, dict):
            raise JsonFileError(f"{path}: signatures is not an object")
        for agent_id in agent_ids:
            if not isinstance(agent_id, str) or not is_agent_id(agent_id):
                raise JsonFileError(f"{path}: {agent_id!r} is not an agent id")
        if not set(signatures) <= set(agent_ids):
            raise JsonFileError(f"{path} signs removals it does not list")
        for agent_id, signature in signatures.items():
            if not isinstance(signature, str) or not _REMOVAL_SIGNATURE_HEX.fullmatch(signature):
                raise JsonFileError(f"{path}: the signature of {agent_id[:12]} is not {2 * REMOVAL_SIGNATURE_BYTES} "
                                    "lowercase hex characters")
    except (JsonFileError, ProtocolError, TypeError) as error:
        log.error("the saved list of removed agents is damaged (%s): agents are refused until the controller "
                  "sends its list", error)
        return pki.RevocationSet(), {}, f"the saved list of removed agents is damaged ({error})"
    kept = {}
    for agent_id, text in signatures.items():
        signature = bytes.fromhex(text)
        try:
            pki.check_removal(ca_certificate, agent_id, signature)
        except pki.PkiError:
            continue
        kept[agent_id] = signature
    if len(kept) < len(signatures):
        log.info("%d removal(s) saved in %s are of another fleet's CA: this PC joined another fleet since; "
                 "dropped", len(signatures) - len(kept), path)
    unsigned = set(agent_ids) - set(signatures)
    return pki.RevocationSet(frozenset(unsigned | set(kept))), kept, None
