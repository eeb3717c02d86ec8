from __future__ import annotations

import contextlib
import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest

from deskfleet.common import pki, tls
from deskfleet.common.wire import Role

NOW = datetime.datetime.now(datetime.UTC)  # OpenSSL checks validity against the real clock


@dataclass(frozen=True)
class Member:
    agent_id: str
    ca_path: Path
    cert_path: Path
    key_path: Path


def make_member(folder: Path, ca: pki.FleetCa, name: str, role: Role = Role.AGENT) -> Member:
    key = pki.create_private_key()
    certificate = pki.sign_csr(ca, pki.create_csr(key, name), NOW, role=role)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.pem").write_bytes(pki.certificate_pem(ca.certificate))
    (folder / "cert.pem").write_bytes(pki.certificate_pem(certificate))
    pki.write_private_key(folder / "key.pem", key)
    return Member(pki.agent_id_for_key(key.public_key()), folder / "ca.pem", folder / "cert.pem",
                  folder / "key.pem")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Member]:
    root = tmp_path_factory.mktemp("fleet")
    ca = pki.create_fleet_ca("ACME", NOW)
    stranger_ca = pki.create_fleet_ca("ACME", NOW)
    return {"controller": make_member(root / "controller", ca, "ctl", Role.CONTROLLER),
            "agent": make_member(root / "agent", ca, "desk-1"),
            "stranger": make_member(root / "stranger", stranger_ca, "desk-x")}


def server(member: Member) -> ssl.SSLContext:
    return tls.server_context(ca_path=member.ca_path, cert_path=member.cert_path, key_path=member.key_path)


def client(member: Member, pin: bool = True) -> ssl.SSLContext:
    return tls.client_context(ca_path=member.ca_path, cert_path=member.cert_path, key_path=member.key_path,
                              pin_agent_id=pin)


