"""The controller's data dir: where the fleet CA, the join-token ledger, the revocation set and the
roster of enrolled agents live, and the file lock that keeps concurrent CLI commands consistent.

Layout (all JSON is versioned; private keys are mode 0600):
    ca.pem, ca-key.pem                 the fleet CA
    controller.pem, controller-key.pem the controller's own fleet certificate (role controller)
    fleet.json                         fleet name and the addresses agents reach the controller at
    tokens.json                        issued join secrets (sha256 only), uses left, expiry
    revoked.json                       agent ids removed from the fleet
    agents.json                        the roster: enrolled agents, their hostnames and last addresses
    deployments.json                   which agent holds which layers of each deployed model (fleet deploy)

Agents pin the CA (join tokens and their own copy of ca.pem) and the controller's key (registration), so
neither can be made again without every agent joining again; `fleet init` refuses a data dir holding any
file above. A missing controller.pem is issued again from the kept keys: its key is unchanged.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

import platformdirs
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deskfleet.agent.link import TlsFiles, utc_now
from deskfleet.agent.paths import SETTINGS_FILE
from deskfleet.agent.standing import MEMBERSHIP_FILE
from deskfleet.common import pki
from deskfleet.common.arguments import option_text
from deskfleet.common.atomic_file import write_atomic_together
from deskfleet.common.file_lock import lock_file, lock_holder, pid_lock, try_lock_file, unlock_file
from deskfleet.common.os_error_text import os_error_text
from deskfleet.common.wire import ProtocolError, Role, is_agent_id, parse_address

log = logging.getLogger(__name__)

ENV_DATA_DIR = "DESKFLEET_CONTROLLER_DIR"
STORE_FORMAT = 1
# What to do about a damaged controller file, and what removing it costs (a file not listed: fix or restore it;
# revoked.json's own message adds how to write it again, as removing it would let removed agents back in).
_FIXES = {
    "agents": "fix it, or remove it: `fleet ls` then lists each agent again only once it registers with `fleet serve` "
              "(when the agent starts or reconnects), its host shown as '?' until then",
    "deployments": "fix it, or remove it and deploy the models again",
    "tokens": "fix it, or remove it: every join token issued so far is then void (issue new ones with "
              "`deskfleet fleet token`)",
    "revoked": "how to mend it follows",  # fleet_ca._read_revoked says how (it said "restore it from a backup" twice)
}
DEPLOY_LOCK = ".deploy.lock"
SERVE_LOCK = ".serve.lock"
# the times of agents.json and deployments.json records that runs compare with one another (see FleetStore.stamp)
STAMPED_TIMES = ("registered_at", "replanned_at", "assigned_at", "rejoin_tried_at")
# what holds a lock, written in it for the next comer's message (`fleet init --force` holds both: a deploy or serve it
# refused was told a `fleet serve` or a deploy held them)
SERVE_HOLDER, DEPLOY_HOLDER, REPLACE_HOLDER, LOOK_HOLDER = "fleet serve", "deploy", "fleet init --force", "look"
LOOK_WAIT_S = 1.0  # how long a deploy waits out looks at its lock (each holds it for an instant)


class _LookHolds(Exception):
    """The deploy lock is held by a look at it (deploy_under_way), not by a deploy."""
DEFAULT_PORT = 7341
MIN_ID_PREFIX = 4  # characters of an agent id that `fleet remove` takes as a prefix of it
# The hostname of an agent the roster never saw join (one that joined a controller restored from an older backup
# since): shown, never matched as a name (`fleet remove '?'` removed such a PC for good)
UNKNOWN_HOSTNAME = "?"
# What `fleet init` writes (deployments.json comes later); .lock, .deploy.lock and .serve.lock are not: commands
# make them.
PEM_FILES = ("ca.pem", "ca-key.pem", "controller.pem", "controller-key.pem")
STORE_FILES = (*PEM_FILES, "fleet.json", "tokens.json", "revoked.json", "agents.json", "deployments.json")
_ROLES = {"ca.pem": "the fleet CA's certificate", "ca-key.pem": "the fleet CA's key",
          "controller.pem": "the controller's certificate", "controller-key.pem": "the controller's key"}
_RESTORE = {
    "ca.pem": "copy state/ca.pem from the data dir of any enrolled agent: the same file (a new one would change "
              "the fleet id that agents and join tokens pin)",
    "ca-key.pem": "restore it from a backup; without it no agent can join, and `deskfleet fleet init --force` "
                  "makes a new fleet that every agent must join again",
    "controller.pem": "once the keys are in place, the next fleet command issues it again",
    "controller-key.pem": "restore it from a backup (every agent pins it), or `deskfleet fleet init --force` "
                          "makes a new fleet that every agent must join again",
}
_REISSUE = "delete it, and the next fleet command issues it again from the kept keys"
_T = TypeVar("_T")
_WARNED_MODES: set[Path] = set()  # what _warn_if_others_can_read said already in this process


class FleetStoreError(RuntimeError):
    """The controller data dir is missing, unreadable or holds a malformed file (named)."""


@dataclass(frozen=True)
class RosterEntry:
    agent_id: str
    hostname: str
    enrolled_at: str  # ISO 8601 UTC
    addresses: tuple[str, ...] = ()  # where it last said it listens (Register)
    registered_at: str | None = None


def agent_label(agent_id: str, hostnames: Mapping[str, str]) -> str:
    """How messages name an agent: its id's first 12 characters, and the hostname it enrolled with where known
    ("agent 3f2a9b8c1d0e on alice-pc"): an admin knows the desk by the name, the fleet by the id."""
    hostname = hostnames.get(agent_id)
    return f"agent {agent_id[:12]} on {hostname}" if hostname else f"agent {agent_id[:12]}"


def default_data_dir() -> Path:
    """--data-dir wins, then $DESKFLEET_CONTROLLER_DIR, then the platform's user data dir."""
    override = os.environ.get(ENV_DATA_DIR)
    if override is not None and not override.strip():  # as --data-dir "" is refused: not the platform's folder
        raise FleetStoreError(f"${ENV_DATA_DIR} is set but empty (an unset variable?): give it the controller's data "
                              "dir, or unset it for the platform's own")
    if override:
        return Path(override)
    return Path(platformdirs.user_data_dir("deskfleet", appauthor=False)) / "controller"


