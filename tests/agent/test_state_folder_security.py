"""The agent's state folder (its key, certificate, the fleet CA and its membership) as it finds it: one open to other
users is closed, one another user owns is refused, a credential that is a link is refused, and credentials of two
fleets or two agents are refused at start. A security walk found a state folder made beforehand with mode 0777 and a
link in place of agent-key.pem: the join wrote the key to the link's target, and an agent whose ca.pem was swapped
for another fleet's started and answered that fleet's controller."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from pathlib import Path

import pytest

from deskfleet.agent.enroll import EnrollmentError, Membership, join, secure_state_dir
from deskfleet.agent.link import utc_now
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentOptions, AgentService
from deskfleet.common import join_tokens, pki
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_ca, make_member
from tests.ports import free_address

posix_only = pytest.mark.skipif(os.name == "nt", reason="file modes and owners are POSIX's")


def _token() -> str:
    token = join_tokens.JoinToken(("127.0.0.1:1",), "0" * 64, join_tokens.new_secret(),
                                  (utc_now() + datetime.timedelta(hours=1)).replace(microsecond=0))
    return join_tokens.encode_join_token(token)


def _joined(data_dir: Path, ca: pki.FleetCa | None = None) -> Path:
    """A state folder as a join leaves it (mode 0700); returns it."""
    state = AgentPaths.resolve(data_dir).state_dir
    files = make_member(ca or make_ca(data_dir / "ca"), state, "agent")
    state.chmod(0o700)
    Membership(pki.fleet_id(files.ca_certificate()), files.own_identity().agent_id, "c" * 52,
               ("127.0.0.1:1",)).save(state)
    return state


def _start(data_dir: Path) -> AgentService:
    return AgentService(AgentOptions(data_dir, listen=free_address()), monitor=FakeMonitor())


@posix_only
def test_a_state_folder_open_to_other_users_is_closed_with_a_warning(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    state = _joined(tmp_path)
    with caplog.at_level(logging.WARNING, logger="deskfleet"):
        _start(tmp_path)
        assert not any("state folder" in record.getMessage() for record in caplog.records)
        state.chmod(0o777)
        _start(tmp_path)
    assert (state.stat().st_mode & 0o777) == 0o700
    assert [record.getMessage() for record in caplog.records if "state folder" in record.getMessage()] == [
        f"the agent's state folder {state} was open to other users (mode 777): made it readable by its owner only "
        "(0700); check that no one else put a file there"]


def test_a_join_into_a_state_folder_whose_key_is_a_link_writes_nothing_through_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (state / "agent-key.pem").symlink_to(elsewhere / "stolen-key.pem")
    with pytest.raises(EnrollmentError, match=rf"{state / 'agent-key.pem'} is a symbolic link \(to "
                                              rf"{elsewhere / 'stolen-key.pem'}\): .*remove the link"):
        asyncio.run(join(_token(), state))
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("name", ["ca.pem", "agent.pem", "membership.json"])
def test_an_agent_whose_credential_is_a_link_does_not_start(tmp_path: Path, name: str) -> None:
    state = _joined(tmp_path)
    moved = tmp_path / f"moved-{name}"
    (state / name).rename(moved)
    (state / name).symlink_to(moved)
    with pytest.raises(EnrollmentError, match=rf"{state / name} is a symbolic link"):
        _start(tmp_path)


@posix_only
def test_a_state_folder_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    mine = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: mine + 1)  # the agent runs as another user than the folder's
    with pytest.raises(EnrollmentError, match=rf"state folder {state} belongs to another user \(uid {mine}\), not to "
                                              rf"the one running the agent \(uid {mine + 1}\)"):
        secure_state_dir(state)


@posix_only
@pytest.mark.skipif(os.name == "nt" or os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_credential_another_user_put_in_the_folder_is_refused(tmp_path: Path) -> None:
    # planted while the folder was open: a consistent ca.pem, agent.pem and membership.json pass every other check
    state = _joined(tmp_path)
    os.chown(state / "ca.pem", 65534, 65534)
    with pytest.raises(EnrollmentError, match=rf"{state / 'ca.pem'} belongs to another user \(uid 65534\)"):
        _start(tmp_path)


def test_an_agent_with_another_fleets_ca_does_not_start(tmp_path: Path) -> None:
    state = _joined(tmp_path)
    make_ca(tmp_path / "other")
    (state / "ca.pem").write_bytes((tmp_path / "other" / "ca.pem").read_bytes())
    with pytest.raises(EnrollmentError, match=rf"{state / 'ca.pem'} is the CA of fleet \w{{12}}, not of fleet \w{{12}} "
                                              r"this PC joined \(its membership\.json\): the state folder was altered"):
        _start(tmp_path)


def test_an_agent_whose_certificate_is_another_agents_or_another_cas_does_not_start(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    state = _joined(tmp_path, ca)
    other = make_member(ca, tmp_path / "other", "agent")  # the same fleet, another PC
    (state / "agent.pem").write_bytes(other.cert_path.read_bytes())
    with pytest.raises(EnrollmentError, match=r"agent\.pem names agent \w{12}, not agent \w{12} of its "
                                              r"membership\.json"):
        _start(tmp_path)
    foreign = make_member(make_ca(tmp_path / "foreign"), tmp_path / "foreign", "agent")
    (state / "agent.pem").write_bytes(foreign.cert_path.read_bytes())
    with pytest.raises(EnrollmentError, match=r"agent\.pem was not issued by the fleet's CA"):
        _start(tmp_path)


@posix_only
def test_the_shard_cache_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    # the models' weights sat in 0444 files in 0755 folders: every local user could read them
    paths = AgentPaths.resolve(tmp_path / "agent")
    paths.create()
    assert (paths.cache_dir.stat().st_mode & 0o777) == 0o700
    paths.cache_dir.chmod(0o755)  # made by an earlier deskfleet
    paths.create()
    assert (paths.cache_dir.stat().st_mode & 0o777) == 0o700
