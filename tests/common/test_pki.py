from __future__ import annotations

import datetime
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from deskfleet.common import pki
from deskfleet.common.wire import Role, is_agent_id

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)


@pytest.fixture(scope="module")
def ca() -> pki.FleetCa:
    return pki.create_fleet_ca("ACME office", NOW)


def enroll(ca: pki.FleetCa, role: Role = Role.AGENT) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = pki.create_private_key()
    csr = pki.load_csr_pem(pki.csr_pem(pki.create_csr(key, "desk-42")))
    return key, pki.sign_csr(ca, csr, NOW, role=role, ip_addresses=[ipaddress.ip_address("10.0.0.7")])


def test_ca_is_a_p256_ca_that_signs_leaves_only(ca: pki.FleetCa) -> None:
    constraints = ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    assert isinstance(ca.private_key.curve, ec.SECP256R1)
    fingerprint = pki.certificate_fingerprint(ca.certificate)
    assert len(fingerprint) == 64 and pki.fleet_id(ca.certificate) == fingerprint[:16]


def test_signed_certificate_carries_the_agent_id(ca: pki.FleetCa) -> None:
    key, certificate = enroll(ca)
    agent_id = pki.agent_id_for_key(key.public_key())
    assert is_agent_id(agent_id)
    alt_names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert alt_names.get_values_for_type(x509.DNSName) == [agent_id]
    assert alt_names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    identity = pki.verify_certificate(certificate, ca.certificate, NOW)
    assert identity == pki.PeerIdentity(agent_id, Role.AGENT, pki.certificate_fingerprint(certificate),
                                        NOW + datetime.timedelta(days=825))
    assert identity.not_valid_after.tzinfo is not None
    assert pki.load_certificate_pem(pki.certificate_pem(certificate)) == certificate


def test_verify_refuses_strangers_expired_and_revoked(ca: pki.FleetCa) -> None:
    other_ca = pki.create_fleet_ca("someone else", NOW)
    _, stranger = enroll(other_ca)
    with pytest.raises(pki.PkiError, match="not issued by this fleet's CA"):
        pki.verify_certificate(stranger, ca.certificate, NOW)
    _, certificate = enroll(ca)
    with pytest.raises(pki.CertificateExpired, match=r"certificate of agent .* expired on 2028-06-03: join it again"):
        pki.verify_certificate(certificate, ca.certificate, NOW + datetime.timedelta(days=900))
    with pytest.raises(pki.PkiError, match=r"not valid before .* and the clock of the PC checking it says .*: set "
                                           r"that PC's clock right \(where it is right, the clock of the PC that "
                                           r"issued the certificate was ahead then"):
        pki.verify_certificate(certificate, ca.certificate, NOW - datetime.timedelta(hours=1))
    with pytest.raises(pki.PkiError, match="is a CA"):
        pki.verify_certificate(ca.certificate, ca.certificate, NOW)
    identity = pki.verify_certificate(certificate, ca.certificate, NOW)
    revoked = pki.RevocationSet().with_revoked(identity.agent_id)
    assert revoked.is_revoked(identity.agent_id) and not pki.RevocationSet().is_revoked(identity.agent_id)
    with pytest.raises(pki.PkiError, match="removed from the fleet"):
        pki.verify_certificate(certificate, ca.certificate, NOW, revoked)


