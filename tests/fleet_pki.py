"""Test helpers: a throwaway fleet CA and member credentials on disk (no controller process)."""

from __future__ import annotations

from pathlib import Path

from deskfleet.agent.link import TlsFiles, utc_now
from deskfleet.common import pki
from deskfleet.common.wire import Role


def make_ca(folder: Path, name: str = "test fleet") -> pki.FleetCa:
    ca = pki.create_fleet_ca(name, utc_now())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.pem").write_bytes(pki.certificate_pem(ca.certificate))
    return ca


def make_member(ca: pki.FleetCa, folder: Path, name: str, role: Role = Role.AGENT) -> TlsFiles:
    """Key + certificate signed by `ca`, in `folder` as TlsFiles.in_folder(folder, name)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles.in_folder(folder, name)
    key = pki.create_private_key()
    certificate = pki.sign_csr(ca, pki.create_csr(key, name), utc_now(), role=role)
    files.ca_path.write_bytes(pki.certificate_pem(ca.certificate))
    files.cert_path.write_bytes(pki.certificate_pem(certificate))
    pki.write_private_key(files.key_path, key)
    return files