def check_data_dir(data_dir: Path) -> Path:
    """`data_dir`, or FleetStoreError naming it when it cannot be a folder: it, or the nearest part of its path
    that exists, is a file (creating it raised a bare FileExistsError or NotADirectoryError)."""
    for part in (data_dir, *data_dir.parents):
        if part.is_dir():
            return data_dir
        if part.exists() or part.is_symlink():
            what = "a file" if part.exists() else "a link to nothing"
            where = f"is {what}, not a folder" if part == data_dir else f"cannot be made: {part} is {what}"
            raise FleetStoreError(f"the controller data dir {data_dir} {where} (--data-dir or ${ENV_DATA_DIR} "
                                  "names a folder, new or a fleet's)")
    return data_dir


class FleetStore:
    """Typed access to the files of one controller data dir."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    # Public methods: paths

    @property
    def data_dir_option(self) -> str:
        """" --data-dir D" where this is not the data dir a command finds by itself (default_data_dir()), else "":
        a command an error tells the admin to run, said so that it acts on this data dir."""
        try:
            default = default_data_dir()
        except FleetStoreError:  # the variable set but empty: the option says where
            default = None
        return "" if self.data_dir == default else f" {option_text('--data-dir', str(self.data_dir))}"

    @property
    def tls_files(self) -> TlsFiles:
        return TlsFiles.in_folder(self.data_dir, "controller")

    @property
    def ca_key_path(self) -> Path:
        return self.data_dir / "ca-key.pem"

    def existing_files(self) -> list[str]:
        """The names of STORE_FILES the data dir holds (any one means a fleet lives, or lived, there)."""
        return [name for name in STORE_FILES
                if (self.data_dir / name).exists() or (self.data_dir / name).is_symlink()]

    def refuse_agent_folder(self) -> None:
        """FleetStoreError where the data dir is an agent's (its --data-dir, or its state or settings folder):
        `fleet init` made a fleet there, beside a running agent's keys, after `fleet ls` said to (the agent's
        own `join` then refused the folder as a controller's), and `fleet serve` on an agent's state folder was
        told to `fleet init --force` there."""
        for relative, what in ((f"state/{MEMBERSHIP_FILE}", "an agent's data dir"),
                               ("state/agent-key.pem", "an agent's data dir"),
                               (f"settings/{SETTINGS_FILE}", "an agent's data dir"),
                               (MEMBERSHIP_FILE, "an agent's state folder"),
                               ("agent-key.pem", "an agent's state folder"),
                               (SETTINGS_FILE, "an agent's settings folder")):
            if not os.path.lexists(self.data_dir / relative):
                continue
            present = self.existing_files()
            if "/" not in relative:  # the agent's own state folder, which keeps its copy of the fleet's ca.pem
                present = [name for name in present if name != "ca.pem"]
            if present:  # one an earlier deskfleet let `fleet init` share with an agent
                raise FleetStoreError(
                    f"{self.data_dir} holds both an agent's files ({relative}) and a controller's "
                    f"({', '.join(present)}): move the controller's files into a folder of their own and give that "
                    f"as --data-dir (or set {ENV_DATA_DIR}); the fleet, its CA and its PCs stay as they are")
            raise FleetStoreError(f"{self.data_dir} is {what} (it holds {relative}), not a controller's: give the "
                                  f"controller a --data-dir of its own (or set {ENV_DATA_DIR})")

    def require_initialised(self) -> None:
        """Raise FleetStoreError unless the data dir holds a whole fleet: its keys and certificates load and
        belong together. The error names the file and how to recover it. A missing controller.pem is issued
        again from the kept keys (agents pin the CA and the controller's key, not this certificate)."""
        self.refuse_agent_folder()
        present = self.existing_files()
        if not present:
            raise FleetStoreError(f"{self.data_dir} holds no fleet: run `deskfleet fleet init{self.data_dir_option}` "
                                  f"first (or pass --data-dir / set {ENV_DATA_DIR} for another)")
        missing = [name for name in PEM_FILES if name not in present]
        if missing and missing != ["controller.pem"]:
            raise FleetStoreError(f"{self.data_dir} lacks " + "; ".join(f"{name} ({_ROLES[name]})" for name in missing)
                                  + ". " + " ".join(f"{name}: {_RESTORE[name]}." for name in missing))
        files = self.tls_files
        self._warn_if_others_can_read()
        ca = pki.FleetCa(self._load(files.ca_path, pki.load_certificate_pem),
                         self._load(self.ca_key_path, pki.load_private_key_pem))
        if _public_key_der(ca.certificate) != _public_key_der(ca.private_key):
            raise FleetStoreError(f"{files.ca_path} is not the certificate of {self.ca_key_path}: "
                                  f"{_RESTORE['ca.pem']}")
        controller_key = self._load(files.key_path, pki.load_private_key_pem)
        if missing:
            self._reissue_controller_certificate(ca, controller_key)
        certificate = self._load(files.cert_path, pki.load_certificate_pem)
        try:
            if _public_key_der(certificate) != _public_key_der(controller_key):
                raise pki.PkiError(f"it is not the certificate of {files.key_path}")
            if pki.verify_certificate(certificate, ca.certificate, utc_now()).role is not Role.CONTROLLER:
                raise pki.PkiError("it is not a controller's certificate")
        except pki.CertificateExpired as error:  # its message names the day and the fix (a new fleet for the CA)
            path, role = (files.ca_path, "ca.pem") if error.is_ca else (files.cert_path, "controller.pem")
            raise FleetStoreError(f"{path} ({_ROLES[role]}): {error}") from None
        except pki.PkiError as error:
            raise FleetStoreError(f"{files.cert_path} ({_ROLES['controller.pem']}): {error}; {_REISSUE}") from None

    # Public methods: JSON documents

    def read(self, name: str, default: object) -> object:
        """The body of `name` (e.g. "tokens"), or `default` when the file does not exist."""
        path = self.data_dir / f"{name}.json"
        fix = _FIXES.get(name, "fix it, or restore it from a backup")
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return default
        except PermissionError as error:  # the file is whole: "restore it from a backup" was the wrong way out
            raise FleetStoreError(f"cannot read {path} ({error.strerror}): run deskfleet as the user that owns the "
                                  "data dir") from None
        except (OSError, ValueError) as error:
            raise FleetStoreError(f"{path} is unreadable or not JSON ({error}); {fix}") from None
        except RecursionError:
            raise FleetStoreError(f"{path} is not a deskfleet controller file: its JSON nests too deeply; "
                                  f"{fix}") from None
        if not isinstance(document, dict) or document.get("format") != STORE_FORMAT or "body" not in document:
            raise FleetStoreError(f"{path} is not a deskfleet controller file of format {STORE_FORMAT}")
        return document["body"]

    def write(self, name: str, body: object) -> None:
        """Replace `name` atomically (a crash leaves the old file or the new one, never half); FleetStoreError
        naming the file when it cannot be written (a full disk, a read-only data dir): the old file is kept."""
        self.write_files([self.document(name, body)])

    def stamp(self, now: datetime.datetime) -> datetime.datetime:
        """`now`, or a millisecond past the newest time on record (STAMPED_TIMES) where that is later: the times a
        run compares (a PC's call-in against a re-plan, an assignment, a run's try to take it back) keep the order of
        what happened whatever the clock did. A controller's clock stepped back 5 minutes recorded a PC's call-in
        before the re-plan that had left it out, and no run took it back until it called in again (one that ran a
        day ahead and was set right, the other way round). A file that cannot be read adds nothing."""
        newest = now
        try:
            roster = self.read("agents", {})
            deployments = self.read("deployments", {})
        except FleetStoreError as error:
            log.debug("stamped by the clock alone: %s", error)
            return now
        records = [*(roster.values() if isinstance(roster, dict) else ()),
                   *(deployments.values() if isinstance(deployments, dict) else ())]
        for record in records:
            for field in STAMPED_TIMES:
                text = record.get(field) if isinstance(record, dict) else None
                try:
                    when = datetime.datetime.fromisoformat(text) if isinstance(text, str) else None
                except ValueError:
                    continue
                if when is not None and when.tzinfo is not None and when >= newest:
                    newest = when + datetime.timedelta(milliseconds=1)
        return newest

    def document(self, name: str, body: object) -> tuple[Path, bytes]:
        """The file `write(name, body)` writes, and its bytes."""
        text = json.dumps({"format": STORE_FORMAT, "body": body}, indent=2, sort_keys=True)
        return self.data_dir / f"{name}.json", text.encode("utf-8")

    def write_file(self, path: Path, data: bytes) -> None:
        """write_atomic, with an OSError (a full disk, a read-only data dir) as FleetStoreError naming `path`:
        it raised as a traceback from `fleet token`, `fleet remove` and `fleet deploy`."""
        self.write_files([(path, data)])

    def write_files(self, files: list[tuple[Path, bytes]]) -> None:
        """Write `files` (path, bytes) together (write_atomic_together: each staged whole before the first is
        renamed into place), FleetStoreError naming the data dir, or the one file, on an OSError: all are unchanged."""
        try:
            write_atomic_together(files)
        except OSError as error:
            what = files[0][0] if len(files) == 1 else f"the files of {self.data_dir}"
            raise FleetStoreError(f"cannot write {what}: {error.strerror or error}; it is unchanged (free some "
                                  "disk space, or make the data dir writable, then run the command again)") from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the data dir's lock: read-modify-write of the JSON files must happen inside it."""
        path = self.data_dir / ".lock"
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+b")  # closed below; the OSError of opening it is named
        except OSError as error:
            raise FleetStoreError(f"cannot open the data dir's lock file: {os_error_text(error)}") from None
        with handle:
            if not try_lock_file(handle.fileno()):  # held a moment by another command, or by one that is stopped
                log.warning("waiting for the data dir's lock %s, which another deskfleet command holds (pid %s)",
                            path, lock_holder(handle)[0])
                lock_file(handle.fileno())
            try:
                with contextlib.suppress(OSError):  # for the next comer's message: the lock holds without it
                    handle.seek(0)
                    handle.truncate()
                    handle.write(f"\n{os.getpid()}".encode("ascii"))
                    handle.flush()
                yield
            finally:
                unlock_file(handle.fileno())

    @contextlib.contextmanager
    def deploying(self) -> Iterator[None]:
        """Hold the data dir's deploy lock for a whole deploy (a failover's too), or raise FleetStoreError naming
        the pid of the deploy that holds it. Two at once pushed the same shards to an agent in interleaved
        chunks, and both failed ("chunk at offset 0 is out of order"). A look at the lock (deploy_under_way, which
        holds it for an instant) is waited out, up to LOOK_WAIT_S: it is no deploy."""
        deadline = time.monotonic() + LOOK_WAIT_S
        while True:
            try:
                with self._held(DEPLOY_LOCK, DEPLOY_HOLDER, self._deploy_refusal):
                    yield
                return
            except _LookHolds:
                if time.monotonic() >= deadline:
                    raise FleetStoreError(f"the deploy lock of {self.data_dir} was held by looks at it for "
                                          f"{LOOK_WAIT_S:g} s: deploy again") from None
                time.sleep(0.01)

    def deploy_under_way(self) -> bool:
        """Whether a deploy (an admin's, or a run's re-plan) holds the data dir's deploy lock now, found by taking it
        for an instant, as served() does, as a look (a deploy that starts in that instant waits it out); True also
        where its lock file cannot be opened (no deploy can run)."""
        try:
            with self._held(DEPLOY_LOCK, LOOK_HOLDER, lambda pid, holder: pid):
                return False
        except (FleetStoreError, OSError):
            return True

    def _deploy_refusal(self, pid: str, holder: str) -> str | Exception:
        if holder == LOOK_HOLDER:
            return _LookHolds()
        return self._replacing_now(pid, holder, "deploy") or f"another deploy from {self.data_dir} is running (pid " \
            f"{pid}): let it finish, then deploy again"

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Hold the data dir's serve lock while `fleet serve` runs, or raise FleetStoreError naming the pid of
        the serve that holds it. Two serves of one data dir (on two ports) both wrote the roster and told the
        agents of removals, each unaware of the other."""
        return self._held(SERVE_LOCK, SERVE_HOLDER, lambda pid, holder: self._replacing_now(pid, holder, "serve it") or
                          f"{self.data_dir} is served already by `deskfleet fleet serve` (pid {pid}): stop that one "
                          "first, or serve another data dir")

    def served(self) -> bool | None:
        """Whether a `fleet serve` runs on this data dir, found by taking its serve lock for an instant (a serve
        that starts in that instant is refused, naming this process: rare, and said); None where the lock file
        cannot be opened (a read-only data dir, a folder in its place): a warning's question, which failed `fleet ls`
        there, and `fleet token` after it had printed a token its ledger holds."""
        try:
            with self._held(SERVE_LOCK, LOOK_HOLDER, lambda pid, holder: pid):
                return False
        except FleetStoreError:
            return True
        except OSError as error:
            log.debug("cannot tell whether `fleet serve` runs on %s: %s", self.data_dir, error)
            return None

    @contextlib.contextmanager
    def replacing(self) -> Iterator[None]:
        """Hold the serve and deploy locks while `fleet init --force` replaces the fleet, or raise FleetStoreError
        naming the pid of the serve or deploy that runs on it (which would go on with the old CA and keys)."""
        with self._held(SERVE_LOCK, REPLACE_HOLDER, lambda pid, holder: self._replacing_now(pid, holder, "") or
                        f"{self.data_dir} is served by `deskfleet fleet serve` (pid {pid}): stop it before replacing "
                        "its fleet, then serve the new one"), \
                self._held(DEPLOY_LOCK, REPLACE_HOLDER, lambda pid, holder: self._replacing_now(pid, holder, "") or
                           f"a deploy from {self.data_dir} is running (pid {pid}): let it finish before replacing its "
                           "fleet"):
            yield

    def _replacing_now(self, pid: str, holder: str, then: str) -> str:
        """The refusal where the lock's holder is a `fleet init --force` (`then`: what to do once it has finished;
        "": another replacement, which has nothing to add); "" where it is not."""
        if holder != REPLACE_HOLDER:
            return ""
        return (f"`deskfleet fleet init --force` is replacing the fleet of {self.data_dir} (pid {pid}): "
                + (f"{then} once it has finished (every agent must join the new fleet)" if then else
                   "one replacement at a time"))

    # Public methods: the roster

    def roster(self) -> dict[str, RosterEntry]:
        """The enrolled agents by id; FleetStoreError naming agents.json and the field if one is malformed."""
        path = self.data_dir / "agents.json"
        body = self.read("agents", {})
        if not isinstance(body, dict):
            raise FleetStoreError(f"{path} must hold an object of agents")
        return {agent_id: _roster_entry(path, agent_id, entry) for agent_id, entry in body.items()}

    def hostnames(self) -> dict[str, str]:
        """Each enrolled agent's hostname, for messages (agent_label); {} when the roster cannot be read: a
        message then names agents by id alone, and whatever needs the roster says what is wrong with it."""
        try:
            return {agent_id: entry.hostname for agent_id, entry in self.roster().items()}
        except FleetStoreError as error:
            log.debug("agents named by id alone: %s", error)
            return {}

    def save_roster(self, entries: dict[str, RosterEntry]) -> None:
        self.write("agents", {agent_id: {**asdict(entry), "addresses": list(entry.addresses)}
                              for agent_id, entry in sorted(entries.items())})

    def resolve_agent(self, name: str, removed: Container[str] = ()) -> str:
        """An agent id from a full id, a unique id prefix (>= MIN_ID_PREFIX characters) or a unique hostname. A
        hostname that only agents in `removed` have gives one of them (removing it again says so). One that a
        removed agent and a live one share is refused, naming the live one's id: a PC removed and joined again keeps
        its name, but so does the other of two PCs that shared one, and which it is the roster cannot tell (taking
        the live one removed the second PC, for good, when the first was removed again by name)."""
        roster = self.roster()
        if name in roster:
            return name
        if name == UNKNOWN_HOSTNAME:
            raise FleetStoreError(f"{name!r} is how `fleet ls` shows a PC whose hostname this controller never learnt "
                                  "(it joined a controller restored from an older backup): give its agent id")
        matches = {agent_id for agent_id, entry in roster.items()
                   if (len(name) >= MIN_ID_PREFIX and agent_id.startswith(name.lower())) or entry.hostname == name}
        if len(matches) > 1 and all(roster[agent_id].hostname == name for agent_id in matches):  # one name, not
            # an id prefix (which could then pick an unrelated PC)
            live = sorted(agent_id for agent_id in matches if agent_id not in removed)
            if not live:  # every one removed: removing it again says so
                return sorted(matches)[0]
            if len(live) == 1:
                gone = ", ".join(agent_id[:12] for agent_id in sorted(matches) if agent_id not in live)
                raise FleetStoreError(f"{name!r} names agent {live[0][:12]}, and also {gone}, removed already: give "
                                      f"the id (`{live[0]}`) to say which is meant (a PC that joined again keeps "
                                      "its name, and so does another PC of the same name)")
        if len(matches) == 1:
            return matches.pop()
        if matches:
            listed = ", ".join(f"{agent_id[:12]} ({roster[agent_id].hostname})" for agent_id in sorted(matches)[:8])
            more = f" and {len(matches) - 8} more" if len(matches) > 8 else ""
            raise FleetStoreError(f"{name!r} matches {len(matches)} agents: {listed}{more}; give more of the agent id")
        if is_agent_id(name):
            return name
        if len(name) < MIN_ID_PREFIX and any(agent_id.startswith(name.lower()) for agent_id in roster):
            raise FleetStoreError(f"{name!r} is too short for a prefix of an agent id: give at least "
                                  f"{MIN_ID_PREFIX} characters of the id (see `deskfleet fleet ls`)")
        raise FleetStoreError(f"no enrolled agent has the id or hostname {name!r} (a prefix of an id needs at least "
                              f"{MIN_ID_PREFIX} characters; see `deskfleet fleet ls`)")

    # Private methods

    @contextlib.contextmanager
    def _held(self, name: str, holder: str, refusal: Callable[[str, str], str | Exception]) -> Iterator[None]:
        """Hold the lock file `name` in the data dir, writing this process's pid and `holder` (what holds it) after
        the locked first byte; FleetStoreError(refusal(the holder's pid, what holds it)) at once when another process
        holds it (the refusal itself where it is an exception)."""
        def refused(pid: str, other: str) -> Exception:
            said = refusal(pid, other)
            return said if isinstance(said, Exception) else FleetStoreError(said)

        self.data_dir.mkdir(parents=True, exist_ok=True)
        with pid_lock(self.data_dir / name, refused, holder):
            yield

    def _warn_if_others_can_read(self) -> None:
        """Warn (once per process and file) when a private key is open to other users than the owner: a backup
        restored from a zip or a USB stick, or copied by a tool that drops modes, left ca-key.pem 0644, and
        nothing said so (whoever reads it can sign certificates that every agent trusts). On Windows, where file
        modes mean nothing, see _warn_if_outside_profile."""
        if os.name == "nt":
            self._warn_if_outside_profile(os.environ.get("USERPROFILE"))
            return
        for path in (self.ca_key_path, self.tls_files.key_path):
            if (mode := pki.open_key_mode(path)) is not None and path not in _WARNED_MODES:
                _WARNED_MODES.add(path)
                harm = "make certificates that every agent trusts" if path == self.ca_key_path \
                    else "pose as this controller to every agent"
                log.warning("%s (%s) is open to other users (mode %03o): whoever reads it can %s; run `chmod 600 "
                            "%s`", path, _ROLES[path.name], mode, harm, path)

    def _warn_if_outside_profile(self, profile: str | None) -> None:
        """Windows: warn (once per process and data dir) when the data dir lies outside the user's profile
        folder. Its keys' modes say nothing there; a folder inside the profile is the user's alone (the default
        data dir is under %LOCALAPPDATA%), while one made elsewhere, such as C:\\deskfleet, inherits the drive
        root's permissions, which let every local user read it. A heuristic: an admin may have restricted the
        folder, and the warning says how."""
        if not profile or self.data_dir in _WARNED_MODES:
            return
        inside = os.path.normcase(os.path.abspath(self.data_dir)).startswith(
            os.path.normcase(os.path.abspath(profile)).rstrip("\\/") + os.sep)
        if not inside:
            _WARNED_MODES.add(self.data_dir)
            log.warning("the controller's data dir %s is outside your user profile (%s): on Windows such a folder "
                        "usually lets every local user read ca-key.pem, and whoever reads it can make certificates "
                        "that every agent trusts; keep the data dir under your profile, or restrict it: `icacls "
                        "\"%s\" /inheritance:r /grant:r \"%%USERNAME%%:(OI)(CI)F\"`", self.data_dir, profile,
                        self.data_dir)

    def _load(self, path: Path, parse: Callable[[bytes], _T]) -> _T:
        try:
            return parse(path.read_bytes())
        except PermissionError as error:  # the file is whole: restoring it, or `init --force`, would lose the fleet
            raise FleetStoreError(f"cannot read {path} ({_ROLES[path.name]}: {error.strerror}): run deskfleet as the "
                                  "user that owns the data dir") from None
        except (OSError, pki.PkiError) as error:
            advice = _REISSUE if path.name == "controller.pem" else _RESTORE[path.name]
            raise FleetStoreError(f"{path} ({_ROLES[path.name]}) is unreadable or damaged ({error}); "
                                  f"{advice}") from None

    def _reissue_controller_certificate(self, ca: pki.FleetCa, key: ec.EllipticCurvePrivateKey) -> None:
        """Sign controller.pem again for the kept controller key, as `fleet init` did (the same agent id)."""
        csr = pki.create_csr(key, socket.gethostname())
        certificate = pki.sign_csr(ca, csr, utc_now(), role=Role.CONTROLLER)
        self.write_file(self.tls_files.cert_path, pki.certificate_pem(certificate))
        log.warning("%s was missing: issued the controller a new certificate from the fleet CA for its kept "
                    "key (agents accept it; nothing else changed)", self.tls_files.cert_path)


# Private functions

def _public_key_der(holder: x509.Certificate | ec.EllipticCurvePrivateKey) -> bytes:
    """The SubjectPublicKeyInfo of a certificate's or a private key's public key."""
    return holder.public_key().public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)


def _roster_entry(path: Path, agent_id: object, entry: object) -> RosterEntry:
    """One agents.json entry, each field's type checked; FleetStoreError naming the file, agent and field."""
    def malformed(what: str) -> FleetStoreError:
        return FleetStoreError(f"{path}: agent {str(agent_id)[:12]}'s {what}; fix or remove the entry")

    if not isinstance(agent_id, str) or not is_agent_id(agent_id):
        raise FleetStoreError(f"{path}: {agent_id!r:.70} is not an agent id; fix or remove the entry")
    if not isinstance(entry, dict):
        raise malformed(f"entry must be an object, not {entry!r:.60}")
    names = {field.name for field in fields(RosterEntry)}
    unknown = sorted(set(entry) - names)
    if unknown:
        raise malformed(f"entry has unknown fields {unknown!r:.60}")
    for name in ("agent_id", "hostname", "enrolled_at"):
        if not isinstance(entry.get(name), str):
            raise malformed(f"{name} must be a string, not {entry.get(name)!r:.60}")
    if entry["agent_id"] != agent_id:
        raise malformed(f"agent_id {entry['agent_id']!r:.60} differs from the id it is filed under")
    registered_at = entry.get("registered_at")
    if registered_at is not None and not isinstance(registered_at, str):
        raise malformed(f"registered_at must be a string or null, not {registered_at!r:.60}")
    addresses = _dialable_addresses(entry.get("addresses", []), f"{path}: agent {agent_id[:12]}'s")
    return RosterEntry(agent_id, entry["hostname"], entry["enrolled_at"], addresses, registered_at)


_dropped_said: set[tuple[str, str]] = set()  # (where, address): a roster address left out, warned of once


def _dialable_addresses(value: object, where: str) -> tuple[str, ...]:
    """A roster entry's addresses, those that cannot be dialled left out with a warning (once a process): an agent
    registers only addresses parse_address takes, but a roster written before it checked as strictly may hold one,
    which failed every survey; the agent's next registration writes its addresses anew."""
    if not isinstance(value, list) or not all(isinstance(address, str) for address in value):
        raise FleetStoreError(f"{where} addresses must be a list of host:port strings, not {value!r:.60}")
    kept = []
    for address in value:
        try:
            parse_address(address)
        except ProtocolError as error:
            if (where, address) not in _dropped_said:
                _dropped_said.add((where, address))
                log.warning("%s address left out: %s", where, error)
            continue
        kept.append(address)
    return tuple(kept)


def checked_addresses(value: object, where: str) -> tuple[str, ...]:
    """A stored list of host:port addresses; FleetStoreError saying `where` it is when it is not one."""
    if not isinstance(value, list) or not all(isinstance(address, str) for address in value):
        raise FleetStoreError(f"{where} addresses must be a list of host:port strings, not {value!r:.60}")
    for address in value:
        try:
            parse_address(address)
        except ProtocolError as error:
            raise FleetStoreError(f"{where} addresses: {error}") from None
    return tuple(value)

