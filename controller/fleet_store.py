"""The controller's data dir: where the fleet CA, the join-token ledger, the revocation set and the
roster of enrolled agents live, and the file lock that keeps concurrent CLI commands consistent.

Layout (all JSON is versioned; private keys are mode 0600):
    ca.pem, ca-key.pem                 the fleet CA
    controller.pem, controller-key.pem the controller's own fleet certificate (role controller)
    fleet.json                         fleet name and the addresses agents reach the controller at
    tokens.json                        issued join secrets (sha256 only), uses left, expiry
    revoked.json                       agent ids removed from the fleet
    agents.json                        the roster: enrolled agents, their hostnames and last addresses
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from deskfleet.agent.link import TlsFiles
from deskfleet.common.atomic_file import write_atomic

log = logging.getLogger(__name__)

ENV_DATA_DIR = "DESKFLEET_CONTROLLER_DIR"
STORE_FORMAT = 1
DEFAULT_PORT = 7341


class FleetStoreError(RuntimeError):
    """The controller data dir is missing, unreadable or holds a malformed file (named)."""


@dataclass(frozen=True)
class RosterEntry:
    agent_id: str
    hostname: str
    enrolled_at: str  # ISO 8601 UTC
    addresses: tuple[str, ...] = ()  # where it last said it listens (Register)
    registered_at: str | None = None


def default_data_dir() -> Path:
    """--data-dir wins, then $DESKFLEET_CONTROLLER_DIR, then the platform's user data dir."""
    override = os.environ.get(ENV_DATA_DIR)
    if override:
        return Path(override)
    return Path(platformdirs.user_data_dir("deskfleet", appauthor=False)) / "controller"


class FleetStore:
    """Typed access to the files of one controller data dir."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    # Public methods: paths

    @property
    def tls_files(self) -> TlsFiles:
        return TlsFiles.in_folder(self.data_dir, "controller")

    @property
    def ca_key_path(self) -> Path:
        return self.data_dir / "ca-key.pem"

    def is_initialised(self) -> bool:
        return self.ca_key_path.is_file() and self.tls_files.exist()

    def require_initialised(self) -> None:
        if not self.is_initialised():
            raise FleetStoreError(f"{self.data_dir} holds no fleet: run `deskfleet fleet init` first "
                                  f"(or pass --data-dir / set {ENV_DATA_DIR})")

    # Public methods: JSON documents

    def read(self, name: str, default: object) -> object:
        """The body of `name` (e.g. "tokens"), or `default` when the file does not exist."""
        path = self.data_dir / f"{name}.json"
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return default
        except (OSError, ValueError) as error:
            raise FleetStoreError(f"{path} is unreadable or not JSON ({error}); fix or remove it") from None
        if not isinstance(document, dict) or document.get("format") != STORE_FORMAT or "body" not in document:
            raise FleetStoreError(f"{path} is not a deskfleet controller file of format {STORE_FORMAT}")
        return document["body"]

    def write(self, name: str, body: object) -> None:
        """Replace `name` atomically (a crash leaves the old file or the new one, never half)."""
        path = self.data_dir / f"{name}.json"
        text = json.dumps({"format": STORE_FORMAT, "body": body}, indent=2, sort_keys=True)
        write_atomic(path, text.encode("utf-8"))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the data dir's lock: read-modify-write of the JSON files must happen inside it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / ".lock", "a+b") as handle:
            _lock_file(handle.fileno())
            try:
                yield
            finally:
                _unlock_file(handle.fileno())

    # Public methods: the roster

    def roster(self) -> dict[str, RosterEntry]:
        body = self.read("agents", {})
        if not isinstance(body, dict):
            raise FleetStoreError(f"{self.data_dir / 'agents.json'} must hold an object of agents")
        entries: dict[str, RosterEntry] = {}
        for agent_id, fields in body.items():
            try:
                entry = RosterEntry(**{**fields, "addresses": tuple(fields.get("addresses", ()))})
            except TypeError as error:
                raise FleetStoreError(f"agents.json entry {agent_id[:12]} is malformed: {error}") from None
            entries[agent_id] = entry
        return entries

    def save_roster(self, entries: dict[str, RosterEntry]) -> None:
        self.write("agents", {agent_id: {**asdict(entry), "addresses": list(entry.addresses)}
                              for agent_id, entry in sorted(entries.items())})

    def resolve_agent(self, name: str) -> str:
        """An agent id from a full id, a unique id prefix (>= 4 characters) or a unique hostname."""
        roster = self.roster()
        if name in roster:
            return name
        matches = {agent_id for agent_id, entry in roster.items()
                   if (len(name) >= 4 and agent_id.startswith(name.lower())) or entry.hostname == name}
        if len(matches) == 1:
            return matches.pop()
        if matches:
            raise FleetStoreError(f"{name!r} matches {len(matches)} agents: give more of the agent id")
        from deskfleet.common.wire import is_agent_id

        if is_agent_id(name):
            return name
        raise FleetStoreError(f"no enrolled agent has the id or hostname {name!r} (see `deskfleet fleet ls`)")


# Public functions



# Private functions

if sys.platform == "win32":
    import msvcrt

    def _lock_file(descriptor: int) -> None:
        msvcrt.locking(descriptor, msvcrt.LK_LOCK, 1)

    def _unlock_file(descriptor: int) -> None:
        msvcrt.locking(descriptor, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _lock_file(descriptor: int) -> None:
        fcntl.flock(descriptor, fcntl.LOCK_EX)

    def _unlock_file(descriptor: int) -> None:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
