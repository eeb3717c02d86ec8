"""A join whose credentials cannot be written (a full disk, a read-only folder) leaves the PC in the fleet it was
in. The CA and the certificate were written in place before the membership: a join into a second fleet that met
the disk's last byte at the membership left that fleet's CA beside the first fleet's membership, and the agent
refused to start in either."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.agent.enroll import (
    MEMBERSHIP_FILE,
    EnrollmentError,
    Membership,
    agent_tls_files,
    check_credentials,
    join,
)
from deskfleet.agent.link import utc_now
from deskfleet.common import atomic_file
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import token_for, with_server

_real_fsync = os.fsync


def _full_at(name: str) -> Callable[[int], None]:
    """An fsync that finds the disk full for a temporary file of `name` (write_atomic's `.NAME.XXXX.tmp`)."""
    def fsync(descriptor: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{descriptor}")).name.startswith(f".{name}."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _real_fsync(descriptor)

    return fsync


def test_a_join_that_cannot_write_its_membership_keeps_the_fleet_the_pc_was_in(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "pc" / "state"

    async def first(server: FleetServer, address: str) -> None:
        await join(token_for(store, address), state, "pc-1")

    with_server(store, first)
    before = {path.name: path.read_bytes() for path in state.iterdir()}
    assert {"ca.pem", "agent.pem", MEMBERSHIP_FILE} <= set(before)

    monkeypatch.setattr(atomic_file.os, "fsync", _full_at(MEMBERSHIP_FILE))
    other = FleetStore(tmp_path / "other-controller")
    init_fleet(other, "other", ("127.0.0.1:1",), utc_now())

    async def second(server: FleetServer, address: str) -> None:
        with pytest.raises(EnrollmentError) as refused:
            await join(token_for(other, address), state, "pc-1")
        said = str(refused.value)
        assert f"its credentials could not be written to {state}: No space left on device" in said
        assert "this PC stays in the fleet it was in, as it was" in said and "ask the admin for a new one" in said

    with_server(other, second)
    assert {path.name: path.read_bytes() for path in state.iterdir()} == before  # no temporary file left either
    membership = Membership.load(state)
    check_credentials(agent_tls_files(state), membership, "join")  # the first fleet's, whole


def test_a_first_join_that_cannot_write_leaves_only_the_key(store: FleetStore, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "pc" / "state"
    monkeypatch.setattr(atomic_file.os, "fsync", _full_at("agent.pem"))

    async def joins(server: FleetServer, address: str) -> None:
        with pytest.raises(EnrollmentError, match="nothing of the new fleet was written"):
            await join(token_for(store, address), state, "pc-1")

    with_server(store, joins)
    assert sorted(path.name for path in state.iterdir()) == ["agent-key.pem"]  # as docs/fleet.md says
