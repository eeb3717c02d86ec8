"""AgentService's mDNS advertisement: the record it builds from the settings and the status, and a status
that fails once. The Advertiser is a fake: nothing is sent."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.advertise import advertised_addresses
from deskfleet.agent.paths import AgentSettings
from deskfleet.agent.service import AgentService
from deskfleet.common import pki
from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import AgentRecord
from deskfleet.common.wire import ProtocolError, StatusReport

AGENT = "a" * 52


@dataclass
class FakeCore:
    failures: dict[int, Exception] = field(default_factory=dict)  # raised by the status() call of that number
    agent_id: str = AGENT
    calls: int = 0

    async def status(self) -> StatusReport:
        self.calls += 1
        if self.calls - 1 in self.failures:
            raise self.failures[self.calls - 1]
        return StatusReport(AgentState.AVAILABLE, 1 << 30, 0.1, None, None, None, None, (), None)


class FakeAdvertiser:
    records: ClassVar[list[AgentRecord]] = []

    def __init__(self, record: AgentRecord, port: int, addresses: Any) -> None:
        self.records.append(record)

    async def __aenter__(self) -> FakeAdvertiser:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def update(self, record: AgentRecord) -> bool:
        self.records.append(record)
        return True


def advertised(device: str, failures: dict[int, Exception], monkeypatch: pytest.MonkeyPatch) -> list[AgentRecord]:
    """The records a service with `device` advertises, first and refreshed, until it has five."""
    monkeypatch.setattr(service_module, "Advertiser", FakeAdvertiser)
    monkeypatch.setattr(service_module, "ADVERTISE_REFRESH_S", 0.0)
    FakeAdvertiser.records = []
    service = AgentService.__new__(AgentService)
    service.settings = AgentSettings(device=device)
    service.core = FakeCore(failures)  # type: ignore[assignment]
    service.membership = SimpleNamespace(fleet_id="0123456789abcdef")  # type: ignore[assignment]
    service.bound_port = 7431

    async def scenario() -> None:
        task = asyncio.create_task(service._advertise_forever("10.99.0.1"))
        for _ in range(200):
            await asyncio.sleep(0)
            if len(FakeAdvertiser.records) >= 5 or task.done():
                break
        assert not task.done(), task.exception() if task.done() else None
        task.cancel()

    asyncio.run(scenario())
    return FakeAdvertiser.records


def test_a_virtual_device_is_advertised_as_its_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    records = advertised("AUTO:GPU,CPU", {}, monkeypatch)
    assert len(records) >= 5 and {record.devices for record in records} == {("GPU", "CPU")}
    assert AgentRecord.from_txt(records[0].to_txt()) == records[0]


def test_a_status_that_fails_is_tried_again_at_the_next_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    denied = PermissionError(13, "Permission denied")
    failures: dict[int, Exception] = {0: denied, 1: ProtocolError("battery_percent 100.4"), 3: denied,
                                      4: ProtocolError("weight_gb_per_s")}
    records = advertised("GPU.1", failures, monkeypatch)
    assert len(records) >= 5 and {record.devices for record in records} == {("GPU.1",)}


def test_a_second_agent_on_the_same_data_dir_refuses_to_start(tmp_path: Path) -> None:
    # Two agents of one identity took turns at the controller, each registration dropping the other's.
    from deskfleet.agent.paths import AgentPaths

    def service_on(data_dir: Path) -> AgentService:
        service = AgentService.__new__(AgentService)
        service.paths = AgentPaths.resolve(data_dir)
        service.paths.create()
        return service

    first, second = service_on(tmp_path), service_on(tmp_path)
    with first._data_dir_lock():
        with pytest.raises(OSError, match=f"{tmp_path}.* is in use by another agent \\(pid {os.getpid()}\\)"):
            with second._data_dir_lock():
                pass
    with second._data_dir_lock():  # free again once the first stopped
        pass


def test_a_listen_host_name_is_advertised_as_what_it_resolves_to(caplog: pytest.LogCaptureFixture) -> None:
    # `--listen localhost:17433` passed every check, then ipaddress.ip_address("localhost") killed the agent.
    assert asyncio.run(advertised_addresses("localhost")) == []  # loopback: not announced
    assert asyncio.run(advertised_addresses("10.99.0.1")) == ["10.99.0.1"]
    assert asyncio.run(advertised_addresses("no-such-host.invalid")) == []


def test_a_registration_that_closes_at_once_backs_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The retry delay went back to 1 s after every link that opened, even one the controller closed at once.
    delays: list[float] = []

    async def opens(*args: object, **kwargs: object) -> object:
        return object()

    async def closed_at_once(link: object) -> None:
        return None

    async def record(delay: float) -> None:
        delays.append(delay)
        if len(delays) == 6:
            raise asyncio.CancelledError

    service = AgentService.__new__(AgentService)
    service.membership = SimpleNamespace(controller_addresses=("127.0.0.1:1",), controller_id="c")  # type: ignore[assignment]
    service.files = None  # type: ignore[assignment]
    from deskfleet.agent.paths import AgentPaths

    service.paths = AgentPaths.resolve(tmp_path)
    monkeypatch.setattr(service_module, "open_link", opens)
    monkeypatch.setattr(service, "_registered", closed_at_once)
    monkeypatch.setattr(service_module.asyncio, "sleep", record)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(service._register_forever())
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


def keeps_running(forever: Callable[[], Coroutine[Any, Any, None]], calls: list[int]) -> None:
    """Run a periodic task (its interval patched to 0) until it has made 4 calls; it must still be running."""
    async def scenario() -> None:
        task = asyncio.create_task(forever())
        for _ in range(100):
            await asyncio.sleep(0)
            if len(calls) >= 4 or task.done():
                break
        assert not task.done(), task.exception() if task.done() else None
        task.cancel()

    asyncio.run(scenario())


def test_the_limits_are_checked_again_after_a_sensor_read_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_module, "LIMITS_CHECK_S", 0.0)
    calls: list[int] = []

    class LimitedCore:
        async def enforce_limits(self) -> tuple[object, ...]:
            calls.append(len(calls))
            if len(calls) == 2:
                raise OSError(5, "Input/output error")  # a sysfs file that could not be read this time
            return ()

    service = AgentService.__new__(AgentService)
    service.core = LimitedCore()  # type: ignore[assignment]

    keeps_running(service._enforce_limits_forever, calls)
    assert len(calls) >= 4


def test_an_agent_not_joined_or_missing_a_credential_says_which_file_and_how_to_join(tmp_path: Path) -> None:
    from deskfleet.agent.enroll import EnrollmentError, Membership
    from deskfleet.agent.paths import AgentPaths
    from deskfleet.agent.service import AgentOptions
    from tests.fleet_pki import make_ca, make_member

    with pytest.raises(EnrollmentError, match=f"has not joined a fleet .*`deskfleet-agent join TOKEN --data-dir "
                                              f"{tmp_path}` first"):
        AgentService(AgentOptions(tmp_path))
    state = AgentPaths.resolve(tmp_path).state_dir
    files = make_member(make_ca(tmp_path / "ca"), state, "agent")
    Membership(pki.fleet_id(files.ca_certificate()), files.own_identity().agent_id, "c" * 52,
               ("127.0.0.1:7341",)).save(state)
    files.key_path.unlink()  # lost: the certificate alone cannot prove who this PC is
    with pytest.raises(EnrollmentError, match=f"{files.key_path} missing: .* join again with a new token: "
                                              f"`deskfleet-agent join TOKEN --data-dir {tmp_path}`"):
        AgentService(AgentOptions(tmp_path))


def test_a_removed_pc_is_told_once_what_happened_and_how_to_serve_again(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    # It retried registration every 30 s forever, logging only "cannot register ... HTTP 403"
    from deskfleet.agent.link import LinkRefused, TlsFiles

    async def refused(*args: object, **kwargs: object) -> object:
        raise LinkRefused("127.0.0.1:1 refused the link: HTTP 403 agent x has been removed from the fleet", 403)

    sleeps: list[float] = []

    async def record(delay: float) -> None:
        sleeps.append(delay)
        if len(sleeps) == 4:
            raise asyncio.CancelledError

    given_up: list[str] = []

    async def give_up_stages(because: str, for_good: bool = False) -> tuple[str, ...]:
        assert for_good  # a removal's reason never passes
        given_up.append(because)
        return ("target[0:8]",)

    from deskfleet.agent.paths import AgentPaths
    from deskfleet.agent.standing import removed_seen

    service = AgentService.__new__(AgentService)
    service.membership = SimpleNamespace(controller_addresses=("127.0.0.1:1",), controller_id="c")  # type: ignore[assignment]
    service.files = TlsFiles.in_folder(Path("/data/state"), "agent")  # nothing there: no expiry to blame
    service.paths = AgentPaths.resolve(tmp_path)
    service.paths.state_dir.mkdir(parents=True)
    service.core = SimpleNamespace(give_up_stages=give_up_stages)  # type: ignore[assignment]
    monkeypatch.setattr(service_module, "open_link", refused)
    monkeypatch.setattr(service_module.asyncio, "sleep", record)
    told: list[str] = []
    monkeypatch.setattr(service_module.log, "error", lambda text, *args: told.append(text % args))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(service._register_forever())
    assert len(told) == 1 and "removed from the fleet and serves no one" in told[0]
    assert "delete /data/state/agent-key.pem and join with a new token" in told[0]
    # its stages went (they held the memory, and no PC takes its links), and it asks again hourly, not every 30 s
    # (the controller logged every refusal)
    assert given_up == ["this PC was removed from the fleet"] and "1 stage(s) released" in told[0]
    assert sleeps == [service_module.REMOVED_RETRY_S] * 4
    assert removed_seen(service.paths.state_dir) is not None  # for `resume`, which said the next plan may use it


def test_a_refusal_for_a_clock_is_no_removal_and_a_registration_forgets_one(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    # The controller's clock stepped back an hour and it refused this PC's certificate, issued half an hour before,
    # as not valid yet (HTTP 403): the agent read every 403 as its removal, gave its stages up for good and wrote
    # removed.json, and `deskfleet-agent pause` refused its user for good, though the next registration was taken.
    from deskfleet.agent.link import LinkRefused, TlsFiles
    from deskfleet.agent.paths import AgentPaths
    from deskfleet.agent.standing import note_removed, removed_seen

    clock = LinkRefused("127.0.0.1:1 refused the link: HTTP 403 certificate is not valid before 2026-12-07T10:00:00 "
                        "and the clock of the PC checking it says 2026-12-07T09:30:00: set that PC's clock right", 403)
    attempts: list[int] = []

    async def controller(*args: object, **kwargs: object) -> object:
        attempts.append(1)
        if len(attempts) <= 2:
            raise clock
        return SimpleNamespace()  # taken at the third

    async def registered(link: object) -> None:
        raise asyncio.CancelledError  # what the registration does after is not this test's

    async def give_up_stages(because: str, for_good: bool = False) -> tuple[str, ...]:
        raise AssertionError(f"stages given up: {because}")

    sleeps: list[float] = []

    async def record(delay: float) -> None:
        sleeps.append(delay)

    service = AgentService.__new__(AgentService)
    service.membership = SimpleNamespace(controller_addresses=("127.0.0.1:1",), controller_id="c")  # type: ignore[assignment]
    service.files = TlsFiles.in_folder(Path("/data/state"), "agent")  # nothing there: no expiry to blame
    service.paths = AgentPaths.resolve(tmp_path)
    service.paths.state_dir.mkdir(parents=True)
    note_removed(service.paths.state_dir, "2026-12-01T00:00:00+00:00")  # an earlier run read a 403 so
    service.core = SimpleNamespace(give_up_stages=give_up_stages)  # type: ignore[assignment]
    service._registered = registered  # type: ignore[method-assign]
    monkeypatch.setattr(service_module, "open_link", controller)
    monkeypatch.setattr(service_module.asyncio, "sleep", record)
    warned: list[str] = []
    monkeypatch.setattr(service_module.log, "warning", lambda text, *args: warned.append(text % args))
    monkeypatch.setattr(service_module.log, "error", lambda text, *args: pytest.fail(text % args))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(service._register_forever())
    assert len(attempts) == 3
    assert sleeps == [service_module.RETRY_MIN_S, service_module.RETRY_MIN_S * 2]  # tried again as after an outage
    assert len(warned) == 1 and "set that PC's clock right" in warned[0] and "removed" not in warned[0]
    assert removed_seen(service.paths.state_dir) is None  # taken by the controller: no removed PC


def test_a_background_check_that_raises_anything_does_not_stop_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    # it ended the agent's TaskGroup, and the agent, for one failed reading or micro-batch
    monkeypatch.setattr(service_module, "IDLE_SWEEP_S", 0.0)
    calls: list[int] = []
    logged: list[str] = []
    monkeypatch.setattr(service_module.log, "exception", lambda text, *args: logged.append(text % args))

    class BrokenCore:
        async def release_idle_micro_batches(self) -> int:
            calls.append(len(calls))
            raise KeyError("micro-batch 7")  # a bug, not a sensor: logged with its traceback, once

    service = AgentService.__new__(AgentService)
    service.core = BrokenCore()  # type: ignore[assignment]

    keeps_running(service._sweep_idle_forever, calls)
    assert len(calls) >= 4 and len(logged) == 1 and "free idle micro-batches" in logged[0]
