"""`deskfleet-agent --headless`: the agent core on the network.

Runs, in one TaskGroup: the TLS websocket server other fleet members connect to, and the registration
link to the controller (the addresses from the join token), which tells the controller where this agent
listens and carries the controller's commands like any other controller link. When the controller is
unreachable or refuses (a removed agent), registration retries with backoff; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from http import HTTPStatus
from pathlib import Path

from deskfleet.agent.advertise import (
    Advertiser,
    Announcement,
    RoutedSources,
    addresses_to_advertise,
    advertise_while_serving,
    dialable_here,
    lan_sources,
    never_changes,
    stable_source,
)
from deskfleet.agent.controller_search import find_controller, interfaces_to_search
from deskfleet.agent.core import AgentCore
from deskfleet.agent.enroll import (
    EnrollmentError,
    Membership,
    agent_tls_files,
    check_credentials,
    secure_state_dir,
)
from deskfleet.agent.link import (
    Link,
    LinkError,
    LinkRefused,
    listen_text,
    listening_families,
    open_first,
    open_link,
    start_server,
    utc_now,
)
from deskfleet.agent.monitor import HostMonitor, SystemMonitor
from deskfleet.agent.paths import (
    DEFAULT_AGENT_PORT,
    AgentPaths,
    AgentSettings,
    load_settings,
    misnamed_settings_files,
)
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.agent.speed_probe import SpeedMeasurement, cached_speed
from deskfleet.agent.stage import openvino_devices
from deskfleet.agent.standing import MEMBERSHIP_FILE, forget_removed, note_removed
from deskfleet.agent.status_file import (
    STATUS_CHECK_S,
    PublishedStatus,
    shows_a_change,
    this_process_started_at,
    write_status_file,
)
from deskfleet.agent.stop_request import STOP_CHECK_S, STOP_REQUEST_FILE, StopRequestWatch, clear_stop_request
from deskfleet.common import pki
from deskfleet.common.arguments import option_text
from deskfleet.common.console import stopping_signals
from deskfleet.common.devices import device_targets
from deskfleet.common.discovery_record import SERVICE_TYPE, AgentRecord
from deskfleet.common.file_lock import pid_lock
from deskfleet.common.open_files import log_open_files_limit, raise_open_files_limit
from deskfleet.common.version import software_version
from deskfleet.common.wire import (
    AddressesChanged,
    ProtocolError,
    Register,
    host_port,
    is_loopback_host,
    listens_everywhere,
    parse_address,
    with_default_port,
)

log = logging.getLogger(__name__)

RETRY_MIN_S = 1.0
RETRY_MAX_S = 30.0
# A PC removed from the fleet asks again this seldom (not every RETRY_MAX_S: the controller logged each refusal, every
# 30 s, for as long as the PC ran): only a controller restored from a backup older than the removal lets it back in.
REMOVED_RETRY_S = 3600.0
REGISTERED_STABLE_S = 30.0  # a controller link that lasted this long resets the retry delay
LOCK_FILE = "agent.lock"  # in the state folder: one agent, or one join, per data dir
AGENT_HOLDER, JOIN_HOLDER = "agent", "join"  # what holds it, written in it for the next comer's message
REVOCATIONS_FILE = "revoked.json"  # in the state folder: the controller's last list of removed agents
ADVERTISE_REFRESH_S = 10.0
# While no address of the membership answers, `fleet serve`'s mDNS announcement is looked for at most this often
# (each look takes up to controller_search.SEARCH_S); a controller found there is saved first in membership.json.
CONTROLLER_SEARCH_INTERVAL_S = 30.0
SAVED_CONTROLLER_ADDRESSES = 4  # addresses membership.json keeps (host names always): see addresses_after_move
IDLE_SWEEP_S = 60.0  # how often micro-batches left behind by a vanished driver are looked for
LIMITS_CHECK_S = 2.0  # how often a serving agent reads its sensors against the employee's limits
# how often the agent looks whether it is available again after a spell of not being (CallInWatch): a pause ended
# is seen without a sensor read, the rest with one more monitor read each time (the mDNS refresh makes the other)
AVAILABILITY_CHECK_S = 10.0
# how often a registered agent looks whether the addresses it would register now differ from those it registered
# (a rotated IPv6 address, its other family's address renewed), and tells the controller (AddressesChanged)
ADDRESS_CHECK_S = 30.0
CERTIFICATE_CHECK_S = 86400.0  # how often (after start) the certificate and the CA are checked for their end


@dataclass(frozen=True)
class AgentOptions:
    data_dir: Path | None
    listen: str | None = None  # host:port; None: the settings file's listen_address


class AgentService:
    """The headless agent: load identity and settings, then serve until stopped."""

    join_command = "deskfleet-agent join TOKEN"  # what the logs tell the PC's admin to run (with its --data-dir)

    def __init__(self, options: AgentOptions, monitor: SystemMonitor | None = None) -> None:
        self.paths = AgentPaths.resolve(options.data_dir)
        self.settings: AgentSettings = load_settings(self.paths.settings_file)
        join = "deskfleet-agent join TOKEN" + (f" {option_text('--data-dir', str(options.data_dir))}"
                                               if options.data_dir else "")
        self.join_command = join
        # before anything is made: a mistyped --data-dir is named, not filled with empty folders
        self.membership = Membership.load(self.paths.state_dir, join)
        self.paths.create()
        secure_state_dir(self.paths.state_dir)
        self.files = agent_tls_files(self.paths.state_dir)
        if missing := self.files.missing():
            raise EnrollmentError(f"{', '.join(str(path) for path in missing)} missing: this PC's fleet credentials "
                                  f"are incomplete; join again with a new token: `{join}`")
        check_credentials(self.files, self.membership, join)
        if (mode := pki.open_key_mode(self.files.key_path)) is not None:  # the controller's keys were warned of alone
            log.warning("%s (this PC's fleet key) is open to other users (mode %03o): whoever reads it can pose as "
                        "this PC to the fleet, and be sent the stages and prompts it would get; run `chmod 600 %s`",
                        self.files.key_path, mode, self.files.key_path)
        # an empty --listen (an unset variable's) is refused, not taken for the settings' address, which may be
        # every interface where the user meant one
        self.listen = self.settings.listen_address if options.listen is None else \
            with_default_port(options.listen, DEFAULT_AGENT_PORT)  # `--listen 10.0.0.5`: the agent's usual port
        try:  # named as given, not with the port added
            parse_address(self.listen if options.listen is None else options.listen, default_port=DEFAULT_AGENT_PORT)
        except ProtocolError as error:
            raise ProtocolError(f"--listen: {error}" if options.listen is not None else str(error)) from None
        self.core = AgentCore(self.files, self.settings,
                              ShardCache(self.paths.shard_dir, self.settings.cache_limit_bytes),
                              monitor or HostMonitor(), speed_probe=self._speed,
                              revocations_file=self.paths.state_dir / REVOCATIONS_FILE,
                              opt_out_dir=self.paths.state_dir, device_probe=openvino_devices)
        # this PC's address of each IP version that routes past it, towards the controller first
        self._lan_sources = RoutedSources(lambda: lan_sources(self.membership.controller_addresses))
        self.core.dial_families = lambda: tuple(sorted(self._lan_sources()))
        self.bound_port: int | None = None
        self.listen_families: frozenset[int] = frozenset({4, 6})  # of the sockets it listens on (listening_families)
        # the interfaces to look for a moved controller on (mDNS); tests give loopback's
        self.controller_search_interfaces: Callable[[], list[str]] = lambda: interfaces_to_search(
            self.listen, self.membership.controller_addresses)
        self._outage = _Outage()  # registration attempts failing since the controller link was lost
        self._registration: Link | None = None  # the live link to `fleet serve`, once registered on it
        self._told_addresses: tuple[str, ...] = ()  # the listen addresses `fleet serve` last heard on that link
        self._stopping = asyncio.Event()
        self._started_at = this_process_started_at()  # the tray tells this process from a later one of its pid
        self._stop_watch = StopRequestWatch(self.paths.state_dir, os.getpid(), self._started_at)
        self._status_written: PublishedStatus | None = None  # the status last written for the tray
        # the kind of failure (type, errno) of the last status write for the tray, None when it worked
        self._status_unwritten: tuple[type, int | None] | None = None

    def _prepare_cache(self) -> None:
        """Tidy the shard cache (a lowered cache limit, and views of the last run's stages), and warn when it cannot
        be written: the agent still starts, and serves from what is cached, but every deploy that must write there
        will be refused."""
        try:
            self.core.cache.tidy()
        except OSError as error:  # the cache is tidied again by the next deploy's eviction
            log.warning("cannot tidy the shard cache %s: %s", self.core.cache.root, error)
        if (unwritable := self.core.cache.unwritable()) is not None:
            log.warning("the shard cache %s cannot be written (%s): this PC takes no new stage until it can (a "
                        "stage's folder is made there)", self.core.cache.root, unwritable)

    def _speed(self) -> SpeedMeasurement:
        """The admin's pinned speed, else the measured one (cached in the state folder)."""
        if self.settings.speed_gb_per_s is not None:
            return SpeedMeasurement(self.settings.device, "pinned in settings", self.settings.speed_gb_per_s, 0.0)
        return cached_speed(self.paths.state_dir, self.settings.device)

    # Public methods

    async def run(self) -> None:
        host, port = parse_address(self.listen)
        with self._data_dir_lock():
            self._log_settings()  # before it listens: a misnamed file's listen_address did not apply
            log_open_files_limit(raise_open_files_limit())
            self._prepare_cache()
            try:
                server = await start_server(self.core.serve_link, host, port, self.files,
                                            revocations=self.core.revocations,
                                            large_frames=self.core.takes_large_frames)
            except OSError as error:
                raise OSError(f"cannot listen on {self.listen} (--listen, or listen_address in "
                              f"{self.paths.settings_file}): {error.strerror or error}") from None
            self.bound_port = server.sockets[0].getsockname()[1] if server.sockets else port
            self.listen_families = listening_families(server.sockets)
            log.info("agent %s listening on %s", self.core.agent_id[:12], listen_text(host, self.bound_port))
            self._log_pause()
            self._install_signal_handlers()
            # a request left behind is for an agent that ran before (no status file names this process yet, so no
            # `stop` can have asked it): cleared, whatever pid it names
            with contextlib.suppress(OSError):
                clear_stop_request(self.paths.state_dir)
            self.check_certificates(utc_now())
            try:
                async with server, asyncio.TaskGroup() as tasks:
                    tasks.create_task(self._check_certificates_forever(), name="check-certificates")
                    tasks.create_task(self._register_forever(), name="register")
                    tasks.create_task(self._advertise_forever(host), name="advertise")
                    tasks.create_task(self._sweep_idle_forever(), name="sweep-idle")
                    tasks.create_task(self._enforce_limits_forever(), name="enforce-limits")
                    tasks.create_task(self._call_in_when_available_forever(), name="call-in")
                    tasks.create_task(self._tell_address_changes_forever(), name="address-changes")
                    tasks.create_task(self._publish_status_forever(), name="publish-status")
                    tasks.create_task(self._stop_when_asked_forever(), name="stop-when-asked")
                    await self._stopping.wait()
                    self.core.begin_closing()  # before the server waits for its links' handlers: one may be dialling
                    raise _Stop
            except* _Stop:
                pass
            finally:
                hosted = [f"{ref.model_id} layers [{ref.layer_start}:{ref.layer_end}]" for ref in self.core.stages]
                await self.core.close()
                log.info("agent %s stopped%s", self.core.agent_id[:12],
                         f"; the stage(s) it hosted go with it: {', '.join(hosted)}" if hosted else "")

    def stop(self) -> None:
        self._stopping.set()

    def check_certificates(self, now: datetime.datetime) -> None:
        """Log a WARNING for this PC's certificate and for the fleet CA in the state folder when either runs out
        within pki.EXPIRY_WARNING_DAYS of `now` (an ERROR once it has), naming the day and the fix: nothing renews
        them, and on that day every link of this PC fails."""
        for expired, text in self._certificate_notices(now):
            log.log(logging.ERROR if expired else logging.WARNING, "%s", text)

    # Private methods

    def _log_settings(self) -> None:
        """Say which settings the agent runs on: the file read, or that there is none (the defaults), and warn of
        a file beside it that looks meant to be it (a misnamed file applied nothing, and said nothing)."""
        if self.paths.settings_file.is_file():
            log.info("settings: %s", self.paths.settings_file)
        else:
            log.info("settings: the defaults (no %s)", self.paths.settings_file)
        for misnamed in misnamed_settings_files(self.paths.settings_dir):
            log.warning("%s is not read: the agent reads its settings from %s alone (rename it, and restart the "
                        "agent)", misnamed, self.paths.settings_file)

    def _log_pause(self) -> None:
        """Say so in the log when this PC starts paused: it is never planned, and nothing else would tell an
        admin reading the log why."""
        if self.core.settings.paused:
            log.info("this PC is paused by its settings (paused: true in %s): it serves no model",
                     self.paths.settings_file)
        elif self.core.policy().paused:  # its user's, or an unreadable opt-out file's (core.paused_by says which)
            log.info("this PC is paused %s: it serves no model", self.core.paused_by())

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        # SIGHUP too: a terminal or SSH session that closes sends it to an agent started from it, whose default
        # ended the process on the spot (stages, links and the lock file as they were)
        for signum in stopping_signals():
            try:
                loop.add_signal_handler(signum, self.stop)
            except (NotImplementedError, RuntimeError):  # Windows, or not the main thread
                pass
        # Windows: closing the console, logging off or shutting down sends CTRL_BREAK / CTRL_CLOSE, which Python
        # delivers as SIGBREAK; its default ends the process on the spot, stages, links and lock file as they
        # are. Stop as on Ctrl-C instead (Windows gives a console process a few seconds for it).
        sigbreak = getattr(signal, "SIGBREAK", None)
        if sigbreak is not None:
            try:
                signal.signal(sigbreak, lambda signum, frame: loop.call_soon_threadsafe(self.stop))
            except ValueError:  # not the main thread
                pass

    @contextlib.contextmanager
    def _data_dir_lock(self) -> Iterator[None]:
        """Hold the state folder's lock while serving: a second agent on the same data dir (same identity,
        cache and state) refuses to start instead of taking turns with the first at the controller."""
        path = self.paths.state_dir / LOCK_FILE
        def refusal(pid: str, holder: str) -> OSError:
            if holder == JOIN_HOLDER:
                return OSError(f"a `deskfleet-agent join` runs on {self.paths.state_dir} (pid {pid}): start the agent "
                               "once it has finished")
            return OSError(f"{self.paths.state_dir} is in use by another agent (pid {pid}): stop it, or give this one "
                           "a --data-dir of its own")

        with pid_lock(path, refusal, AGENT_HOLDER):
            yield

    async def _advertise_forever(self, host: str) -> None:
        """mDNS advertisement with the current state, refreshed every ADVERTISE_REFRESH_S (a status that
        cannot be read is logged, and the record read again at the next refresh). Advertising is a help, not
        a duty: a failure is logged and the agent goes on serving (registration still finds it)."""
        try:
            await self._advertise(host)
        except Exception:
            log.exception("mDNS advertisement stopped")

    async def _advertise(self, host: str) -> None:
        """This agent's record at the listen host's addresses, for as long as it serves (advertise.py's loop)."""
        any_interface = listens_everywhere(host)
        await advertise_while_serving(Announcement(
            port=lambda: self.bound_port, addresses=lambda: addresses_to_advertise(host), fixed=never_changes(host),
            record=self._current_record, refresh_s=lambda: ADVERTISE_REFRESH_S,
            name=f"{self.core.agent_id}.{SERVICE_TYPE}", doing="advertising", failing="mDNS advertisement", log=log,
            # a host name that does not resolve is a warning; no network yet is not
            no_address_level=logging.INFO if never_changes(host) or any_interface else logging.WARNING,
            clash_note=", and registration with the controller goes on", advertiser=Advertiser))

    async def _check_certificates_forever(self) -> None:
        while True:
            await asyncio.sleep(CERTIFICATE_CHECK_S)
            self.check_certificates(utc_now())

    def _certificate_notices(self, now: datetime.datetime) -> list[tuple[bool, str]]:
        """(whether it has run out, what to log) for this PC's certificate and the fleet CA, each that runs out within
        pki.EXPIRY_WARNING_DAYS; files that cannot be read now are left to the links, which name them."""
        join = self.join_command
        notices = []
        try:
            own, ca = self.files.own_identity().not_valid_after, self.files.ca_certificate().not_valid_after_utc
        except (OSError, pki.PkiError) as error:
            log.debug("cannot read this PC's certificates for their expiry: %s", error)
            return []
        if notice := pki.expiry_notice(own, now):
            notices.append((own < now, f"this PC's fleet certificate ({self.files.cert_path}) {notice}: nothing renews "
                                       f"it; join the fleet again with a new token from its admin: `{join}`"))
        if notice := pki.expiry_notice(ca, now):
            notices.append((ca < now, f"the fleet CA ({self.files.ca_path}) {notice}: nothing renews it; the fleet's "
                                      "admin must make a new fleet (`deskfleet fleet init --force`), then join this PC "
                                      f"to it with a new token: `{join}`"))
        return notices

    async def _sweep_idle_forever(self) -> None:
        async def sweep() -> None:
            await self.core.release_idle_micro_batches()
            await self.core.close_unused_next_hops()  # one a step re-opened while its stage was being released
            await self.core.trim_idle_stages()

        await _periodically(lambda: IDLE_SWEEP_S, "free idle micro-batches and idle stages' call buffers", sweep)

    async def _enforce_limits_forever(self) -> None:
        """Give the stages up when the PC has been on battery or too hot for too long (AgentCore.enforce_limits);
        a sensor read that fails is logged and read again at the next check."""
        await _periodically(lambda: LIMITS_CHECK_S, "check the PC against its limits", self.core.enforce_limits)

    async def _publish_status_forever(self) -> None:
        """Keep this PC's status for the tray (status_file.py) written: at once, then looked at every STATUS_CHECK_S,
        written when what the tray shows changed or HEARTBEAT_S passed."""
        await _periodically(lambda: STATUS_CHECK_S, "write this PC's status for its tray", self.publish_status,
                            at_once=True)

    async def publish_status(self) -> bool:
        """One look at the status for the tray, written where it shows a change; False when the write failed. A
        failed write (a full or read-only disk) is a warning the first time, and for each new kind of failure; the
        write that works again says so. Anything else a look raises is _periodically's to log."""
        published = PublishedStatus(await self.core.local_status(), self.core.agent_id, os.getpid(), self._started_at,
                                    self.core.pause_source(), self._registration is not None,
                                    self.core.policy().release_stages_after_s)
        if not shows_a_change(self._status_written, published):
            return True
        try:  # in a thread: on Windows a rename onto a file the tray is reading waits for it (atomic_file)
            await asyncio.to_thread(write_status_file, self.paths.state_dir, published)
        except (OSError, ValueError) as error:
            kind = (type(error), getattr(error, "errno", None))  # the message names a temporary file's random name
            if kind != self._status_unwritten:
                log.warning("cannot write this PC's status for its tray (%s): the tray shows the last one written, "
                            "and the agent goes on serving", error)
            self._status_unwritten = kind
            return False
        self._status_written = published
        if self._status_unwritten is not None:
            log.info("this PC's status is written for its tray again")
            self._status_unwritten = None
        return True

    async def _stop_when_asked_forever(self) -> None:
        """Stop as on Ctrl-C once asked to through the state folder (stop_request.py: `deskfleet-agent stop`, and
        Windows' autostart, which has no signal to send a process with no console)."""
        await _periodically(lambda: STOP_CHECK_S, "look for a request to stop", self.stop_if_asked)

    async def stop_if_asked(self) -> bool:
        """Stop where a request for this process is in the state folder; whether it was."""
        # in a thread: on Windows a read of a file being renamed over waits for the rename (atomic_file)
        if not await asyncio.to_thread(self._stop_watch.asked):
            return False
        log.info("stopping: asked to through %s (`deskfleet-agent stop`, or autostart)",
                 self.paths.state_dir / STOP_REQUEST_FILE)
        clear_stop_request(self.paths.state_dir)
        self.stop()
        return True

    async def _call_in_when_available_forever(self) -> None:
        """Tell the controller when this PC can take stages again (CallInWatch): a pause its user ended, a PC
        plugged in again or cooled down. A re-plan that went on without it is then undone by the next fleet run,
        which, before, waited for this agent's next restart or an admin's `fleet deploy`."""
        await _periodically(lambda: AVAILABILITY_CHECK_S, "check whether this PC is available again",
                            self.call_in_if_available_again)

    async def call_in_if_available_again(self, now: float | None = None) -> bool:
        """One look (AVAILABILITY_CHECK_S); True when it called in: its Register sent again on the registration
        link. Without a live link the next registration says it, as every registration does."""
        mark = self.core.call_in.mark()
        available = await self.core.takes_stages_now()
        if not self.core.call_in.update(available, time.monotonic() if now is None else now, mark):
            return False
        link = self._registration
        if link is None:
            return False
        message = self._register_message(link)
        try:
            await link.send(message)
        except LinkError as error:  # the registration loop hears of the link's end and registers again
            log.info("cannot tell the controller this PC is available again: %s", error)
            return False
        self._told_addresses = message.listen_addresses
        # said also where a re-plan placed it again meanwhile: the runs of another model, or another run of this one
        # (whose re-plan a PC it lost is kept out of until it calls in), may still have it left out
        log.info("available again: told the controller at %s (the runs that left this PC out may take it back)",
                 link.address)
        return True

    async def _tell_address_changes_forever(self) -> None:
        await _periodically(lambda: ADDRESS_CHECK_S, "look whether this PC's addresses changed",
                            self.tell_address_change)

    async def tell_address_change(self) -> bool:
        """One look (ADDRESS_CHECK_S): where the addresses this agent would register now differ from those it
        registered on its live registration link, it says them (AddressesChanged), and True. A rotated IPv6 address,
        or its other family's renewed, stayed in the roster until the link dropped (the address the controller
        reached it at keeps the link up), and a stage before it of that family alone was given the stale one. Without
        a live link the next registration says them."""
        link = self._registration
        if link is None:
            return False
        addresses = self._register_message(link).listen_addresses
        if addresses == self._told_addresses:
            return False
        try:
            await link.send(AddressesChanged(addresses))
        except LinkError as error:  # the registration loop hears of the link's end and registers again
            log.info("cannot tell the controller this PC's addresses changed: %s", error)
            return False
        log.info("this PC's addresses changed: sent them to the controller at %s: now %s (was %s)", link.address,
                 ", ".join(addresses), ", ".join(self._told_addresses))
        self._told_addresses = addresses
        return True

    async def _current_record(self) -> AgentRecord | None:
        """The record to advertise now, or None (logged) when the status cannot be read this time: the
        advertisement keeps its last record and tries again at the next refresh."""
        try:
            return await self._record()
        except (OSError, ValueError) as error:
            log.warning("cannot refresh the mDNS record: %s", error)
            return None

    async def _record(self) -> AgentRecord:
        report = await self.core.status()
        return AgentRecord(self.core.agent_id, self.membership.fleet_id, software_version(),
                           device_targets(self.settings.device), report.free_memory_bytes, report.state)

    async def _register_forever(self) -> None:
        """Register, serve the controller link until it closes, and register again, backing off from
        RETRY_MIN_S to RETRY_MAX_S while the controller cannot be reached. An outage is logged once, when
        its first attempt fails, and once more when the agent is registered again (attempts and seconds):
        the failures between are debug lines, not a warning every retry for as long as the controller is off."""
        delay = RETRY_MIN_S
        told_removed = removed = False
        self._outage = outage = _Outage()
        search_after = 0.0  # time.monotonic() of the next look for a moved controller over mDNS
        while True:
            answered = False  # whether the controller answered at an address this pass (a refusal too: it is there)
            # those of a family this PC has none of fail at once, and said so as an outage at every start
            addresses = self.membership.controller_addresses
            for address in dialable_here(list(addresses)) or addresses:
                try:
                    link = await open_link(address, self.files, expected_agent_id=self.membership.controller_id)
                except LinkRefused as error:
                    answered = True  # an HTTP answer comes after TLS proved the pinned controller key: it is there
                    expired = [text for ran_out, text in self._certificate_notices(utc_now()) if ran_out] \
                        if error.status == HTTPStatus.FORBIDDEN and not told_removed else []
                    if expired:  # not removed: the controller refuses a certificate (or a CA) that ran out
                        told_removed = True
                        log.error("the controller refuses this PC: %s", "; ".join(expired))
                    elif error.status == HTTPStatus.FORBIDDEN and not error.removed:
                        outage.failed(error)  # a date (a clock on either side), not a removal: tried again as usual
                    elif error.status == HTTPStatus.FORBIDDEN and not told_removed:  # said once, not every retry
                        told_removed = removed = True
                        # its stages too: no PC of the fleet takes its links any more, and they held the memory
                        released = await self.core.give_up_stages("this PC was removed from the fleet", for_good=True)
                        note_removed(self.paths.state_dir, utc_now().isoformat(timespec="seconds"))
                        log.error("the controller refuses this PC (%s): it was removed from the fleet and serves no "
                                  "one (%d stage(s) released; asking again every %.0f minutes); to serve again, "
                                  "delete %s and join with a new token", error, len(released), REMOVED_RETRY_S / 60,
                                  self.files.key_path)
                    elif error.status != HTTPStatus.FORBIDDEN:
                        outage.failed(error)
                    continue
                except LinkError as error:
                    outage.failed(error)
                    continue
                told_removed = removed = False
                answered = True
                forget_removed(self.paths.state_dir)  # taken: not removed (a refusal it read as one was not)
                started = time.monotonic()
                await self._registered(link)
                if time.monotonic() - started >= REGISTERED_STABLE_S:
                    delay = RETRY_MIN_S  # a link that closes at once (e.g. another agent of this id) backs off
            if not answered and time.monotonic() >= search_after:
                search_after = time.monotonic() + CONTROLLER_SEARCH_INTERVAL_S
                try:
                    moved = await self._find_moved_controller()
                except Exception:  # what a hostile announcement did to the search must not end registration
                    log.exception("the search for the controller over mDNS failed")
                    moved = None
                if moved is not None:
                    told_removed = removed = False
                    await self._registered(moved)
                    delay = RETRY_MIN_S
                    continue  # the membership's addresses again, the found one first when it was saved
            await asyncio.sleep(REMOVED_RETRY_S if removed else delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _find_moved_controller(self) -> Link | None:
        """A link to this fleet's controller at an address its mDNS announcement gives, or None.

        When the announcement lists an address of the membership, the controller did not move (it was restarting,
        or answers again): that address is dialed and membership.json is left as it is. Otherwise the addresses it
        gives are dialed at once and the first that answers is saved first in membership.json (the controller
        got a new address, or its data dir moved to another PC). TLS pins the controller id, so a false
        announcement costs a failed dial, and all of them together at most link.OPEN_TIMEOUT_S."""
        membership = self.membership
        found = dialable_here(await find_controller(membership.fleet_id, membership.controller_id,
                                                    self.controller_search_interfaces()))
        known = [address for address in found if address in membership.controller_addresses]
        link = await self._dial_first(known or found)
        if link is None or known:
            return link
        self.membership = replace(membership, controller_addresses=addresses_after_move(
            link.address, membership.controller_addresses))
        try:
            self.membership.save(self.paths.state_dir)
            saved = f"saved first in {self.paths.state_dir / MEMBERSHIP_FILE}"
        except OSError as error:
            saved = f"not saved ({error}): used until this agent stops"
        log.warning("the controller no longer answers at %s; its mDNS announcement gives %s, where it "
                    "answered: that address is %s", ", ".join(membership.controller_addresses), link.address, saved)
        return link

    async def _dial_first(self, addresses: list[str]) -> Link | None:
        """A link to the controller at the first of `addresses` to answer, all dialed at once (a black-holed one
        costs no more than the others' time); None when none does. The others are cancelled or closed."""
        if not addresses:
            return None

        def failed(address: str, error: LinkError) -> None:
            log.info("the controller's mDNS announcement gives %s, which did not answer: %s", address, error)

        try:
            return await open_first(addresses, lambda address: open_link(
                address, self.files, expected_agent_id=self.membership.controller_id), 0.0, failed)
        except LinkError:  # each logged
            return None

    async def _registered(self, link: Link) -> None:
        """Say where we listen, then serve the link like any controller link until it closes."""
        outage = self._outage
        message = self._register_message(link)
        try:
            await link.send(message)
        except LinkError as error:
            outage.failed(error)
            return
        log.info("registered with the controller at %s as %s%s", link.address, message.listen_addresses[0],
                 outage.ended())
        self.core.call_in.registered(time.monotonic())
        self._registration, self._told_addresses = link, message.listen_addresses
        try:
            await self.core.serve_link(link, registration=True)
        finally:
            self._registration = None
        log.warning("the controller link closed; registering again")
        outage.began()

    def _register_message(self, link: Link) -> Register:
        """This agent's Register on `link`: where it listens, as the controller reaches it first, then (listening on
        every interface) at its other LAN addresses, of both IP families: the controller gives them to the stage
        before this PC's, which dials one of a family its own PC has (a PC of both families registered at its IPv6
        address alone could never be dialled by an IPv4-only PC before it when mDNS did not reach the controller)."""
        host, _ = parse_address(self.listen)
        port = self.bound_port
        if port is None:
            raise RuntimeError("an agent registers once it listens")
        if not listens_everywhere(host):
            return Register(self.core.agent_id, (host_port(host, port),), self.membership.token_sha256)
        transport = link.connection.transport
        reached_from = stable_source(str(transport.get_extra_info("sockname")[0]),
                                     str(transport.get_extra_info("peername")[0]))
        reached = host_port(reached_from, port)
        if is_loopback_host(reached_from):  # a fleet on one PC: its LAN addresses go stale as a laptop moves
            return Register(self.core.agent_id, (reached,), self.membership.token_sha256)
        # the other family's address that routes towards the controller (or the default route): the reached one
        # stands for its own family, and the PC's other addresses are mostly virtual adapters' (a container bridge,
        # a VM host-only network) or temporary ones, which crowded out its LAN address (from an exploratory test)
        reached_ip = ipaddress.ip_address(reached_from)
        family = 4 if isinstance(reached_ip, ipaddress.IPv6Address) and reached_ip.ipv4_mapped else reached_ip.version
        other_families = sorted(self.listen_families - {family})
        sources = self._lan_sources() if other_families else {}
        others = [host_port(sources[other], port) for other in other_families if other in sources]
        return Register(self.core.agent_id, (reached, *others), self.membership.token_sha256)



def addresses_after_move(found: str, saved: tuple[str, ...]) -> tuple[str, ...]:
    """membership.json's controller addresses once the controller answered at `found` (its mDNS announcement's):
    that one first, then the saved ones. Beyond SAVED_CONTROLLER_ADDRESSES the oldest IP addresses go, never a
    host name: a DNS name given to `fleet init` follows the controller wherever it moves, so a few moves to new
    IP addresses must not push it out."""
    addresses = [found, *(address for address in saved if address != found)]
    while len(addresses) > SAVED_CONTROLLER_ADDRESSES:
        numeric = [index for index, address in enumerate(addresses) if index and _is_ip(parse_address(address)[0])]
        if not numeric:
            break
        del addresses[numeric[-1]]
    return tuple(addresses)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _periodically(interval: Callable[[], float], what: str, step: Callable[[], Awaitable[object]],
                        at_once: bool = False) -> None:
    """`step()` every `interval()` seconds (first at once where `at_once`) for as long as the agent runs. A step
    that fails is logged and run again at the next interval: a sensor that could not be read (OSError, ValueError)
    as a warning, anything else with its traceback the first time a failure of that kind occurs. A background check
    that raised ended the agent's TaskGroup, and with it the agent, for what one reading or one micro-batch got
    wrong."""
    seen: set[type[BaseException]] = set()
    while True:
        if not at_once:
            await asyncio.sleep(interval())
        at_once = False
        try:
            await step()
        except (OSError, ValueError) as error:
            log.warning("cannot %s: %s", what, error)
        except Exception as error:
            if type(error) in seen:
                log.debug("cannot %s: %s: %s", what, type(error).__name__, error)
            else:
                seen.add(type(error))
                log.exception("cannot %s (this agent goes on; logged once for each kind of failure)", what)

class _Outage:
    """The registration attempts that failed since the agent was last registered: the first is a warning, and so
    is the first of another kind (the controller, off at first, now answers but refuses this PC's protocol: the
    log said only "connection refused" while it refused every attempt for minutes), the others debug lines; the
    registration that ends them says how many and for how long."""

    def __init__(self) -> None:
        self.since: float | None = None  # time.monotonic() when the controller link was lost; None: registered
        self.attempts = 0
        # the kinds of failure warned of in this outage (_failure_kind): a set, as the attempts at a moved
        # controller's old and new addresses alternate between two kinds, and each pass warned twice
        self._warned: set[tuple[object, ...]] = set()

    def began(self) -> None:
        self.since, self.attempts, self._warned = time.monotonic(), 0, set()

    def failed(self, error: Exception) -> None:
        if self.since is None:
            self.began()
        self.attempts += 1
        kind = _failure_kind(error)
        if self.attempts == 1:
            log.warning("cannot register with the controller: %s; retrying every %.0f s at most, quietly until it "
                        "answers", error, RETRY_MAX_S)
        elif kind not in self._warned:
            log.warning("cannot register with the controller, now for another reason (attempt %d): %s",
                        self.attempts, error)
        else:
            log.debug("cannot register with the controller (attempt %d): %s", self.attempts, error)
        self._warned.add(kind)

    def ended(self) -> str:
        """' after ...' for the log line of the registration that ends an outage ('' when none failed)."""
        since, attempts = self.since, self.attempts
        self.since, self.attempts, self._warned = None, 0, set()
        if since is None or not attempts:
            return ""
        return f" (after {attempts} failed attempt{'s' if attempts != 1 else ''} over {time.monotonic() - since:.0f} s)"


def _failure_kind(error: Exception) -> tuple[object, ...]:
    """What tells two failed registrations apart for the log: the error's type, with the protocol a controller of
    another version speaks and the HTTP status of a refusal (a message's text differs from one try to the next:
    addresses, timings)."""
    return (type(error).__name__, getattr(error, "peer_protocol", None), getattr(error, "status", None))


class _Stop(Exception):
    """Raised inside the TaskGroup to cancel its tasks on a clean stop."""
