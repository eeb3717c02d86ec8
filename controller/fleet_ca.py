"""The controller as the fleet's certificate authority: init, join tokens, removal, enrollment.

- `init_fleet`: a new CA and the controller's own certificate in the data dir (keys 0600).
- `issue_token`: a join token (controller addresses + CA fingerprint + one-time secret), its secret's
  sha256 recorded in the persisted ledger.
- `remove_agent`: add an agent id to the persisted revocation set; `Revocations` re-reads it when the
  file changes, so a running controller drops a removed agent at once.
- `serve_enrollment`: the join exchange on a connection whose client has no certificate yet:
  JoinOffer -> JoinRequest(CSR + secret) -> JoinResponse(certificate). It acts on nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
import socket
from dataclasses import replace

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from deskfleet.agent.advertise import DEFAULT_ROUTE_PROBES, interface_addresses, route_source
from deskfleet.agent.enroll import REMOVED_KEY_ADVICE
from deskfleet.agent.link import utc_now
from deskfleet.common import join_tokens, pki
from deskfleet.common.log_limit import LogEvery
from deskfleet.common.wire import (
    Error,
    ErrorCode,
    JoinOffer,
    JoinRequest,
    JoinResponse,
    KnownRemovals,
    ProtocolError,
    RevocationUpdate,
    Role,
    decode,
    encode,
    host_port,
    is_agent_id,
    is_loopback_host,
    is_sha256_hex,
    parse_address,
)
from deskfleet.controller.fleet_store import DEFAULT_PORT, FleetStore, FleetStoreError, RosterEntry, checked_addresses

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
# An agent sends its JoinRequest as soon as it has checked the JoinOffer (milliseconds): a client that has not by
# then holds one of the few join slots (agent/link.py MAX_CONCURRENT_JOINS) for nothing.
JOIN_REQUEST_TIMEOUT_S = 5.0
HOSTNAME_MAX_CHARS = 200  # what the roster keeps of the hostname a joining agent gives
_DURATION = re.compile(r"([0-9]+)([smhd])")  # not \d: it takes other scripts' digits ("١d" was a day)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# Public functions: the CA

def init_fleet(store: FleetStore, fleet_name: str, addresses: tuple[str, ...], now: datetime.datetime,
               force: bool = False) -> pki.FleetCa:
    """Create the fleet CA and the controller certificate. Refuses a data dir that holds any of the store's
    files, a whole fleet or part of one (its CA key and roster would be lost), unless `force` (which would
    orphan every enrolled agent), and `force` is refused while `fleet serve` or a deploy runs on the data dir.
    The check and the writes hold the store's lock: of two concurrent inits, the second refuses."""
    pki.check_fleet_name(fleet_name)  # before anything is made
    for address in addresses:
        parse_address(address)
    store.refuse_agent_folder()  # with --force too: an agent's keys are not a fleet's to replace
    store.data_dir.mkdir(parents=True, exist_ok=True)
    store.data_dir.chmod(0o700)
    files = store.tls_files
    # --force under a running serve or deploy left it on the old CA: new tokens were refused by the old server
    # ("not issued by this fleet's CA") and the enrolled agents by the new store, and nothing named the cause
    with store.replacing() if force else contextlib.nullcontext(), store.locked():
        present = store.existing_files()
        if present and not force:
            try:
                store.require_initialised()
            except FleetStoreError as error:
                raise FleetStoreError(f"{store.data_dir} already holds part of a fleet ({', '.join(present)}): "
                                      f"{error} --force replaces it and every agent would have to join "
                                      "again") from None
            raise FleetStoreError(f"{store.data_dir} already holds a fleet (fleet id "
                                  f"{pki.fleet_id(store.tls_files.ca_certificate())}); --force replaces it and "
                                  "every agent would have to join again")
        ca = pki.create_fleet_ca(fleet_name, now)
        controller_key = pki.create_private_key()
        csr = pki.create_csr(controller_key, socket.gethostname())
        certificate = pki.sign_csr(ca, csr, now, role=Role.CONTROLLER)
        # written together (mode 0600, as every file): each staged whole before the first is renamed into place, so
        # a full disk, a kill or a Ctrl-C leaves the old files (or none) as they were. Written one by one, a fleet
        # killed halfway had a new CA key beside the old CA, which every command then said to restore from an agent
        try:
            store.write_files([(store.ca_key_path, _key_pem(ca.private_key)),
                               (files.key_path, _key_pem(controller_key)),
                               (files.ca_path, pki.certificate_pem(ca.certificate)),
                               (files.cert_path, pki.certificate_pem(certificate)),
                               store.document("fleet", {"name": fleet_name, "addresses": list(addresses)}),
                               store.document("tokens", []), store.document("revoked", []),
                               store.document("agents", {})])
        except FleetStoreError as error:
            raise FleetStoreError(f"no fleet was created in {store.data_dir}: {error}" if not present else
                                  f"the fleet in {store.data_dir} was not replaced: {error}") from None
    log.info("fleet %s initialised in %s", pki.fleet_id(ca.certificate), store.data_dir)
    return ca


