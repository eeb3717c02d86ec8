"""Security review: what a certificate request can and cannot choose in the certificate the fleet CA signs."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import NameOID

from deskfleet.common import pki
from deskfleet.common.wire import Role

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def test_a_hostname_longer_than_a_common_name_still_makes_a_request() -> None:
    key = pki.create_private_key()
    csr = pki.create_csr(key, "h" * 300)  # `deskfleet-agent join --hostname` of any length: it was a ValueError
    assert pki.check_csr(csr) == pki.agent_id_for_key(key.public_key())


def test_a_request_that_asks_for_a_controller_ca_certificate_gets_an_agent_leaf() -> None:
    ca = pki.create_fleet_ca("review", NOW)
    key = pki.create_private_key()
    other_id = pki.agent_id_for_key(pki.create_private_key().public_key())
    greedy = (x509.CertificateSigningRequestBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, other_id),
                                       x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, Role.CONTROLLER.value)]))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .add_extension(x509.SubjectAlternativeName([x509.DNSName(other_id)]), critical=False)
              .sign(key, hashes.SHA256()))
    certificate = pki.sign_csr(ca, greedy, NOW)
    identity = pki.verify_certificate(certificate, ca.certificate, NOW)
    assert identity.role is Role.AGENT
    assert identity.agent_id == pki.agent_id_for_key(key.public_key()) != other_id
    assert not certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
        .get_values_for_type(x509.DNSName) == [identity.agent_id]
