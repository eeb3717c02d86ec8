"""The fleet's public-key infrastructure: the controller is the CA, every agent holds a signed cert.

Identities:
- agent id: unpadded lowercase base32 of sha256(SubjectPublicKeyInfo DER) of the agent's key. It is
  known before the certificate exists, survives renewal, and fits one DNS label, so the certificate
  carries it as its DNS subjectAltName and TLS hostname checks can pin a peer by agent id.
- certificate fingerprint: sha256 hex of a certificate's DER; the join token pins the CA by it.
- fleet id: the first 16 hex characters of the CA fingerprint.

Everything takes `now` from the caller; nothing here reads a clock. Key generation uses the OS
random source through `cryptography`.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.wire_messages import REMOVAL_SIGNATURE_BYTES, Role

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_CLOCK_SKEW = datetime.timedelta(minutes=5)
MAX_FLEET_NAME = 64  # X.509's upper bound for an organization name (RFC 5280, ub-organization-name)
_COMMON_NAME_MAX_CHARS = 64  # RFC 5280's ub-common-name
# Nothing renews a certificate: `fleet ls` and the agent warn this many days before one (or the CA) runs out.
EXPIRY_WARNING_DAYS = 60
RENEW_AGENT = "join it again with a new token (`deskfleet fleet token`, then `deskfleet-agent join TOKEN` on that PC)"
RENEW_CONTROLLER = ("delete controller.pem in the controller's data dir: the next fleet command issues it again for "
                    "the kept key (agents accept it); then restart `deskfleet fleet serve`")
RENEW_CA = ("make a new fleet with `deskfleet fleet init --force` on the controller and join every PC to it again "
            "(`deskfleet-agent join TOKEN`)")


# How a refusal says that the peer was removed (RevocationSet.check): an agent refused with HTTP 403 reads itself as
# removed only where the refusal says these words (a 403 for a clock that is wrong, on either side, said nothing of a
# removal and made the agent give its stages up for good and refuse its user's pause)
REMOVED_WORDS = "has been removed from the fleet"


class PkiError(ValueError):
    """A certificate, request or key is not acceptable; the message says which check failed."""


class CertificateExpired(PkiError):
    """A certificate, or the fleet CA (`is_ca`), ran out on `not_valid_after`; the message names the date and
    what to do."""

    def __init__(self, message: str, not_valid_after: datetime.datetime, is_ca: bool) -> None:
        super().__init__(message)
        self.not_valid_after = not_valid_after
        self.is_ca = is_ca


@dataclass(frozen=True)
class FleetCa:
    """The fleet CA: keep `private_key` on the controller only (write it with write_private_key)."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class PeerIdentity:
    """Who a verified certificate belongs to."""

    agent_id: str
    role: Role
    certificate_fingerprint: str
    not_valid_after: datetime.datetime  # aware UTC: when the certificate runs out (nothing renews it)


@dataclass(frozen=True)
class RevocationSet:
    """Agent ids the controller has removed; a peer in it is refused even with a valid certificate."""

    agent_ids: frozenset[str] = frozenset()

    def with_revoked(self, agent_id: str) -> RevocationSet:
        return RevocationSet(self.agent_ids | {agent_id})

    def is_revoked(self, agent_id: str) -> bool:
        return agent_id in self.agent_ids

    def check(self, agent_id: str) -> None:
        """Raise PkiError if `agent_id` is revoked; the caller must then close the connection."""
        if agent_id in self.agent_ids:
            raise PkiError(f"agent {agent_id} {REMOVED_WORDS}")


# Public functions: removals signed by the CA