def load_ca(store: FleetStore) -> pki.FleetCa:
    store.require_initialised()
    key = pki.load_private_key_pem(store.ca_key_path.read_bytes())
    return pki.FleetCa(store.tls_files.ca_certificate(), key)


def fleet_addresses(store: FleetStore) -> tuple[str, ...]:
    """The addresses fleet.json says agents reach the controller at; FleetStoreError naming the file if
    they are malformed."""
    path = store.data_dir / "fleet.json"
    body = store.read("fleet", {})
    if not isinstance(body, dict):
        raise FleetStoreError(f"{path} must hold an object with the fleet's name and addresses")
    return checked_addresses(body.get("addresses", []), f"{path}:")


def addresses_elsewhere(addresses: tuple[str, ...]) -> bool:
    """Whether none of `addresses` (host:port) names this PC: no IP of its interfaces, and no name that resolves to
    one. A controller moved to another address kept fleet.json's old ones, and `fleet token` put them in new tokens
    without a word (agents already joined find a moved controller over mDNS; a joining PC cannot)."""
    import psutil

    here = {str(entry.address).split("%", 1)[0] for entries in psutil.net_if_addrs().values() for entry in entries
            if entry.family in (socket.AF_INET, socket.AF_INET6)}
    for address in addresses:
        host = parse_address(address)[0]
        try:
            found = {str(info[4][0]).split("%", 1)[0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            continue  # a name that does not resolve here: not this PC's, as far as can be told
        if found & here or any(is_loopback_host(ip) for ip in found):  # 127.0.0.58 is this PC's, as 127.0.0.1 is
            return False
    return True


def default_address() -> str:
    """This machine's address on the network that reaches the default route, with the default port: its IPv4
    route's, else its IPv6 route's (an IPv6-only LAN: the IPv4 probe alone gave 127.0.0.1 there, in every token),
    else, on a LAN with no default route, its first interface address (IPv4 first), else loopback."""
    for family, target in DEFAULT_ROUTE_PROBES.values():
        host = route_source(family, target)
        if host is not None:
            return host_port(host, DEFAULT_PORT)
    here = interface_addresses()
    if here:
        return host_port(here[0], DEFAULT_PORT)
    return f"127.0.0.1:{DEFAULT_PORT}"


# Public functions: tokens and removal

def parse_duration(text: str) -> datetime.timedelta:
    """'24h', '30m', '7d', '90s' or a combination like '1d12h'; ValueError naming the text otherwise."""
    parts = _DURATION.findall(text.strip().lower())
    if not parts or "".join(number + unit for number, unit in parts) != text.strip().lower():
        raise ValueError(f"duration {text!r} is not like 24h, 30m, 7d or 90s")
    seconds = sum(int(number) * _UNITS[unit] for number, unit in parts)
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be longer than zero")
    if seconds > 100 * 366 * 86400:  # past what a timedelta holds (a traceback), and past any CA's life
        raise ValueError(f"duration {text!r} is longer than 100 years")
    return datetime.timedelta(seconds=seconds)


MAX_TOKEN_USES = 100_000  # a token's uses past this are refused: more PCs than any office fleet, a key for anyone
# who copies it


def issue_token(store: FleetStore, now: datetime.datetime, ttl: datetime.timedelta, uses: int,
                addresses: tuple[str, ...] = ()) -> join_tokens.JoinToken:
    """A new join token, recorded in the ledger (which keeps only its secret's sha256)."""
    store.require_initialised()
    addresses = addresses or fleet_addresses(store)
    if not addresses:
        path = store.data_dir / "fleet.json"
        if not path.exists():  # the addresses `fleet init --address` gave are in it: say so, not only the remedy
            raise FleetStoreError(f"{path} is missing: it held the addresses agents reach the controller at (`fleet "
                                  "init --address`); pass --address HOST:PORT, or restore the file from a backup")
        raise FleetStoreError("no controller address to put in the token: pass --address HOST:PORT")
    secret = join_tokens.new_secret()
    ca_certificate = store.tls_files.ca_certificate()
    ca_ends = ca_certificate.not_valid_after_utc
    if ttl > ca_ends - now:  # `--ttl 99999d` was valid until 2300: a join after the CA's end cannot be signed
        # (compared before now + ttl is made: 3000000d overflowed the year 9999 with a traceback)
        raise ValueError(f"--ttl {ttl.days} days reaches past the fleet CA's end on {ca_ends.date().isoformat()}, "
                         "after which no PC can join: give a shorter --ttl")
    expires_at = (now + ttl).replace(microsecond=0)
    token = join_tokens.JoinToken(addresses, pki.certificate_fingerprint(ca_certificate), secret, expires_at)
    join_tokens.encode_join_token(token)  # refuse an unencodable token before recording its secret
    with store.locked():
        ledger = _load_ledger(store)
        ledger.prune(now)
        ledger.issue(secret, expires_at, uses)
        _save_ledger(store, ledger)
    return token


def spend_token_again(store: FleetStore, digest: str, agent_id: str, now: datetime.datetime) -> bool:
    """join_tokens.TokenLedger.spend_again on tokens.json, under the data dir's lock; True when a use was spent.
    A token the ledger holds no use of to spend for `agent_id` (pruned, used up, expired, counted) costs no lock."""
    if not _load_ledger(store).spend_again(digest, agent_id, now):  # a dry run on a copy read without the lock
        return False
    with store.locked():
        ledger = _load_ledger(store)
        spent = ledger.spend_again(digest, agent_id, now)
        if spent:
            _save_ledger(store, ledger)
    return spent


def remove_agent(store: FleetStore, name: str) -> str:
    """Revoke the agent named by id, id prefix or hostname; return its agent id."""
    store.require_initialised()
    with store.locked():
        revoked = set(_read_revoked(store))
        agent_id = store.resolve_agent(name, removed=revoked)
        revoked.add(agent_id)
        store.write("revoked", sorted(revoked))
    return agent_id


def restore_removals(store: FleetStore, removals: KnownRemovals, known: pki.RevocationSet) -> list[str]:
    """verify_removals, then add_removals: the ids added to revoked.json."""
    verified = verify_removals(store.tls_files.ca_certificate(), removals, known)
    return add_removals(store, verified) if verified else []


def verify_removals(ca_certificate: x509.Certificate, removals: KnownRemovals, known: pki.RevocationSet) -> list[str]:
    """The removals an agent kept that `known` (the controller's list) lacks, each checked to be signed by this
    fleet's CA; PkiError names the first that is not (then none is to be taken)."""
    new = [(agent_id, signature) for agent_id, signature in zip(removals.agent_ids, removals.signatures, strict=True)
           if not known.is_revoked(agent_id)]
    for agent_id, signature in new:
        pki.check_removal(ca_certificate, agent_id, signature)
    return sorted({agent_id for agent_id, _ in new})


def add_removals(store: FleetStore, agent_ids: list[str]) -> list[str]:
    """Add `agent_ids` to revoked.json (under the data dir's lock); the ids it lacked."""
    with store.locked():
        revoked = set(_read_revoked(store))
        added = sorted(set(agent_ids) - revoked)
        if added:
            store.write("revoked", sorted(revoked | set(added)))
    return added


async def take_known_removals(store: FleetStore, revocations: Revocations, message: KnownRemovals,
                              sender: str) -> set[str] | None:
    """verify_removals and add_removals for what agent `sender` said, in threads (the data dir's lock is a
    blocking file lock), the outcome logged; `revocations` holds the removals verified from then on, written or
    not (a `fleet ls` that cannot write the data dir still leaves those PCs out). The removals verified, or
    None when one was not the CA's (the caller then ignores that sender's). One at a time per `revocations`:
    agents that register at once give back the same removals, checked once."""
    async with revocations.restoring:
        try:
            known = revocations()
            ca_certificate = store.tls_files.ca_certificate()
        except (pki.PkiError, FleetStoreError, OSError, ValueError) as error:  # ours, not the agent's fault
            log.error("cannot take the removals agent %s kept: %s", sender[:12], error)
            return set()
        try:
            verified = await asyncio.to_thread(verify_removals, ca_certificate, message, known)
        except pki.PkiError as error:
            log.warning("agent %s sent removals this fleet's CA did not sign (ignored, and any more it sends): %s",
                        sender[:12], error)
            return None
        if not verified:
            return set()
        revocations.given_back(set(verified))
        try:
            added = await asyncio.to_thread(add_removals, store, verified)
        except (OSError, FleetStoreError) as error:
            log.error("cannot add the removals agent %s kept to %s: %s", sender[:12], store.data_dir / "revoked.json",
                      error)
            return set(verified)
    if added:
        log.warning("agent %s keeps %d removal(s) signed by this fleet's CA that %s lacked (the data dir was restored "
                    "from an older backup?): removed again: %s", sender[:12], len(added),
                    store.data_dir / "revoked.json", ", ".join(agent_id[:12] for agent_id in added))
    return set(verified)


def _read_revoked(store: FleetStore) -> list[str]:
    """The removed agents' ids. `fleet init` writes the file, so a missing one was lost, not empty: reading it
    as "nobody removed" would let removed agents in again and tell every agent to forget them (they keep the
    controller's list), so it is refused like a damaged one."""
    path = store.data_dir / "revoked.json"
    restore = ("Restore it from a backup, or write it again with the removed agents' ids (each agent keeps a "
               'copy in its state folder, state/revoked.json): {"format": 1, "body": ["AGENT_ID", ...]}; '
               '"body": [] if no agent was ever removed')
    missing = object()
    try:
        body = store.read("revoked", missing)
    except FleetStoreError as error:  # its message says "fix it, or restore it from a backup": then how to write it
        raise FleetStoreError(f"{path} is damaged, and the list of agents removed from this fleet cannot be read: "
                              f"{error}. {restore}") from None
    if body is missing:
        raise FleetStoreError(f"{path} is missing: the list of agents removed from this fleet is lost, and serving "
                              f"without it would let them in again. {restore}")
    if not isinstance(body, list) or not all(isinstance(item, str) for item in body):
        raise FleetStoreError(f"{path} must hold a list of agent ids. {restore}")
    for item in body:
        if not is_agent_id(item):
            raise FleetStoreError(f"{path} lists {item[:60]!r}, which is not an agent id (52 characters a-z, 2-7). "
                                  f"{restore}")
    return body


class Revocations:
    """The persisted revocation set, re-read whenever revoked.json changes (cheap to call per link), with the
    removals agents gave back that this process verified (take_known_removals), held even where revoked.json
    could not take them. A missing or damaged file raises pki.PkiError naming it: every peer is then refused
    until it is restored."""

    def __init__(self, store: FleetStore) -> None:
        self.store = store
        self._stamp: tuple[int, int] | None = None
        self._from_file: frozenset[str] = frozenset()
        self._given_back: frozenset[str] = frozenset()
        self._current = pki.RevocationSet()
        self._ca: pki.FleetCa | None = None
        self._signatures: dict[str, bytes] = {}
        self.restoring = asyncio.Lock()  # take_known_removals, one at a time

    def __call__(self) -> pki.RevocationSet:
        path = self.store.data_dir / "revoked.json"
        try:
            status = path.stat()
            stamp = (status.st_mtime_ns, status.st_size)
        except FileNotFoundError:
            stamp = (0, 0)
        if stamp != self._stamp:
            try:
                self._from_file = frozenset(_read_revoked(self.store))
            except FleetStoreError as error:  # a peer is refused, naming why, until the file is back
                raise pki.PkiError(str(error)) from None  # it says what the list is and how to restore it
            self._stamp = stamp
            self._current = pki.RevocationSet(self._from_file | self._given_back)
        return self._current

    def given_back(self, agent_ids: set[str]) -> None:
        """Removals an agent gave back, their signatures checked: refused from now on by this process."""
        self._given_back |= agent_ids
        self._current = pki.RevocationSet(self._from_file | self._given_back)

    def update(self) -> RevocationUpdate:
        """The list as agents are told it: every id with the CA's signature of its removal (made once per id
        and kept; the CA key is read at the first). PkiError as for __call__, or when the CA key cannot be
        read."""
        revoked = sorted(self().agent_ids)
        unsigned = [agent_id for agent_id in revoked if agent_id not in self._signatures]
        if unsigned:
            try:
                ca = self._ca if self._ca is not None else load_ca(self.store)
            except (OSError, ValueError, FleetStoreError) as error:
                raise pki.PkiError(f"cannot sign the list of removed agents: the CA key "
                                   f"{self.store.ca_key_path} cannot be read ({error})") from None
            self._ca = ca
            self._signatures.update((agent_id, pki.sign_removal(ca, agent_id)) for agent_id in unsigned)
        return RevocationUpdate.of(revoked, [self._signatures[agent_id] for agent_id in revoked])


# Public functions: enrollment

JOIN_END_LOG_EVERY_S = 60.0  # a join the joining PC ended, saying why, is a warning once this often a host
_join_ends_said = LogEvery()  # by host
_join_refusals_said = LogEvery()  # by (host, kind of refusal)


async def serve_enrollment(connection: ServerConnection, store: FleetStore) -> None:
    """Run the join exchange with a certificate-less client, then close. Acts on nothing else."""
    remote = connection.remote_address
    try:
        async with asyncio.timeout(JOIN_TIMEOUT_S):
            await _join_exchange(connection, store)
    except TimeoutError:
        log.warning("join from %s timed out", remote)
        await connection.close(1008, "timeout")


async def _join_exchange(connection: ServerConnection, store: FleetStore) -> None:
    remote = connection.remote_address
    try:
        files = store.tls_files
        ca_certificate = files.ca_certificate()
        await connection.send(encode(JoinOffer(files.ca_path.read_text("ascii"), pki.fleet_id(ca_certificate))))
        try:
            frame = await asyncio.wait_for(connection.recv(), JOIN_REQUEST_TIMEOUT_S)
        except TimeoutError:
            log.warning("join from %s dropped: no JoinRequest within %.0f s of the offer", remote,
                        JOIN_REQUEST_TIMEOUT_S)
            await connection.close(1008, "no JoinRequest in time")
            return
        if isinstance(frame, str):
            raise ProtocolError("text frames are not part of the protocol")
        request = decode(frame)
        if not isinstance(request, JoinRequest):
            raise ProtocolError(f"an unenrolled client may only send JoinRequest, not {type(request).__name__}")
        # in a thread: the data dir's lock is a blocking file lock, which a suspended `fleet token` may hold
        response = await asyncio.to_thread(_sign_join, store, request, utc_now())
        await connection.send(encode(response))
        await connection.close()
    except (ProtocolError, pki.PkiError, join_tokens.JoinTokenError) as error:
        _log_refusal(remote, error)
        await _refuse(connection, ErrorCode.JOIN_REFUSED if not isinstance(error, ProtocolError)
                      else ErrorCode.BAD_MESSAGE, str(error))
    except join_tokens.TokenRejected as error:
        _log_refusal(remote, error)
        await _refuse(connection, ErrorCode.JOIN_REFUSED, "the join token is unknown, expired or used up: ask the "
                      "fleet's admin for a new one (`deskfleet fleet token`)")
    except FleetStoreError as error:
        log.error("join from %s failed: %s", remote, error)
        await _refuse(connection, ErrorCode.INTERNAL, "the controller's data dir needs repair (see its log)")
    except ConnectionClosed as closed:
        if closed.rcvd is not None and closed.rcvd.reason:  # the joining PC said why: another protocol, most often
            # a stranger's words: printable only (no forged log lines), and once a minute a host at WARNING
            reason = "".join(char if char.isprintable() else "?" for char in closed.rcvd.reason)
            host = str(remote[0]) if isinstance(remote, tuple) and remote else str(remote)
            level = logging.WARNING if _join_ends_said.due(host, JOIN_END_LOG_EVERY_S) else logging.DEBUG
            log.log(level, "join from %s ended by the joining PC: %s", remote, reason)
        else:
            log.info("join client %s went away", remote)


def _log_refusal(remote: object, error: Exception) -> None:
    """A refused join: a warning once a minute a host and kind of refusal, a debug line between (a stranger needs no
    token to be refused: 200 tries wrote 200 warnings in 1.6 s)."""
    host = str(remote[0]) if isinstance(remote, tuple) and remote else str(remote)
    due = _join_refusals_said.due((host, str(error)), JOIN_END_LOG_EVERY_S)  # each reason (expired, used up) told
    log.log(logging.WARNING if due else logging.DEBUG, "join from %s refused: %s%s", remote, error,
            " (said once a minute a host at most)" if due else "")


def _sign_join(store: FleetStore, request: JoinRequest, now: datetime.datetime) -> JoinResponse:
    csr = pki.load_csr_pem(request.csr_pem.encode("ascii", "replace"))
    agent_id = pki.check_csr(csr)  # before redeeming: a bad request costs no token use
    secret = join_tokens.secret_from_text(request.secret)
    ca = load_ca(store)
    with store.locked():
        if pki.RevocationSet(frozenset(_read_revoked(store))).is_revoked(agent_id):
            raise pki.PkiError(f"agent {agent_id[:12]} was removed from the fleet: a PC can join again only as a new "
                               f"agent, with a new key ({REMOVED_KEY_ADVICE}, then join with a new token)")
        roster = store.roster()  # before redeeming: a damaged roster costs no token use
        ledger = _load_ledger(store, for_join=True)
        ledger.redeem(secret, now, agent_id)
        certificate = pki.sign_csr(ca, csr, now, role=Role.AGENT)
        _save_ledger(store, ledger)
        hostname = printable_hostname(request.hostname)
        previous = roster.get(agent_id)
        entry = RosterEntry(agent_id, hostname, now.isoformat())
        roster[agent_id] = replace(previous, hostname=hostname) if previous else entry
        store.save_roster(roster)
        namesakes = sorted(other[:12] for other, kept in roster.items()
                           if other != agent_id and kept.hostname == hostname)
    log.info("enrolled agent %s (%s)", agent_id[:12], hostname)
    if namesakes:  # a name is a label the token holder chose: `fleet remove NAME` then asks which agent is meant
        log.warning("agent %s joined as %s, the name agent(s) %s have too: `fleet ls` and `fleet remove` tell them "
                    "apart by agent id (join again with --hostname for a name of its own)", agent_id[:12], hostname,
                    ", ".join(namesakes))
    return JoinResponse(pki.certificate_pem(certificate).decode("ascii"),
                        pki.certificate_pem(ca.certificate).decode("ascii"), pki.fleet_id(ca.certificate))


def printable_hostname(text: str) -> str:
    """The hostname a joining agent gave, as the roster keeps it and the log shows it: at most
    HOSTNAME_MAX_CHARS characters, each that does not print (a newline that would forge a log line, a terminal
    escape that `fleet ls` would run, a right-to-left override) as '?'; '?' for none at all. The token holder
    chooses it, so it is a label, never an identity: the agent id is."""
    return "".join(char if char.isprintable() else "?" for char in text[:HOSTNAME_MAX_CHARS]) or "?"


# Private functions

def _key_pem(private_key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM, as pki.write_private_key writes it."""
    return private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())


async def _refuse(connection: ServerConnection, code: ErrorCode, text: str) -> None:
    try:
        await connection.send(encode(Error(code, text)))
        await connection.close(1008, code.value)
    except ConnectionClosed:
        pass


def _load_ledger(store: FleetStore, *, for_join: bool = False) -> join_tokens.TokenLedger:
    """tokens.json's ledger; FleetStoreError naming the file when it is malformed, or missing `for_join`: read
    as empty, a lost file had refused every issued token as unknown, and nothing named why."""
    path = store.data_dir / "tokens.json"
    missing = object()
    body = store.read("tokens", missing if for_join else [])
    if body is missing:
        raise FleetStoreError(f"{path} is missing (`fleet init` wrote it): every join token issued before it went "
                              "is void; issue a new one with `deskfleet fleet token`, which writes the file again")
    if not isinstance(body, list):
        raise FleetStoreError(f"{path} must hold a list of issued secrets")
    try:
        records = [join_tokens.IssuedSecret(_secret_sha256(item["secret_sha256"]),
                                            datetime.datetime.fromisoformat(item["expires_at"]),
                                            int(item["uses_left"]), _agent_ids(item.get("redeemed_by")))
                   for item in body]
    except (KeyError, TypeError, ValueError) as error:
        raise FleetStoreError(f"{path} holds a malformed record: {error!r}") from None
    if any(record.expires_at.tzinfo is None for record in records):
        raise FleetStoreError(f"{path} holds a record whose expires_at has no time zone")
    return join_tokens.TokenLedger(records)


def _save_ledger(store: FleetStore, ledger: join_tokens.TokenLedger) -> None:
    store.write("tokens", [{"secret_sha256": record.secret_sha256, "expires_at": record.expires_at.isoformat(),
                            "uses_left": record.uses_left,
                            "redeemed_by": None if record.redeemed_by is None else list(record.redeemed_by)}
                           for record in ledger.records])


def _secret_sha256(value: object) -> str:
    if not is_sha256_hex(value):
        raise ValueError(f"secret_sha256 must be 64 lowercase hex characters, not {value!r:.80}")
    return value


def _agent_ids(value: object) -> tuple[str, ...] | None:
    """A record's redeemed_by; None where it is missing or null (written before ledgers kept it)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) and is_agent_id(item) for item in value):
        raise ValueError(f"redeemed_by must be a list of agent ids, not {value!r:.80}")
    return tuple(value)
