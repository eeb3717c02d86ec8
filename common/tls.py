"""TLS contexts for the fleet: TLS 1.3 only, the fleet CA as the only trust anchor, certificates
required on both sides. Builders only; the caller owns sockets and websockets.

After every handshake the caller must still read the peer's identity (`peer_identity`) and refuse a
revoked agent, because revocation lives in the controller's RevocationSet, not in the certificate; that
check is also the one that refuses an expired certificate or fleet CA. The handshake leaves dates to it
(X509_V_FLAG_NO_CHECK_TIME): OpenSSL's own check told the dialling side only "certificate has expired"
(whose? since when? what to do?) and the other side nothing at all (a server that refuses a client's
certificate does not know whose it was; the client read "did not receive a valid HTTP response").
`peer_identity` names the certificate, the day it ran out and the fix, and a server answers an expired
client with HTTP 403 carrying that text.
"""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

from cryptography import x509

from deskfleet.common.pki import (
    PeerIdentity,
    RevocationSet,
    certificate_identity,
    load_certificate_der,
    verify_certificate,
)

# OpenSSL's X509_V_FLAG_NO_CHECK_TIME, which the ssl module does not name
_NO_CHECK_TIME = 0x200000

# What OpenSSL's reason for a refused handshake means to an admin reading the log
_REFUSALS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "a TLS client without a certificate",
    "CERTIFICATE_VERIFY_FAILED": "a certificate this fleet's CA did not sign",
    "TLSV1_ALERT_UNKNOWN_CA": "a client that does not trust this fleet's CA",
    "HTTP_REQUEST": "plain HTTP, not TLS",
    "WRONG_VERSION_NUMBER": "not TLS (plain text or another protocol)",
    "UNKNOWN_PROTOCOL": "not TLS (plain text or another protocol)",
    "PACKET_LENGTH_TOO_LONG": "not TLS (plain text or another protocol)",
    "UNSUPPORTED_PROTOCOL": "a TLS version older than 1.3",
    "NO_SHARED_CIPHER": "no cipher in common",
}

# Public functions

def refusal(error: BaseException) -> str | None:
    """What a listening side's failed handshake means to an admin reading its log (`_REFUSALS`, else OpenSSL's
    reason and text), or None when nothing was refused: the peer hung up or the connection broke (a port scan, a
    client of another fleet that distrusts our certificate first)."""
    if not isinstance(error, ssl.SSLError) or isinstance(error, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return None
    reason = str(error.reason or type(error).__name__)
    return _REFUSALS.get(reason, f"{reason} ({error})")


def server_context(*, ca_path: Path, cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """Context for a listening agent or controller: refuses any client without a fleet certificate."""
    context = _base_context(ssl.PROTOCOL_TLS_SERVER)
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= _NO_CHECK_TIME  # dates: peer_identity, with a message that names them
    context.load_verify_locations(cafile=str(ca_path))
    context.load_cert_chain(certfile=str(cert_path), keyfile=str(key_path))
    return context


def client_context(*, ca_path: Path, cert_path: Path, key_path: Path,
                   pin_agent_id: bool = True) -> ssl.SSLContext:
    """Context for connecting to a fleet member, presenting our certificate.

    With pin_agent_id (the default) the caller must pass `server_hostname=<expected agent id>` when
    wrapping; the handshake then fails unless the server's certificate carries that agent id. Without
    it (a manual `--peer HOST:PORT` whose id is unknown) the caller must read `peer_identity` itself.
    """
    context = _base_context(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = pin_agent_id
    context.verify_mode = ssl.CERT_REQUIRED
    context.verify_flags |= _NO_CHECK_TIME  # dates: peer_identity, with a message that names them
    context.load_verify_locations(cafile=str(ca_path))
    context.load_cert_chain(certfile=str(cert_path), keyfile=str(key_path))
    return context


def enrollment_server_context(*, cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """Context for the controller's enrollment port, where agents have no certificate yet.

    The caller must serve only JoinOffer / JoinRequest / JoinResponse there, and act on nothing else.
    """
    context = _base_context(ssl.PROTOCOL_TLS_SERVER)
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(certfile=str(cert_path), keyfile=str(key_path))
    return context


def enrollment_client_context() -> ssl.SSLContext:
    """Context for `deskfleet-agent join`: it does NOT verify the server by itself.

    The caller must receive JoinOffer and pass the peer certificate to `pki.verify_enrollment_peer`
    with the token's CA fingerprint before sending the join secret.
    """
    context = _base_context(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def peer_agent_id(peer_certificate_der: bytes) -> str:
    """The agent id in a certificate the TLS layer has verified (PkiError if it is not a fleet leaf)."""
    return certificate_identity(load_certificate_der(peer_certificate_der)).agent_id


def peer_identity(peer_certificate_der: bytes, ca_certificate: x509.Certificate, now: datetime.datetime,
                  revoked: RevocationSet) -> PeerIdentity:
    """Verify the peer certificate again against the CA, its dates and the revocation set; PkiError to refuse
    (CertificateExpired naming the day and the fix for an expired certificate or CA)."""
    return verify_certificate(load_certificate_der(peer_certificate_der), ca_certificate, now, revoked)


# Private functions

def _base_context(protocol: ssl._SSLMethod) -> ssl.SSLContext:
    # A bare SSLContext, not create_default_context: that would also trust the system CA store.
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.maximum_version = ssl.TLSVersion.TLSv1_3
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    context.options |= ssl.OP_NO_COMPRESSION
    return context