def sign_removal(ca: FleetCa, agent_id: str) -> bytes:
    """The CA's signature (the raw 64-byte ECDSA r || s) that `agent_id` was removed from the fleet.

    Agents keep these with their list of removed agents and give them back to the controller, so a controller
    restored from a backup made before a removal learns of it again: only the CA's key makes one, so a member
    cannot have another PC removed by claiming it was."""
    der = ca.private_key.sign(_removal_statement(agent_id), ec.ECDSA(hashes.SHA256()))
    r, s = decode_dss_signature(der)
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def check_removal(ca_certificate: x509.Certificate, agent_id: str, signature: bytes) -> None:
    """PkiError unless `signature` is this fleet's CA's `sign_removal` of `agent_id`."""
    if len(signature) != REMOVAL_SIGNATURE_BYTES:
        raise PkiError(f"the removal of agent {agent_id[:12]} carries a malformed signature")
    der = encode_dss_signature(int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big"))
    public_key = ca_certificate.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise PkiError("the fleet CA's key is not an EC key")
    try:
        public_key.verify(der, _removal_statement(agent_id), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise PkiError(f"the removal of agent {agent_id[:12]} is not signed by this fleet's CA") from None


def _removal_statement(agent_id: str) -> bytes:
    return b"deskfleet: agent removed from the fleet\0" + agent_id.encode("ascii")


# Public functions: identities

def certificate_fingerprint(certificate: x509.Certificate) -> str:
    """sha256 hex of the certificate's DER encoding."""
    return certificate.fingerprint(hashes.SHA256()).hex()


def fleet_id(ca_certificate: x509.Certificate) -> str:
    """The fleet id derived from the CA certificate (16 hex characters)."""
    return certificate_fingerprint(ca_certificate)[:16]


def agent_id_for_key(public_key: ec.EllipticCurvePublicKey) -> str:
    """The agent id of a public key: base32(sha256(SubjectPublicKeyInfo DER)), lowercase, no padding."""
    spki = public_key.public_bytes(serialization.Encoding.DER,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b32encode(hashlib.sha256(spki).digest()).decode("ascii").rstrip("=").lower()


# Public functions: creating keys and certificates

def check_fleet_name(fleet_name: str) -> None:
    """ValueError for a fleet name the CA certificate cannot carry as its organization name."""
    if not fleet_name.strip() or len(fleet_name) > MAX_FLEET_NAME:
        raise ValueError(f"a fleet name must be 1 to {MAX_FLEET_NAME} characters, not blank (it is the CA "
                         f"certificate's organization name), got {len(fleet_name)}: {fleet_name[:40]!r}")


def _days_after(now: datetime.datetime, days: int) -> datetime.datetime:
    """`now` + `days`, or PkiError where that passes the year 9999 (`fleet init` raised an OverflowError's
    traceback on a PC whose clock said 9990)."""
    try:
        return now + datetime.timedelta(days=days)
    except OverflowError:
        raise PkiError(f"a certificate valid {days} days from {now.date().isoformat()} would end past the year 9999: "
                       "is this PC's clock right?") from None


def create_fleet_ca(fleet_name: str, now: datetime.datetime, valid_days: int = 3650) -> FleetCa:
    """Make a new fleet CA (ECDSA P-256, self-signed, may sign leaf certificates only). ValueError for a name
    that is empty, blank or longer than X.509 lets an organization name be (64 characters)."""
    check_fleet_name(fleet_name)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "deskfleet fleet CA"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, fleet_name)])
    public = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(_days_after(now, valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return FleetCa(certificate, key)


def create_private_key() -> ec.EllipticCurvePrivateKey:
    """A new ECDSA P-256 key for an agent or the controller; it never leaves the machine."""
    return ec.generate_private_key(ec.SECP256R1())


def create_csr(private_key: ec.EllipticCurvePrivateKey, hostname: str) -> x509.CertificateSigningRequest:
    """A certificate signing request for `private_key`; the CA decides every field it signs.

    The hostname is only a hint in the subject (the CA ignores it; the join request carries it whole), cut
    to the 64 characters X.509 allows a common name.
    """
    common_name = (hostname or "deskfleet-agent")[:_COMMON_NAME_MAX_CHARS]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    return x509.CertificateSigningRequestBuilder().subject_name(subject).sign(private_key, hashes.SHA256())


def check_csr(csr: x509.CertificateSigningRequest) -> str:
    """Check the request's signature and key type; return the agent id it would get.

    The controller calls this before redeeming a join secret, so a bad request costs no token use.
    """
    try:
        # both parse the key first: an unknown curve or key algorithm raised ValueError / UnsupportedAlgorithm out of
        # a stranger's join (a traceback logged at ERROR a try, no token needed)
        key = csr.public_key()
        valid = csr.is_signature_valid
    except (ValueError, UnsupportedAlgorithm) as error:
        raise PkiError(f"certificate request key cannot be read: {str(error)[:100]}") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise PkiError("certificate request key must be ECDSA P-256")
    if not valid:
        raise PkiError("certificate request signature is invalid")
    return agent_id_for_key(key)


def sign_csr(ca: FleetCa, csr: x509.CertificateSigningRequest, now: datetime.datetime, *,
             role: Role = Role.AGENT, ip_addresses: Iterable[IPAddress] = (),
             valid_days: int = 825) -> x509.Certificate:
    """Sign `csr` into a TLS client+server certificate whose DNS SAN is the agent id."""
    agent_id = check_csr(csr)
    public = csr.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)  # check_csr proved it
    ca_ski = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    alt_names: list[x509.GeneralName] = [x509.DNSName(agent_id)]
    alt_names += [x509.IPAddress(address) for address in ip_addresses]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, agent_id),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(ca.certificate.subject).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(_days_after(now, valid_days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca.private_key, hashes.SHA256())
    )