def test_csr_checks(ca: pki.FleetCa) -> None:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    rsa_csr = builder.sign(rsa_key, hashes.SHA256())
    with pytest.raises(pki.PkiError, match="P-256"):
        pki.sign_csr(ca, rsa_csr, NOW)
    with pytest.raises(pki.PkiError, match="not a PEM certificate request"):
        pki.load_csr_pem(b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n")
    with pytest.raises(pki.PkiError, match="not a DER certificate"):
        pki.load_certificate_der(b"\x30\x03junk")


@pytest.mark.parametrize(("found", "replaced"), [
    ("2a8648ce3d030107", "2a8648ce3d030101"),  # P-256's curve OID made secp192r1's: an unknown curve
    ("2a8648ce3d0201", "2a8648ce3d0209"),  # the EC key algorithm's OID made another's: an unknown key type
])
def test_a_csr_whose_key_cannot_be_read_is_refused_as_such(found: str, replaced: str) -> None:
    # a stranger's join with such a CSR raised ValueError or UnsupportedAlgorithm: a traceback logged at ERROR a try
    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, hashes.SHA256())
    der = csr.public_bytes(serialization.Encoding.DER)
    assert bytes.fromhex(found) in der
    broken = x509.load_der_x509_csr(der.replace(bytes.fromhex(found), bytes.fromhex(replaced)))
    with pytest.raises(pki.PkiError, match="certificate request key"):
        pki.check_csr(broken)


def test_enrollment_peer_pinning(ca: pki.FleetCa) -> None:
    _, controller = enroll(ca, Role.CONTROLLER)
    _, agent = enroll(ca)
    ca_pem = pki.certificate_pem(ca.certificate).decode()
    fingerprint = pki.certificate_fingerprint(ca.certificate)
    controller_der = controller.public_bytes(serialization.Encoding.DER)
    assert pki.verify_enrollment_peer(controller_der, ca_pem, fingerprint, NOW) == ca.certificate
    with pytest.raises(pki.PkiError, match="fingerprint differs"):
        pki.verify_enrollment_peer(controller_der, ca_pem, "0" * 64, NOW)
    with pytest.raises(pki.PkiError, match="not the controller's"):
        pki.verify_enrollment_peer(agent.public_bytes(serialization.Encoding.DER), ca_pem, fingerprint, NOW)
    impostor_ca = pki.create_fleet_ca("ACME office", NOW)
    _, impostor = enroll(impostor_ca, Role.CONTROLLER)
    with pytest.raises(pki.PkiError, match="not issued by this fleet's CA"):
        pki.verify_enrollment_peer(impostor.public_bytes(serialization.Encoding.DER), ca_pem,
                                   fingerprint, NOW)


