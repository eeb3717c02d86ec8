"""`deskfleet-agent join TOKEN`: enroll this PC in a fleet.

The exchange (controller side in controller/fleet_ca.py), over TLS 1.3 where the agent has no
certificate yet:
    controller -> JoinOffer(CA certificate, fleet id)
    agent checks the CA against the token's fingerprint AND that the TLS peer is that CA's controller
    agent      -> JoinRequest(secret, CSR, hostname)   (only after the check)
    controller -> JoinResponse(certificate) or Error(JOIN_REFUSED)
The private key is made here, written 0600 into the agent's state dir, and never sent anywhere.

What enrollment leaves in the state dir: agent-key.pem, agent.pem, ca.pem and membership.json (fleet
id, the controller's agent id and addresses), which the headless agent reads to register.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import ssl
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.frames import CloseCode

from deskfleet.agent.link import ENROLLMENT_MAX_FRAME_BYTES, SOFTWARE_VERSION, TlsFiles, utc_now, websocket_options
from deskfleet.agent.standing import MEMBERSHIP_FILE, forget_removed
from deskfleet.common import join_tokens, pki, tls
from deskfleet.common.atomic_file import write_atomic, write_atomic_together
from deskfleet.common.wire import (
    PROTOCOL_VERSION,
    Error,
    JoinOffer,
    JoinRequest,
    JoinResponse,
    Message,
    ProtocolError,
    decode,
    encode,
    is_sha256_hex,
    parse_address,
    peek_version,
)

log = logging.getLogger(__name__)

MEMBERSHIP_FORMAT = 1
JOIN_TIMEOUT_S = 20.0
JOIN_BUSY_WAIT_S = 60.0  # how long a join tries again while the controller is busy with other joins


# what the controller's refusal of a removed agent tells it to do (controller/fleet_ca.py), which `join` completes
# with this PC's key path
REMOVED_KEY_ADVICE = "delete agent-key.pem in the agent's state folder"


class EnrollmentError(RuntimeError):
    """Joining failed; the message says at which step and why."""


class ControllerBusy(EnrollmentError):
    """The controller refused the join for now: it serves a few joins at a time (agent/link.py)."""


@dataclass(frozen=True)
class Membership:
    """What an enrolled agent knows about its fleet."""

    fleet_id: str
    agent_id: str
    controller_id: str  # the controller certificate's agent id: registration pins it
    controller_addresses: tuple[str, ...]
    # the sha256 of the join token's secret (None: joined before agents kept it), told at each registration
    token_sha256: str | None = None
    # the name it joined with (None: joined before agents kept it): a later join without --hostname keeps it
    hostname: str | None = None

    def save(self, state_dir: Path) -> None:
        write_atomic(state_dir / MEMBERSHIP_FILE, self.file_bytes())

    def file_bytes(self) -> bytes:
        """What save() writes."""
        body = {"format_version": MEMBERSHIP_FORMAT, **asdict(self)}
        return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def load(cls, state_dir: Path, join_command: str = "deskfleet-agent join TOKEN") -> Membership:
        """The membership saved in `state_dir`; EnrollmentError saying to run `join_command` when not joined."""
        path = state_dir / MEMBERSHIP_FILE
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            # the usual cause once a PC has joined: the agent started without the --data-dir it joined with
            raise EnrollmentError(f"this agent has not joined a fleet ({path} is missing): run "
                                  f"`{join_command}` first, or, if this PC joined with --data-dir D, give the agent "
                                  "the same --data-dir D") from None
        except PermissionError as error:  # the file is whole: "join the fleet again" was the wrong way out
            raise EnrollmentError(f"cannot read {path} ({error.strerror}): run the agent as the user that joined "
                                  "(who owns its data dir)") from None
        except (OSError, ValueError) as error:  # a damaged agent.pem said to join again; this said no fix
            raise EnrollmentError(f"{path} is unreadable ({error}): join the fleet again (`{join_command}`, with a "
                                  "new token from the admin); this PC keeps its key, and so its agent id") from None
        try:
            if body.pop("format_version") != MEMBERSHIP_FORMAT:
                raise ValueError("unknown format_version")
            addresses = body["controller_addresses"]
            if not isinstance(addresses, list) or not addresses:
                raise ValueError(f"controller_addresses must be a list of host:port, not {addresses!r:.60}")
            for address in addresses:
                parse_address(address)  # ProtocolError (a ValueError) naming it
            token_sha256 = body.get("token_sha256")
            if token_sha256 is not None and not is_sha256_hex(token_sha256):
                raise ValueError(f"token_sha256 must be 64 lowercase hex characters, not {token_sha256!r:.80}")
            hostname = body.get("hostname")
            if hostname is not None and not isinstance(hostname, str):
                raise ValueError(f"hostname must be a string, not {hostname!r:.80}")
            return cls(str(body["fleet_id"]), str(body["agent_id"]), str(body["controller_id"]), tuple(addresses),
                       token_sha256, hostname)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            why = f"it has no {error.args[0]!r:.60}" if isinstance(error, KeyError) else str(error)
            raise EnrollmentError(f"{path} is malformed ({why}): join the fleet again (`{join_command}`, with a new "
                                  "token from the admin); this PC keeps its key, and so its agent id") from None


def agent_tls_files(state_dir: Path) -> TlsFiles:
    return TlsFiles.in_folder(state_dir, "agent")


# Public functions

def secure_state_dir(state_dir: Path) -> None:
    """Make the agent's state folder when missing, readable by its owner only, and make sure of one that was there:
    one open to other users is closed (mode 0700, with a warning), one another user owns is refused, and so is a
    credential in it that is a symbolic link. Whoever can write the folder, or a file a link points to, can read
    this PC's key or swap the CA it trusts: a state folder made beforehand with mode 0777 and a link in place of
    agent-key.pem had the key written to the link's target, and the agent started with another fleet's ca.pem.
    (On Windows file modes mean nothing: the folder is in the user's profile by default.)"""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = agent_tls_files(state_dir)
    credentials = (files.ca_path, files.cert_path, files.key_path, state_dir / MEMBERSHIP_FILE)
    for path in credentials:
        if path.is_symlink():
            raise EnrollmentError(f"{path} is a symbolic link (to {os.readlink(path)}): this PC's fleet credentials "
                                  "must be files of their own in its state folder; remove the link and join the "
                                  "fleet again with a new token")
    if os.name == "nt":
        return
    status = state_dir.stat()
    if status.st_uid != os.geteuid():
        raise EnrollmentError(f"the agent's state folder {state_dir} belongs to another user (uid {status.st_uid}), "
                              f"not to the one running the agent (uid {os.geteuid()}): whoever owns it can read this "
                              "PC's fleet key; give the agent a --data-dir of its own user")
    for path in credentials:
        if path.exists() and (owner := path.stat().st_uid) != os.geteuid():  # put there while the folder was open
            raise EnrollmentError(f"{path} belongs to another user (uid {owner}): this PC's fleet credentials must be "
                                  "its own; remove it and join the fleet again with a new token")
    if (mode := stat.S_IMODE(status.st_mode)) & 0o077:
        state_dir.chmod(0o700)
        if stat.S_IMODE(state_dir.stat().st_mode) & 0o077:  # a file system without modes (vfat, a share)
            log.warning("the agent's state folder %s is open to other users (mode %03o) and its file system keeps "
                        "no modes: keep the agent's --data-dir on a disk that does", state_dir, mode)
        else:
            log.warning("the agent's state folder %s was open to other users (mode %03o): made it readable by its "
                        "owner only (0700); check that no one else put a file there", state_dir, mode)


def check_credentials(files: TlsFiles, membership: Membership, join_command: str) -> None:
    """EnrollmentError when the state folder's CA, certificate and membership are not one fleet's and one agent's:
    a ca.pem of another fleet would let that fleet's controller command this PC (an agent started so, logging only
    that it dropped its saved removals as another fleet's)."""
    again = f"join the fleet again with a new token from its admin: `{join_command}`"
    try:
        ca_certificate = files.ca_certificate()
        certificate = pki.load_certificate_pem(files.cert_path.read_bytes())
    except OSError as error:
        raise EnrollmentError(f"cannot read {error.filename or 'a credential file'} ({error.strerror or error}): "
                              f"{again}") from None
    except pki.PkiError as error:
        if str(files.ca_path) in str(error):  # TlsFiles named it, and what to do
            raise EnrollmentError(str(error)) from None
        # it said only "not a PEM certificate: Unable to load PEM file", naming no file
        raise EnrollmentError(f"{files.cert_path} cannot be used ({error}): this PC's credentials are damaged; "
                              f"{again}") from None
    if (ca_fleet := pki.fleet_id(ca_certificate)) != membership.fleet_id:
        raise EnrollmentError(f"{files.ca_path} is the CA of fleet {ca_fleet[:12]}, not of fleet "
                              f"{membership.fleet_id[:12]} this PC joined (its {MEMBERSHIP_FILE}): the state folder "
                              f"was altered; {again}")
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (ValueError, TypeError, InvalidSignature):
        raise EnrollmentError(f"{files.cert_path} was not issued by the fleet's CA ({files.ca_path}): the state folder "
                              f"was altered; {again}") from None
    if (agent_id := pki.certificate_identity(certificate).agent_id) != membership.agent_id:
        raise EnrollmentError(f"{files.cert_path} names agent {agent_id[:12]}, not agent {membership.agent_id[:12]} "
                              f"of its {MEMBERSHIP_FILE}: the state folder was altered; {again}")


def read_join_token(token_text: str) -> join_tokens.JoinToken:
    """The token, decoded; EnrollmentError naming the problem when it is malformed or has expired."""
    try:
        token = join_tokens.decode_join_token(token_text)
    except join_tokens.JoinTokenError as error:
        raise EnrollmentError(str(error)) from None
    now = utc_now()
    if token.is_expired(now):  # by this PC's clock, which may be the one that is wrong: it is said
        raise EnrollmentError(f"the join token expired at {token.expires_at.isoformat(timespec='seconds')}, and this "
                              f"PC's clock says {now.isoformat(timespec='seconds')}: ask for a new one (where this "
                              "PC's clock is wrong, set it right: a new token would look expired too)")
    return token


async def join(token_text: str, state_dir: Path, hostname: str | None = None) -> Membership:
    """Enroll with the controller named in the token; tries each of its addresses in turn."""
    token = read_join_token(token_text)
    files = agent_tls_files(state_dir)
    secure_state_dir(state_dir)
    key = _load_or_create_key(files.key_path)
    hostname = hostname or _earlier_hostname(state_dir) or socket.gethostname()
    problems: list[str] = []
    for address in token.controller_addresses:
        try:
            joined = await _join_when_free(address, token, key, hostname)
        except (EnrollmentError, TimeoutError) as error:
            # the controller cannot know where this PC keeps its key: the path is this side's to give
            said = str(error).replace(REMOVED_KEY_ADVICE, f"delete {files.key_path}")
            problems.append(f"{address}: {said or f'no answer within {JOIN_TIMEOUT_S:.0f} s'}")
            if len(token.controller_addresses) > 1:  # the next address is tried; the error lists them all at the end
                log.warning("join via %s failed: %s", address, error)
            continue
        _save_joined(joined, files, state_dir)
        forget_removed(state_dir)  # a member again (a removed PC joins with a new key)
        return joined.membership
    now = utc_now()
    expired = f" (the token expired at {token.expires_at.isoformat(timespec='seconds')}, while this join ran)" \
        if token.is_expired(now) else ""  # the controller says "unknown, expired or used up": this side can tell
    raise EnrollmentError("could not join: " + "; ".join(problems) + expired)


# Private functions

@dataclass(frozen=True)
class _Joined:
    """What a join brings back: the membership and the fleet's CA and this PC's certificate, as PEM."""

    membership: Membership
    ca_pem: bytes
    certificate_pem: bytes


def _save_joined(joined: _Joined, files: TlsFiles, state_dir: Path) -> None:
    """The CA, the certificate and the membership written together (write_atomic_together): where one cannot be,
    the PC keeps the fleet it was in, whole. They were written one by one, and a join into another fleet that met a
    full disk at the membership left the new fleet's CA beside the old fleet's membership: the agent refused to
    start, and the PC was in neither fleet."""
    try:
        write_atomic_together([(files.ca_path, joined.ca_pem), (files.cert_path, joined.certificate_pem),
                               (state_dir / MEMBERSHIP_FILE, joined.membership.file_bytes())])
    except OSError as error:
        kept = "nothing of the new fleet was written" if not (state_dir / MEMBERSHIP_FILE).exists() else \
            "this PC stays in the fleet it was in, as it was"
        raise EnrollmentError(f"the controller enrolled this PC (agent {joined.membership.agent_id[:12]}), but its "
                              f"credentials could not be written to {state_dir}: {error.strerror or error}; "
                              f"{kept}. Make room there (or make it writable), then join again: a token of one use "
                              "is spent, so ask the admin for a new one; this PC keeps its key and agent id") from None


# Private functions

async def _join_when_free(address: str, token: join_tokens.JoinToken, key: ec.EllipticCurvePrivateKey,
                          hostname: str) -> _Joined:
    """_join_at, tried again while the controller says it is busy with other joins (it serves a few at a time: an
    office's PCs joined by one script at once were refused, each with exit 2), for up to JOIN_BUSY_WAIT_S, after a
    growing, jittered pause (so that the PCs refused together do not come back together)."""
    deadline = time.monotonic() + JOIN_BUSY_WAIT_S
    pause = 1.0
    while True:
        try:
            return await asyncio.wait_for(_join_at(address, token, key, hostname), JOIN_TIMEOUT_S)
        except ControllerBusy as busy:
            wait = random.uniform(pause, 2 * pause)
            if time.monotonic() + wait > deadline:
                raise ControllerBusy(f"{busy}, for {JOIN_BUSY_WAIT_S:.0f} s: join again later") from None
            log.info("%s at %s: trying again in %.0f s", busy, address, wait)
            await asyncio.sleep(wait)
            pause = min(2 * pause, 8.0)


def _earlier_hostname(state_dir: Path) -> str | None:
    """The name this PC joined with before (a join again: a new controller address, a renewal), so that it keeps
    the name its admin gave it; None when it never joined, or joined before agents kept it."""
    try:
        return Membership.load(state_dir).hostname
    except EnrollmentError:
        return None


def _load_or_create_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """Reuse the key of an earlier attempt (its agent id stays the same), else make one, mode 0600."""
    if path.is_file():
        try:
            return pki.load_private_key_pem(path.read_bytes())
        except pki.PkiError as error:
            raise EnrollmentError(f"{path} is not a usable key ({error}): delete it and join again (this PC then "
                                  "gets a new agent id)") from None
    key = pki.create_private_key()
    pki.write_private_key(path, key)
    return key


async def _join_at(address: str, token: join_tokens.JoinToken, key: ec.EllipticCurvePrivateKey,
                   hostname: str) -> _Joined:
    host, port = parse_address(address)
    uri_host = f"[{host}]" if ":" in host else host
    try:
        connection = await connect(f"wss://{uri_host}:{port}/", ssl=tls.enrollment_client_context(),
                                   server_hostname=host,
                                   **(websocket_options() | {"max_size": ENROLLMENT_MAX_FRAME_BYTES}))
    except (ConnectionResetError, ConnectionAbortedError, ssl.SSLEOFError) as error:
        # accepted, then dropped before TLS: `fleet serve` turns an address away while 64 of its connections are
        # opening (agent/tls_gate.py), a PC behind a shared address among them; tried again as a busy controller
        raise ControllerBusy(f"the controller dropped the connection as it opened ({type(error).__name__}: it turns "
                             "an address away while 64 of its connections are opening; or no deskfleet controller "
                             "listens there)") from None
    except (OSError, InvalidHandshake, ssl.SSLError) as error:
        # a join is answered by `fleet serve`: with it stopped, "Connection refused" named nothing to start
        raise EnrollmentError(f"cannot reach the controller: {str(error) or type(error).__name__} (is `deskfleet "
                              "fleet serve` running there?)") from None
    async with connection:
        try:
            offer = await _receive(connection)
            if not isinstance(offer, JoinOffer):
                raise EnrollmentError(f"the controller opened with {type(offer).__name__}, not JoinOffer")
            peer_der = connection.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
            try:
                ca_certificate = pki.verify_enrollment_peer(peer_der or b"", offer.ca_certificate_pem,
                                                            token.ca_fingerprint, utc_now())
            except pki.PkiError as error:
                raise EnrollmentError(f"refusing to send the secret: {error}") from None
            controller_id = pki.certificate_identity(pki.load_certificate_der(peer_der)).agent_id
            csr = pki.csr_pem(pki.create_csr(key, hostname)).decode("ascii")
            await connection.send(encode(JoinRequest(join_tokens.secret_to_text(token.secret), csr, hostname)))
            response = await _receive(connection)
        except ConnectionClosed as error:
            if error.rcvd is not None and error.rcvd.code == CloseCode.TRY_AGAIN_LATER:
                raise ControllerBusy(f"the controller is busy with other joins ({error.rcvd.reason})") from None
            raise EnrollmentError(f"the controller closed the link: {error}") from None
    if isinstance(response, Error):
        raise EnrollmentError(f"the controller refused: {response.message}")
    if not isinstance(response, JoinResponse):
        raise EnrollmentError(f"the controller answered {type(response).__name__}, not JoinResponse")
    certificate = pki.load_certificate_pem(response.certificate_pem.encode("ascii", "replace"))
    identity = pki.verify_certificate(certificate, ca_certificate, utc_now())
    if identity.agent_id != pki.agent_id_for_key(key.public_key()):
        raise EnrollmentError("the controller signed a certificate for another key")
    membership = Membership(pki.fleet_id(ca_certificate), identity.agent_id, controller_id,
                            token.controller_addresses, join_tokens.secret_sha256(token.secret), hostname)
    return _Joined(membership, pki.certificate_pem(ca_certificate), pki.certificate_pem(certificate))


async def _receive(connection: ClientConnection) -> Message:
    frame = await connection.recv()
    if isinstance(frame, str):
        raise EnrollmentError("the controller sent a text frame")
    peeked = peek_version(frame)  # the codec refuses any frame of another version: "malformed", said nothing more
    if peeked is not None and peeked[0] != PROTOCOL_VERSION:
        upgrade = "this PC" if peeked[0] > PROTOCOL_VERSION else "the controller"
        # the controller's log says why the join ended, as a refused Hello's close reason does (agent/link.py)
        with contextlib.suppress(ConnectionClosed):
            await connection.close(1008, f"agent speaks protocol {PROTOCOL_VERSION} (deskfleet "
                                         f"{SOFTWARE_VERSION[:16]}), you {peeked[0]}: upgrade deskfleet on "
                                         f"{'your PC' if peeked[0] < PROTOCOL_VERSION else 'the joining agent'}")
        raise EnrollmentError(f"the controller speaks fleet protocol {peeked[0]} and this agent {PROTOCOL_VERSION} "
                              f"(deskfleet {SOFTWARE_VERSION}): upgrade deskfleet on {upgrade}, so that both run "
                              "the same version, then join again with the same token")
    try:
        return decode(frame)
    except ProtocolError as error:
        raise EnrollmentError(f"the controller sent a malformed message: {error}") from None