# Public functions: verifying

def verify_certificate(certificate: x509.Certificate, ca_certificate: x509.Certificate,
                       now: datetime.datetime,
                       revoked: RevocationSet | None = None) -> PeerIdentity:
    """Check that `certificate` was signed by the fleet CA, that both are valid at `now`, that it is a
    leaf whose DNS SAN matches its key, and is not revoked. Return its identity; PkiError names the
    failed check, and CertificateExpired (a PkiError) whose certificate ran out, when, and what to do.

    The fleet's TLS contexts leave validity dates to this check (common/tls.py): OpenSSL's own said only
    "certificate has expired" to one side, and nothing at all to the other.
    """
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (ValueError, TypeError, InvalidSignature):
        raise PkiError("certificate was not issued by this fleet's CA") from None
    # a clock that runs ahead reads a certificate as expired: the date it goes by is said, where the advice (a new
    # fleet, for the CA) would lose what a clock set right keeps
    by_clock = (f" (by the clock of the PC checking it, which says {now.date().isoformat()}: where that clock is "
                "wrong, set it right instead)")
    if now > ca_certificate.not_valid_after_utc:
        raise CertificateExpired(f"the fleet CA (fleet {fleet_id(ca_certificate)}) expired on "
                                 f"{expiry_date(ca_certificate.not_valid_after_utc)}: {RENEW_CA}{by_clock}",
                                 ca_certificate.not_valid_after_utc, is_ca=True)
    identity = certificate_identity(certificate)
    if now > identity.not_valid_after:
        advice = RENEW_CONTROLLER if identity.role is Role.CONTROLLER else RENEW_AGENT
        raise CertificateExpired(f"the certificate of {identity.role.value} {identity.agent_id[:12]} expired on "
                                 f"{expiry_date(identity.not_valid_after)}: {advice}{by_clock}",
                                 identity.not_valid_after, is_ca=False)
    if now < certificate.not_valid_before_utc or now < ca_certificate.not_valid_before_utc:
        begins = max(certificate.not_valid_before_utc, ca_certificate.not_valid_before_utc)
        raise PkiError(f"certificate is not valid before {begins.isoformat()} and the clock of the PC checking it "
                       f"says {now.isoformat()}: set that PC's clock right (where it is right, the clock of the PC "
                       "that issued the certificate was ahead then: join again once it is right)")
    if revoked is not None:
        revoked.check(identity.agent_id)
    return identity