def test_private_key_file_is_owner_only(tmp_path: Path) -> None:
    key = pki.create_private_key()
    path = tmp_path / "agent.key"
    path.write_text("old, world readable")
    path.chmod(0o644)
    pki.write_private_key(path, key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = pki.load_private_key_pem(path.read_bytes())
    assert pki.agent_id_for_key(loaded.public_key()) == pki.agent_id_for_key(key.public_key())
    assert [p.name for p in tmp_path.iterdir()] == ["agent.key"]
    with pytest.raises(pki.PkiError, match="private key"):
        pki.load_private_key_pem(b"nope")


def test_an_expired_certificate_or_ca_is_named_with_its_day_and_the_fix(ca: pki.FleetCa) -> None:
    # It said "certificate is not valid at <now> (valid <from> to <until>)": whose, and what to do, it did not say
    _, controller = enroll(ca, Role.CONTROLLER)
    after = NOW + datetime.timedelta(days=826)
    with pytest.raises(pki.CertificateExpired) as expired:
        pki.verify_certificate(controller, ca.certificate, after)
    assert not expired.value.is_ca and expired.value.not_valid_after == NOW + datetime.timedelta(days=825)
    assert "certificate of controller" in str(expired.value) and "expired on 2028-06-03" in str(expired.value)
    assert "delete controller.pem" in str(expired.value)
    # and the date the clock that judged it says: a controller's clock that ran ahead 830 days was told only to
    # make its certificate again (and at 4,000 days to make the fleet anew)
    assert str(expired.value).endswith(" (by the clock of the PC checking it, which says 2028-06-04: where that clock "
                                       "is wrong, set it right instead)")
    short_ca = pki.create_fleet_ca("ACME office", NOW, valid_days=30)
    _, agent = enroll(short_ca)  # outlives its CA
    with pytest.raises(pki.CertificateExpired, match=r"fleet CA .* expired on 2026-03-31: .*fleet init --force") as old:
        pki.verify_certificate(agent, short_ca.certificate, NOW + datetime.timedelta(days=31))
    assert old.value.is_ca and old.value.not_valid_after == NOW + datetime.timedelta(days=30)


def test_expiry_notice_within_the_warning_days_only() -> None:
    assert pki.EXPIRY_WARNING_DAYS == 60
    until = datetime.datetime(2027, 3, 1, 12, 0, tzinfo=datetime.UTC)
    assert pki.expiry_notice(until, until - datetime.timedelta(days=61)) is None
    assert pki.expiry_notice(until, until - datetime.timedelta(days=60)) == "expires 2027-03-01 (in 60 days)"
    assert pki.expiry_notice(until, until - datetime.timedelta(days=41, hours=3)) == "expires 2027-03-01 (in 41 days)"
    assert pki.expiry_notice(until, until - datetime.timedelta(days=1)) == "expires 2027-03-01 (in 1 day)"
    assert pki.expiry_notice(until, until - datetime.timedelta(hours=5)) == "expires 2027-03-01 (in less than a day)"
    assert pki.expiry_notice(until, until + datetime.timedelta(seconds=1)) == "expired on 2027-03-01"
    assert pki.expiry_notice(until, until - datetime.timedelta(days=100), within_days=120) is not None


def test_a_removal_is_signed_by_the_ca_alone_and_for_one_agent_only(ca: pki.FleetCa) -> None:
    agent_id = pki.agent_id_for_key(pki.create_private_key().public_key())
    other_id = pki.agent_id_for_key(pki.create_private_key().public_key())
    signature = pki.sign_removal(ca, agent_id)
    assert len(signature) == 64
    pki.check_removal(ca.certificate, agent_id, signature)
    with pytest.raises(pki.PkiError, match=f"removal of agent {other_id[:12]} is not signed by this fleet's CA"):
        pki.check_removal(ca.certificate, other_id, signature)  # one agent's removal does not remove another
    stranger = pki.create_fleet_ca("another fleet", NOW)
    with pytest.raises(pki.PkiError, match="not signed by this fleet's CA"):
        pki.check_removal(ca.certificate, agent_id, pki.sign_removal(stranger, agent_id))
    member_key, _ = enroll(ca)  # a member's key signs nothing the CA's check accepts
    forged = pki.sign_removal(pki.FleetCa(ca.certificate, member_key), agent_id)
    with pytest.raises(pki.PkiError, match="not signed by this fleet's CA"):
        pki.check_removal(ca.certificate, agent_id, forged)
    for malformed in (b"", signature[:-1], signature + b"\0"):
        with pytest.raises(pki.PkiError, match="malformed signature"):
            pki.check_removal(ca.certificate, agent_id, malformed)
    for wrong in (signature[:-1] + bytes([signature[-1] ^ 1]), bytes(64), b"\xff" * 64):  # r or s out of range too
        with pytest.raises(pki.PkiError, match="not signed"):
            pki.check_removal(ca.certificate, agent_id, wrong)


@pytest.mark.parametrize("name", ["", "   ", "x" * 65, "x" * 500])
def test_a_fleet_name_x509_cannot_hold_is_refused(name: str) -> None:
    # it went into the CA certificate's organization name, which X.509 bounds at 64 characters
    with pytest.raises(ValueError, match=r"a fleet name must be 1 to 64 characters, not blank"):
        pki.create_fleet_ca(name, datetime.datetime.now(datetime.UTC))
    assert pki.create_fleet_ca("x" * 64, datetime.datetime.now(datetime.UTC)).certificate


def test_a_clock_near_the_year_9999_is_named() -> None:
    # `fleet init` on a PC whose clock said 9995 raised an OverflowError's traceback
    with pytest.raises(pki.PkiError, match=r"valid 3650 days from 9995-01-01 would end past the year 9999: is this "
                                           r"PC's clock right\?"):
        pki.create_fleet_ca("test", datetime.datetime(9995, 1, 1, tzinfo=datetime.UTC))