def handshake(client_context: ssl.SSLContext, server_context: ssl.SSLContext,
              server_hostname: str | None) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """Run a TLS handshake over memory BIOs, then one byte each way; raise the first side's SSLError."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_side = client_context.wrap_bio(to_client, to_server, server_hostname=server_hostname)
    server_side = server_context.wrap_bio(to_server, to_client, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for name, side in (("client", client_side), ("server", server_side)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    pass
        if all(done.values()):
            break
    assert all(done.values()), done
    client_side.write(b"c")
    assert server_side.read(1) == b"c"  # a TLS 1.3 server checks the client cert here at the latest
    server_side.write(b"s")
    assert client_side.read(1) == b"s"
    return client_side, server_side


def test_fleet_members_connect_and_learn_each_others_ids(fleet: dict[str, Member]) -> None:
    agent, controller = fleet["agent"], fleet["controller"]
    client_side, server_side = handshake(client(controller), server(agent), agent.agent_id)
    assert client_side.version() == "TLSv1.3"
    server_der = client_side.getpeercert(binary_form=True)
    client_der = server_side.getpeercert(binary_form=True)
    assert server_der is not None and client_der is not None
    assert tls.peer_agent_id(server_der) == agent.agent_id
    assert tls.peer_agent_id(client_der) == controller.agent_id
    ca = pki.load_certificate_pem(agent.ca_path.read_bytes())
    identity = tls.peer_identity(client_der, ca, NOW, pki.RevocationSet())
    assert identity.role is Role.CONTROLLER
    with pytest.raises(pki.PkiError, match="removed"):
        tls.peer_identity(client_der, ca, NOW, pki.RevocationSet().with_revoked(controller.agent_id))


def test_client_without_certificate_is_refused(fleet: dict[str, Member]) -> None:
    agent = fleet["agent"]
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cafile=str(agent.ca_path))
    with pytest.raises(ssl.SSLError, match=r"CERTIFICATE|certificate"):
        handshake(bare, server(agent), agent.agent_id)


def test_client_from_another_ca_is_refused(fleet: dict[str, Member]) -> None:
    agent, stranger = fleet["agent"], fleet["stranger"]
    impostor = tls.client_context(ca_path=agent.ca_path, cert_path=stranger.cert_path,
                                  key_path=stranger.key_path)
    with pytest.raises(ssl.SSLError, match=r"certificate|unknown ca"):
        handshake(impostor, server(agent), agent.agent_id)


def test_server_from_another_ca_or_with_another_id_is_refused(fleet: dict[str, Member]) -> None:
    agent, controller, stranger = fleet["agent"], fleet["controller"], fleet["stranger"]
    with pytest.raises(ssl.SSLCertVerificationError, match=r"unable to get local issuer|certificate"):
        handshake(client(controller), server(stranger), stranger.agent_id)
    with pytest.raises(ssl.SSLCertVerificationError, match=r"[Hh]ostname mismatch"):
        handshake(client(controller), server(agent), controller.agent_id)
    handshake(client(controller, pin=False), server(agent), None)


def test_plaintext_and_old_tls_are_refused(fleet: dict[str, Member]) -> None:
    agent = fleet["agent"]
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_side = server(agent).wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ssl.SSLError):
        server_side.do_handshake()
    old = client(fleet["controller"])
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    old.minimum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError, match=r"UNSUPPORTED_PROTOCOL|version"):
        handshake(old, server(agent), agent.agent_id)


def test_contexts_trust_only_the_fleet_ca(fleet: dict[str, Member]) -> None:
    context = client(fleet["agent"])
    assert len(context.get_ca_certs()) == 1
    assert context.minimum_version == context.maximum_version == ssl.TLSVersion.TLSv1_3
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert server(fleet["agent"]).verify_mode == ssl.CERT_REQUIRED


def test_enrollment_pins_the_ca_from_the_token(fleet: dict[str, Member]) -> None:
    controller = fleet["controller"]
    enrollment = tls.enrollment_server_context(cert_path=controller.cert_path, key_path=controller.key_path)
    client_side, _ = handshake(tls.enrollment_client_context(), enrollment, None)
    peer_der = client_side.getpeercert(binary_form=True)
    assert peer_der is not None
    ca_pem = controller.ca_path.read_text()
    ca = pki.load_certificate_pem(ca_pem.encode())
    fingerprint = pki.certificate_fingerprint(ca)
    assert pki.verify_enrollment_peer(peer_der, ca_pem, fingerprint, NOW) == ca
    stranger = fleet["stranger"]
    fake = tls.enrollment_server_context(cert_path=stranger.cert_path, key_path=stranger.key_path)
    client_side, _ = handshake(tls.enrollment_client_context(), fake, None)
    fake_der = client_side.getpeercert(binary_form=True)
    assert fake_der is not None
    with pytest.raises(pki.PkiError):
        pki.verify_enrollment_peer(fake_der, ca_pem, fingerprint, NOW)


def server_side_error(client_context: ssl.SSLContext, server_context: ssl.SSLContext,
                      server_hostname: str | None) -> ssl.SSLError:
    """The error the server side of a handshake over memory BIOs raises (the client side may fail too)."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_side = client_context.wrap_bio(to_client, to_server, server_hostname=server_hostname)
    server_side = server_context.wrap_bio(to_server, to_client, server_side=True)
    for _ in range(20):
        with contextlib.suppress(ssl.SSLError):  # want read/write, or the client's own refusal of the server
            client_side.do_handshake()
        try:
            server_side.do_handshake()
            client_side.write(b"c")
            server_side.read(1)  # a TLS 1.3 server checks the client's certificate here at the latest
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            continue
        except ssl.SSLError as error:
            return error
    raise AssertionError("the server took the handshake")


def test_a_refused_handshake_is_told_as_what_it_means_to_an_admin(fleet: dict[str, Member]) -> None:
    agent, stranger = fleet["agent"], fleet["stranger"]
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.load_verify_locations(cafile=str(agent.ca_path))
    impostor = tls.client_context(ca_path=agent.ca_path, cert_path=stranger.cert_path, key_path=stranger.key_path)
    assert tls.refusal(server_side_error(bare, server(agent), agent.agent_id)) == \
        "a TLS client without a certificate"
    assert tls.refusal(server_side_error(impostor, server(agent), agent.agent_id)) == \
        "a certificate this fleet's CA did not sign"
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    plain = server(agent).wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ssl.SSLError) as raised:
        plain.do_handshake()
    assert tls.refusal(raised.value) == "plain HTTP, not TLS"
    unknown = ssl.SSLError(1, "[SSL: SOMETHING_NEW] something new")
    unknown.reason = "SOMETHING_NEW"
    assert tls.refusal(unknown) == "SOMETHING_NEW ([SSL: SOMETHING_NEW] something new)"
    # a peer that hung up, or a connection that broke, refused nothing (a port scan)
    for nothing_refused in (ssl.SSLEOFError(8, "EOF"), ssl.SSLZeroReturnError(6, "closed"), ConnectionResetError(),
                            TimeoutError(), OSError("broken")):
        assert tls.refusal(nothing_refused) is None

