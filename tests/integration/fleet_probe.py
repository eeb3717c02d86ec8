"""Hostile and revoked clients for test_fleet.py, run as a process (inside the controller's namespace).

    python -m tests.integration.fleet_probe strangers AGENT_ADDRESS WORK_DIR
    python -m tests.integration.fleet_probe revoked CONTROLLER_ADDRESS CONTROLLER_ID AGENT_STATE_DIR
Prints one JSON object: for each attempt, whether it was refused and how.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import sys
from pathlib import Path

import numpy as np

from deskfleet.agent.enroll import agent_tls_files
from deskfleet.agent.link import LinkError, TlsFiles, open_link, utc_now
from deskfleet.common import pki, tls
from deskfleet.common.kv_ledger import AppendSlots
from deskfleet.common.wire import Forward, Role, encode, parse_address


def poison_forward() -> bytes:
    """A Forward that would desync any stage it reached (positions start at 7 on a fresh mirror)."""
    append = AppendSlots(count=1, live_counts=(1,), first_positions=(7,))
    return encode(Forward(999, 0, (0,), (append,), np.zeros(1, np.int64), np.array([[7]], np.int64),
                          np.array([[1]], np.int64), None, None))


def plain_tcp(address: str) -> str:
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n" + poison_forward())
        try:
            answer = raw.recv(4096)
        except (ConnectionResetError, TimeoutError) as error:
            return f"refused: {type(error).__name__}"
    return "refused: closed" if not answer.startswith(b"HTTP/1.1 101") else "ACCEPTED"


def tls_without_certificate(address: str) -> str:
    host, port = parse_address(address)
    context = tls.enrollment_client_context()
    try:
        with socket.create_connection((host, port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=host) as wrapped:
            wrapped.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n" + poison_forward())
            answer = wrapped.recv(4096)
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as error:
        return f"refused: {type(error).__name__}: {error}"
    return "refused: closed" if not answer.startswith(b"HTTP/1.1 101") else "ACCEPTED"


async def foreign_certificate(address: str, work_dir: Path) -> str:
    now = utc_now()
    foreign_ca = pki.create_fleet_ca("someone else", now)
    key = pki.create_private_key()
    certificate = pki.sign_csr(foreign_ca, pki.create_csr(key, "intruder"), now, role=Role.CONTROLLER)
    files = TlsFiles.in_folder(work_dir, "intruder")
    work_dir.mkdir(parents=True, exist_ok=True)
    files.ca_path.write_bytes(pki.certificate_pem(foreign_ca.certificate))
    files.cert_path.write_bytes(pki.certificate_pem(certificate))
    pki.write_private_key(files.key_path, key)
    try:
        link = await open_link(address, files)
    except LinkError as error:
        return f"refused: {error}"
    await link.connection.send(poison_forward())
    await link.close()
    return "ACCEPTED"


async def strangers(address: str, work_dir: Path) -> dict[str, str]:
    return {"plain_tcp": plain_tcp(address), "tls_no_certificate": tls_without_certificate(address),
            "foreign_ca": await foreign_certificate(address, work_dir)}


async def revoked(controller_address: str, controller_id: str, state_dir: Path) -> dict[str, str]:
    try:
        link = await open_link(controller_address, agent_tls_files(state_dir), expected_agent_id=controller_id)
    except LinkError as error:
        return {"revoked_agent": f"refused: {error}"}
    await link.close()
    return {"revoked_agent": "ACCEPTED"}


def main(argv: list[str]) -> int:
    if argv[0] == "strangers":
        result = asyncio.run(strangers(argv[1], Path(argv[2])))
    else:
        result = asyncio.run(revoked(argv[1], argv[2], Path(argv[3])))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