def certificate_identity(certificate: x509.Certificate) -> PeerIdentity:
    """Read the identity of a fleet leaf certificate WITHOUT checking who signed it.

    Use on a certificate the TLS layer has already verified against the fleet CA.
    """
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    except (x509.ExtensionNotFound, ValueError):
        raise PkiError("certificate lacks basicConstraints") from None
    if constraints.ca:
        raise PkiError("certificate is a CA, not an agent certificate")
    try:
        alt_names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        raise PkiError("certificate lacks subjectAltName") from None
    key = certificate.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise PkiError("certificate key is not ECDSA")
    agent_id = agent_id_for_key(key)
    if agent_id not in alt_names.get_values_for_type(x509.DNSName):
        raise PkiError("certificate subjectAltName does not name the agent id of its key")
    units = certificate.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    roles = {role.value: role for role in Role}
    if len(units) != 1 or units[0].value not in roles:
        raise PkiError("certificate names no deskfleet role")
    return PeerIdentity(agent_id, roles[str(units[0].value)], certificate_fingerprint(certificate),
                        certificate.not_valid_after_utc)


def expiry_date(moment: datetime.datetime) -> str:
    """The UTC day of `moment`, as 2027-03-01."""
    return moment.astimezone(datetime.UTC).date().isoformat()


def expiry_notice(not_valid_after: datetime.datetime, now: datetime.datetime,
                  within_days: int = EXPIRY_WARNING_DAYS) -> str | None:
    """'expires 2027-03-01 (in 41 days)' when a certificate runs out within `within_days` of `now`, 'expired on
    2027-03-01' when it has; None when it has longer to go."""
    left = not_valid_after - now
    if left > datetime.timedelta(days=within_days):
        return None
    if left < datetime.timedelta(0):
        return f"expired on {expiry_date(not_valid_after)}"
    days = left.days
    when = "in less than a day" if days == 0 else f"in {days} day{'s' if days != 1 else ''}"
    return f"expires {expiry_date(not_valid_after)} ({when})"


def verify_enrollment_peer(peer_certificate_der: bytes, offered_ca_pem: str, pinned_ca_fingerprint: str,
                           now: datetime.datetime) -> x509.Certificate:
    """During `join`: check the CA the controller offered against the token's fingerprint, and that
    the TLS peer is the controller of that CA. Return the CA certificate; only then send the secret.
    """
    ca_certificate = load_certificate_pem(offered_ca_pem.encode("ascii", "replace"))
    if certificate_fingerprint(ca_certificate) != pinned_ca_fingerprint:
        raise PkiError("the controller offered a CA whose fingerprint differs from the join token's")
    peer = verify_certificate(load_certificate_der(peer_certificate_der), ca_certificate, now)
    if peer.role is not Role.CONTROLLER:
        raise PkiError("the enrollment peer's certificate is not the controller's")
    return ca_certificate


# Public functions: serialization

def certificate_pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def csr_pem(csr: x509.CertificateSigningRequest) -> bytes:
    return csr.public_bytes(serialization.Encoding.PEM)


def load_certificate_pem(data: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as error:
        raise PkiError(f"not a PEM certificate: {error}") from None


def load_certificate_der(data: bytes) -> x509.Certificate:
    try:
        return x509.load_der_x509_certificate(data)
    except ValueError as error:
        raise PkiError(f"not a DER certificate: {error}") from None


def load_csr_pem(data: bytes) -> x509.CertificateSigningRequest:
    try:
        return x509.load_pem_x509_csr(data)
    except ValueError as error:
        raise PkiError(f"not a PEM certificate request: {error}") from None


def load_private_key_pem(data: bytes) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as error:
        raise PkiError(f"not an unencrypted PEM private key: {error}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError("private key is not ECDSA")
    return key


def open_key_mode(path: Path) -> int | None:
    """The permission bits of a private key file that users other than its owner may read or write (a backup
    restored from a zip or a USB stick, a copy by a tool that drops modes), None when only the owner may, when the
    file cannot be read (its load names that), or on Windows, where the bits say nothing."""
    if os.name == "nt":
        return None
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return None
    return mode if mode & 0o077 else None


def write_private_key(path: Path, private_key: ec.EllipticCurvePrivateKey) -> None:
    """Write `private_key` as PEM, readable by the owner only (mode 0600 on POSIX; on Windows the
    caller must keep it in the user's profile). The file appears whole or not at all.
    """
    data = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
    write_atomic(path, data)  # mode 0600
