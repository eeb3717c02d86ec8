"""Test helpers: a throwaway fleet CA and member credentials on disk (no controller process)."""

from __future__ import annotations

import datetime
from pathlib import Path

from deskfleet.agent.link import TlsFiles, utc_now
from deskfleet.common import pki
from deskfleet.common.wire import RevocationUpdate, Role

# The expiry of a PeerIdentity a fake link carries: far beyond any test.
FAR_FUTURE = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)


def make_ca(folder: Path, name: str = "test fleet", now: datetime.datetime | None = None,
            valid_days: int = 3650) -> pki.FleetCa:
    """A CA made at `now` (default: the clock) for `valid_days`; an old `now` and few days make an expired one."""
    ca = pki.create_fleet_ca(name, now or utc_now(), valid_days)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.pem").write_bytes(pki.certificate_pem(ca.certificate))
    return ca


def make_member(ca: pki.FleetCa, folder: Path, name: str, role: Role = Role.AGENT,
                now: datetime.datetime | None = None, valid_days: int = 825) -> TlsFiles:
    """Key + certificate signed by `ca` at `now` (default: the clock) for `valid_days`, in `folder` as
    TlsFiles.in_folder(folder, name)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = TlsFiles.in_folder(folder, name)
    key = pki.create_private_key()
    certificate = pki.sign_csr(ca, pki.create_csr(key, name), now or utc_now(), role=role, valid_days=valid_days)
    files.ca_path.write_bytes(pki.certificate_pem(ca.certificate))
    files.cert_path.write_bytes(pki.certificate_pem(certificate))
    pki.write_private_key(files.key_path, key)
    return files


def removals(ca: pki.FleetCa, *agent_ids: str) -> RevocationUpdate:
    """The list of removed agents as `fleet serve` sends it: each signed by `ca`."""
    return RevocationUpdate.of(agent_ids, [pki.sign_removal(ca, agent_id) for agent_id in agent_ids])
