"""Join tokens and the controller's ledger of the secrets it has issued.

A join token is what an IT admin pastes into `deskfleet-agent join TOKEN`: the controller address(es),
the fingerprint of the fleet CA (so the agent can pin it before trusting anything) and a one-time
secret, with an expiry. Text form: "dfj." + base64url (no padding) of

    u8 version | 32 bytes CA sha256 | 32 bytes secret | u64 expiry (unix seconds, big-endian)
    | u8 address count | per address: u8 length + UTF-8 "host:port" | 4 bytes checksum

where the checksum is the first 4 bytes of sha256 over everything before it, so a token cut or mangled
while copied gives a clear error instead of a wrong address.

The ledger keeps only sha256 of each secret, compares in constant time, and takes `now` from the
caller; persisting its records is the caller's job.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import re
import secrets
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum

from deskfleet.common.wire_messages import ProtocolError, parse_address

TOKEN_PREFIX = "dfj."
TOKEN_VERSION = 1
SECRET_BYTES = 32
_FIXED = struct.Struct(">B32s32sQB")
_CHECKSUM_BYTES = 4
_MAX_ADDRESSES = 8
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")

KEEP_ENDED_TOKENS = datetime.timedelta(days=30)  # how long the ledger keeps a token past its expiry


class JoinTokenError(ValueError):
    """The token text cannot be used; the message says what is wrong with it."""


class Rejection(str, Enum):
    UNKNOWN = "unknown"
    EXPIRED = "expired"
    USED_UP = "used_up"


class TokenRejected(PermissionError):
    """A join secret was refused. `reason` is for the controller's log; tell the client less."""

    def __init__(self, reason: Rejection) -> None:
        super().__init__(f"join secret refused: {reason.value}")
        self.reason = reason


@dataclass(frozen=True)
class JoinToken:
    controller_addresses: tuple[str, ...]
    ca_fingerprint: str  # sha256 hex of the CA certificate DER
    secret: bytes
    expires_at: datetime.datetime  # timezone-aware UTC, whole seconds

    def is_expired(self, now: datetime.datetime) -> bool:
        return now >= self.expires_at


@dataclass(frozen=True)
class IssuedSecret:
    """One ledger record: what the controller persists (never the secret itself), and the agents that joined
    with it (None: not known, for a record written before ledgers kept them: such a record is never spent
    again, as a join it did count could not be told apart)."""

    secret_sha256: str
    expires_at: datetime.datetime
    uses_left: int
    redeemed_by: tuple[str, ...] | None = ()


# Public functions

def new_secret() -> bytes:
    """A fresh one-time secret from the OS random source."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_sha256(secret: bytes) -> str:
    """What the ledger keeps of a secret, and what an agent keeps of the one it joined with."""
    return _digest(secret)


def secret_to_text(secret: bytes) -> str:
    """The secret as JoinRequest.secret carries it (base64url, no padding)."""
    return base64.urlsafe_b64encode(secret).decode("ascii").rstrip("=")


def secret_from_text(text: str) -> bytes:
    """Inverse of secret_to_text; JoinTokenError if the text is not a secret."""
    secret = _b64_decode(text, "join secret")
    if len(secret) != SECRET_BYTES:
        raise JoinTokenError(f"join secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    return secret


def encode_join_token(token: JoinToken) -> str:
    """The token's text form; JoinTokenError if a field cannot be encoded."""
    if len(token.secret) != SECRET_BYTES:
        raise JoinTokenError(f"secret must be {SECRET_BYTES} bytes")
    try:
        fingerprint = bytes.fromhex(token.ca_fingerprint)
    except ValueError:
        fingerprint = b""
    if len(fingerprint) != 32:
        raise JoinTokenError("ca_fingerprint must be 64 hex characters")
    if not 1 <= len(token.controller_addresses) <= _MAX_ADDRESSES:
        raise JoinTokenError(f"a token needs 1 to {_MAX_ADDRESSES} controller addresses")
    if token.expires_at.timestamp() < 0:
        raise JoinTokenError("expires_at must be after 1970")
    body = bytearray(_FIXED.pack(TOKEN_VERSION, fingerprint, token.secret,
                                 int(token.expires_at.timestamp()), len(token.controller_addresses)))
    for address in token.controller_addresses:
        _check_address(address)
        raw = address.encode("utf-8")
        if len(raw) > 255:
            raise JoinTokenError(f"controller address {address[:40]!r}... is longer than 255 bytes")
        body += bytes([len(raw)]) + raw
    body += hashlib.sha256(body).digest()[:_CHECKSUM_BYTES]
    return TOKEN_PREFIX + base64.urlsafe_b64encode(bytes(body)).decode("ascii").rstrip("=")


