"""The agent warns of its own certificate and of the fleet CA running out: at start, then once a day."""

from __future__ import annotations

import asyncio
import datetime
import logging
from pathlib import Path

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.enroll import Membership
from deskfleet.agent.link import LinkRefused, utc_now
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import AgentOptions, AgentService
from deskfleet.common import pki
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_ca, make_member
from tests.ports import free_address

DAY = datetime.timedelta(days=1)


def joined(data_dir: Path, valid_days: int = 825, ca_valid_days: int = 3650,
           made: datetime.datetime | None = None) -> AgentService:
    """An agent whose certificate (made at `made`, default now) is valid `valid_days`, under a CA of `ca_valid_days`."""
    state = AgentPaths.resolve(data_dir).state_dir
    files = make_member(make_ca(data_dir / "ca", now=made, valid_days=ca_valid_days), state, "agent", now=made,
                        valid_days=valid_days)
    state.chmod(0o700)  # as a join makes it
    Membership(pki.fleet_id(files.ca_certificate()), files.own_identity().agent_id, "c" * 52,
               ("127.0.0.1:1",)).save(state)
    return AgentService(AgentOptions(data_dir, listen=free_address()), monitor=FakeMonitor())


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(record.levelno, record.getMessage()) for record in caplog.records
            if record.name == service_module.log.name and "expire" in record.getMessage()]


def test_a_certificate_running_out_within_60_days_is_warned_of_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Nothing said so until the day every link of the PC failed
    service = joined(tmp_path, valid_days=41)

    async def briefly() -> None:
        asyncio.get_running_loop().call_later(0.3, service.stop)
        await service.run()

    with caplog.at_level(logging.INFO, logger="deskfleet"):
        asyncio.run(briefly())
    day = (utc_now() + 41 * DAY).date().isoformat()
    assert logged(caplog) == [(logging.WARNING, f"this PC's fleet certificate ({service.files.cert_path}) expires "
                                                f"{day} (in 40 days): nothing renews it; join the fleet again with a "
                                                "new token from its admin: `deskfleet-agent join TOKEN --data-dir "
                                                f"{tmp_path}`")]


def test_the_certificates_are_checked_again_once_a_day(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    service = joined(tmp_path, valid_days=100, ca_valid_days=130)
    with caplog.at_level(logging.WARNING, logger="deskfleet"):
        service.check_certificates(utc_now())
    assert logged(caplog) == []  # more than 60 days to go for both
    days = iter(range(1, 1000))
    sleeps: list[float] = []

    async def a_day_passes(delay: float) -> None:
        sleeps.append(delay)
        if len(sleeps) == 3:
            raise asyncio.CancelledError

    monkeypatch.setattr(service_module.asyncio, "sleep", a_day_passes)
    monkeypatch.setattr(service_module, "utc_now", lambda: utc_now() + (40 + next(days)) * DAY)
    with caplog.at_level(logging.WARNING, logger="deskfleet"), pytest.raises(asyncio.CancelledError):
        asyncio.run(service._check_certificates_forever())
    assert sleeps == [86400.0] * 3
    warnings = logged(caplog)
    assert [level for level, _ in warnings] == [logging.WARNING] * 2  # one a day, the CA still has over 60 days
    assert all("this PC's fleet certificate" in text and "(in 58 days)" in warnings[0][1] for _, text in warnings)
    ca_day = service.files.ca_certificate().not_valid_after_utc
    service.check_certificates(ca_day - 59 * DAY)
    ca_line = logged(caplog)[-1][1]
    assert ca_line == (f"the fleet CA ({service.files.ca_path}) expires {pki.expiry_date(ca_day)} (in 59 days): "
                       "nothing renews it; the fleet's admin must make a new fleet (`deskfleet fleet init --force`), "
                       f"then join this PC to it with a new token: `deskfleet-agent join TOKEN --data-dir {tmp_path}`")


def test_a_pc_whose_certificate_ran_out_is_told_so_not_that_it_was_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The controller refuses an expired certificate with HTTP 403, as it does a removed agent
    service = joined(tmp_path, valid_days=1, made=utc_now() - 10 * DAY)

    async def refused(*args: object, **kwargs: object) -> object:
        raise LinkRefused("127.0.0.1:1 refused the link: HTTP 403 the certificate of agent x expired on ...", 403)

    sleeps: list[float] = []

    async def record(delay: float) -> None:
        sleeps.append(delay)
        if len(sleeps) == 3:
            raise asyncio.CancelledError

    monkeypatch.setattr(service_module, "open_link", refused)
    monkeypatch.setattr(service_module.asyncio, "sleep", record)
    told: list[str] = []
    monkeypatch.setattr(service_module.log, "error", lambda text, *args: told.append(text % args))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(service._register_forever())
    day = (utc_now() - 9 * DAY).date().isoformat()
    assert len(told) == 1 and "removed" not in told[0]
    assert told[0].startswith("the controller refuses this PC: this PC's fleet certificate "
                              f"({service.files.cert_path}) expired on {day}: nothing renews it; join the fleet again")


def test_a_fleet_key_open_to_other_users_is_warned_of_at_start(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # the controller's keys were warned of; this PC's key, restored 0644 from a backup, passed without a word
    joined(tmp_path)
    key = AgentPaths.resolve(tmp_path).state_dir / "agent-key.pem"
    with caplog.at_level(logging.WARNING, logger="deskfleet"):
        AgentService(AgentOptions(tmp_path, listen=free_address()), monitor=FakeMonitor())
        assert not any("open to other users" in record.getMessage() for record in caplog.records)
        key.chmod(0o644)
        AgentService(AgentOptions(tmp_path, listen=free_address()), monitor=FakeMonitor())
    assert [record.getMessage() for record in caplog.records if "open to other users" in record.getMessage()] == [
        f"{key} (this PC's fleet key) is open to other users (mode 644): whoever reads it can pose as this PC to "
        f"the fleet, and be sent the stages and prompts it would get; run `chmod 600 {key}`"]
    assert pki.open_key_mode(key) == 0o644
    key.chmod(0o600)
    assert pki.open_key_mode(key) is None and pki.open_key_mode(tmp_path / "missing.pem") is None