def decode_join_token(text: str) -> JoinToken:
    """Parse a token's text form (surrounding whitespace allowed); JoinTokenError says what is wrong.

    Does not check expiry: call `is_expired(now)`.
    """
    text = text.strip()
    if not text:  # `join "$TOKEN"` with TOKEN unset
        raise JoinTokenError("the join token is empty: give the one `deskfleet fleet token` printed")
    if not text.startswith(TOKEN_PREFIX):
        raise JoinTokenError(f"a join token starts with {TOKEN_PREFIX!r}")
    raw = _b64_decode(text[len(TOKEN_PREFIX):], "join token")
    if len(raw) < _FIXED.size + _CHECKSUM_BYTES:
        raise JoinTokenError("join token is too short: was it cut while copying?")
    body, checksum = raw[:-_CHECKSUM_BYTES], raw[-_CHECKSUM_BYTES:]
    if not hmac.compare_digest(hashlib.sha256(body).digest()[:_CHECKSUM_BYTES], checksum):
        raise JoinTokenError("join token is damaged (checksum mismatch): copy it again")
    version, fingerprint, secret, expiry, count = _FIXED.unpack_from(body)
    if version != TOKEN_VERSION:
        raise JoinTokenError(f"join token version {version} is not supported (expected {TOKEN_VERSION})")
    if not 1 <= count <= _MAX_ADDRESSES:
        raise JoinTokenError(f"join token lists {count} controller addresses, expected 1 to {_MAX_ADDRESSES}")
    addresses: list[str] = []
    offset = _FIXED.size
    for _ in range(count):
        length = body[offset] if offset < len(body) else -1
        address_bytes = body[offset + 1:offset + 1 + length]
        if length < 0 or len(address_bytes) != length:
            raise JoinTokenError("join token address list is truncated")
        try:
            address = address_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise JoinTokenError("join token address is not UTF-8") from None
        _check_address(address)
        addresses.append(address)
        offset += 1 + length
    if offset != len(body):
        raise JoinTokenError("join token has trailing bytes")
    try:
        expires_at = datetime.datetime.fromtimestamp(expiry, datetime.UTC)
    except (OverflowError, OSError, ValueError):
        raise JoinTokenError(f"join token expiry {expiry} is not a date") from None
    return JoinToken(tuple(addresses), fingerprint.hex(), secret, expires_at)


class TokenLedger:
    """The join secrets a controller has issued, with remaining uses and expiry.

    Call `redeem` only after the join request is otherwise acceptable (CSR checked), so a bad
    request does not burn a use. Persist `records` after every change.
    """

    # Public methods

    def __init__(self, records: Iterable[IssuedSecret] = ()) -> None:
        self._records: list[IssuedSecret] = list(records)

    @property
    def records(self) -> tuple[IssuedSecret, ...]:
        return tuple(self._records)

    def issue(self, secret: bytes, expires_at: datetime.datetime, uses: int = 1) -> None:
        """Record a new secret valid for `uses` joins until `expires_at`."""
        if uses < 1:
            raise ValueError(f"uses must be >= 1, got {uses}")
        self._records.append(IssuedSecret(_digest(secret), expires_at, uses))

    def redeem(self, secret: bytes, now: datetime.datetime, agent_id: str) -> None:
        """Spend one use of `secret` for `agent_id`, or raise TokenRejected (the ledger is then unchanged). An agent
        that joined with it already (the same key: a rollout script run again, a join again for another hostname)
        spends none: `--uses` counts PCs, and a 10-use token run twice on one PC let only 8 others join."""
        digest = _digest(secret)
        match = -1
        for index, record in enumerate(self._records):  # no early exit: constant work per record
            if hmac.compare_digest(record.secret_sha256, digest):
                match = index
        if match < 0:
            raise TokenRejected(Rejection.UNKNOWN)
        record = self._records[match]
        if now >= record.expires_at:
            raise TokenRejected(Rejection.EXPIRED)
        if record.redeemed_by is not None and agent_id in record.redeemed_by:
            return
        if record.uses_left < 1:
            raise TokenRejected(Rejection.USED_UP)
        redeemed_by = None if record.redeemed_by is None else (*record.redeemed_by, agent_id)
        self._records[match] = replace(record, uses_left=record.uses_left - 1, redeemed_by=redeemed_by)

    def spend_again(self, digest: str, agent_id: str, now: datetime.datetime) -> bool:
        """An agent that joined with the secret of sha256 `digest` says so: if this ledger does not count that
        join (it was restored from a backup made before it), spend the use now. True when a use was spent."""
        for index, record in enumerate(self._records):
            if hmac.compare_digest(record.secret_sha256, digest):
                if record.redeemed_by is None or agent_id in record.redeemed_by or record.uses_left < 1 \
                        or now >= record.expires_at:
                    return False
                self._records[index] = replace(record, uses_left=record.uses_left - 1,
                                               redeemed_by=(*record.redeemed_by, agent_id))
                return True
        return False

    def revoke(self, secret: bytes) -> bool:
        """Forget `secret`; True if it was there."""
        digest = _digest(secret)
        kept = [r for r in self._records if not hmac.compare_digest(r.secret_sha256, digest)]
        removed = len(kept) != len(self._records)
        self._records = kept
        return removed

    def prune(self, now: datetime.datetime) -> int:
        """Drop the records that expired more than KEEP_ENDED_TOKENS ago, used up or not; return how many were
        dropped. Until then a join with one is refused as expired or used up, which `fleet serve`'s log says: a
        token dropped as soon as it ended (at the next `fleet token`) was refused as unknown, as if mistyped."""
        kept = [r for r in self._records if now < r.expires_at + KEEP_ENDED_TOKENS]
        dropped = len(self._records) - len(kept)
        self._records = kept
        return dropped


# Private functions

def _digest(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


def _b64_decode(text: str, what: str) -> bytes:
    if _BASE64URL.fullmatch(text) is None:
        raise JoinTokenError(f"{what} holds characters outside base64url")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise JoinTokenError(f"{what} is not base64url: was it cut or changed while copying?") from None


def _check_address(address: str) -> None:
    try:
        parse_address(address)
    except ProtocolError as error:
        raise JoinTokenError(f"join token controller {error}") from None
