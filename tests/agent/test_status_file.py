"""The status the running agent publishes for its tray: what it holds, how a damaged file is named, how the tray
tells a running agent from a stopped one, and the service's writes (a failure said once, not every 5 s)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.core import AgentCore
from deskfleet.agent.opt_out import write_opt_out
from deskfleet.agent.service import AgentService
from deskfleet.agent.status import PauseSource
from deskfleet.agent.status_file import (
    HEARTBEAT_S,
    STALE_AFTER_S,
    STATUS_FILE,
    PublishedStatus,
    StatusFileError,
    publisher_running,
    read_status_file,
    shows_a_change,
    this_process_started_at,
    write_status_file,
)
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import TemperatureReading
from tests.agent.test_opt_out import desk  # noqa: F401  # the fixture: a real AgentCore on a plugged-in desktop
from tests.log_records import records_of


def published(core: AgentCore, connected: bool = True) -> PublishedStatus:
    return PublishedStatus(asyncio.run(core.local_status()), core.agent_id, os.getpid(), this_process_started_at(),
                           core.pause_source(), connected, core.policy().release_stages_after_s)


def test_what_the_agent_publishes_reads_back_whole(desk: tuple[AgentCore, Path]) -> None:  # noqa: F811
    core, state = desk
    first = published(core)
    assert first.status.state is AgentState.AVAILABLE and first.paused_by is None
    write_status_file(state, first)
    assert read_status_file(state) == first
    write_opt_out(state, True, "2026-12-07T10:00:00+00:00")  # the employee's pause: the next status says who
    second = published(core, connected=False)
    write_status_file(state, second)
    back = read_status_file(state)
    assert back == second and back is not None
    assert back.status.state is AgentState.PAUSED and back.paused_by is PauseSource.USER
    assert back.status.detail.startswith("paused by its user") and not back.controller_connected


def test_no_file_is_none_and_a_damaged_one_is_named(desk: tuple[AgentCore, Path]) -> None:  # noqa: F811
    core, state = desk
    assert read_status_file(state) is None  # the agent never ran on this data dir
    path = state / STATUS_FILE
    path.write_text('{"format_version": 1, "pid": ')
    with pytest.raises(StatusFileError, match=f"{path} is not valid JSON"):
        read_status_file(state)
    body = published(core).to_dict()
    for key, value, said in (("pid", -3, "'pid' must be a process id"),
                             ("process_started_at", "yesterday", "'process_started_at' must be a time"),
                             ("paused_by", "boss", "is not a valid PauseSource"),
                             ("controller_connected", "yes", "'controller_connected' true or false"),
                             ("status", [], "'status' must be an object")):
        path.write_text(json.dumps({**body, key: value}))
        with pytest.raises(StatusFileError, match=f"{path} is damaged") as raised:
            read_status_file(state)
        assert said in str(raised.value)
    path.write_text(json.dumps({key: value for key, value in body.items() if key != "agent_id"}))
    with pytest.raises(StatusFileError, match="damaged \\(lacks 'agent_id'\\)"):
        read_status_file(state)
    path.write_text(json.dumps({**body, "format_version": 2}))
    with pytest.raises(StatusFileError, match=r"of format 2, which this tray does not read .* different "
                                              r"deskfleet versions"):
        read_status_file(state)


def test_the_tray_tells_a_running_publisher_from_a_gone_one_and_from_a_reused_pid(
        desk: tuple[AgentCore, Path]) -> None:  # noqa: F811
    core, _ = desk
    mine = published(core)
    now = mine.status.taken_at
    assert publisher_running(mine, now)
    moved = replace(mine, process_started_at=mine.process_started_at - 3600)
    # a start time that no longer matches: the wall clock was set right since (Linux computes it from the boot time,
    # which moves with the clock), and the agent still writes; or a pid reused, and the file long quiet
    assert publisher_running(moved, now + STALE_AFTER_S)
    assert not publisher_running(moved, now + STALE_AFTER_S + 1)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    assert not publisher_running(replace(mine, pid=int(ended.stdout)), now)


def test_the_agent_writes_only_what_shows_a_change_and_at_least_every_heartbeat(
        desk: tuple[AgentCore, Path]) -> None:  # noqa: F811
    core, _ = desk
    first = published(core)
    later = replace(first, status=replace(first.status, taken_at=first.status.taken_at + 5))
    assert shows_a_change(None, first) and not shows_a_change(first, later)
    noisy = replace(later.status.reading, cpu_load=first.status.reading.cpu_load + 0.001,
                    memory_free_bytes=first.status.reading.memory_free_bytes + 4096)
    assert not shows_a_change(first, replace(later, status=replace(later.status, reading=noisy)))  # not shown
    creeping = replace(later.status.reading, cpu_load=first.status.reading.cpu_load + 0.04)
    assert not shows_a_change(first, replace(later, status=replace(later.status, reading=creeping)))
    busier = replace(later.status.reading, cpu_load=first.status.reading.cpu_load + 0.05)
    assert shows_a_change(first, replace(later, status=replace(later.status, reading=busier)))
    hot = replace(later.status.reading, temperatures=(TemperatureReading("cpu", 50.0),))  # a sensor appears
    assert shows_a_change(first, replace(later, status=replace(later.status, reading=hot)))
    assert shows_a_change(first, replace(later, controller_connected=not first.controller_connected))
    assert shows_a_change(first, replace(later, paused_by=PauseSource.USER))
    quiet = replace(first, status=replace(first.status, taken_at=first.status.taken_at + HEARTBEAT_S))
    assert shows_a_change(first, quiet)


def test_a_status_file_of_the_wrong_kinds_of_values_is_damaged(desk: tuple[AgentCore, Path]) -> None:  # noqa: F811
    # a null in a number's place passed the reading, and failed in the tray's drawing every 2 s
    core, state = desk
    body = published(core).to_dict()
    for field, value, said in (("cpu_load", None, "'cpu_load'"), ("memory_free_bytes", "8G", "'memory_free_bytes'"),
                               ("on_ac_power", "yes", "'on_ac_power'"), ("battery_percent", [], "'battery_percent'")):
        reading = {**body["status"]["reading"], field: value}
        (state / STATUS_FILE).write_text(json.dumps({**body, "status": {**body["status"], "reading": reading}}))
        with pytest.raises(StatusFileError, match=f"is damaged \\({said} is not of its kind\\)"):
            read_status_file(state)
    (state / STATUS_FILE).write_text(json.dumps({**body, "releases_after_s": "soon"}))
    with pytest.raises(StatusFileError, match="'releases_after_s' must be a number of seconds or null"):
        read_status_file(state)


def service_on(state: Path, core: AgentCore) -> AgentService:
    service = AgentService.__new__(AgentService)
    service.core = core
    service.paths = SimpleNamespace(state_dir=state)  # type: ignore[assignment]
    service._registration = None
    service._started_at = this_process_started_at()
    service._status_written = None
    service._status_unwritten = None
    return service


def test_the_service_writes_its_status_when_it_changes(desk: tuple[AgentCore, Path],  # noqa: F811
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    core, state = desk
    service = service_on(state, core)
    writes: list[PublishedStatus] = []
    monkeypatch.setattr(service_module, "write_status_file",
                        lambda folder, status: (writes.append(status), write_status_file(folder, status)))
    assert asyncio.run(service.publish_status())
    on_file = read_status_file(state)
    assert on_file is not None and publisher_running(on_file, on_file.status.taken_at)
    assert on_file.agent_id == core.agent_id and on_file.releases_after_s == core.policy().release_stages_after_s
    assert asyncio.run(service.publish_status()) and len(writes) == 1  # nothing the tray shows changed
    write_opt_out(state, True, "2026-12-07T10:00:00+00:00")
    assert asyncio.run(service.publish_status()) and len(writes) == 2
    assert writes[-1].paused_by is PauseSource.USER


def test_the_service_says_a_failed_write_once_whatever_its_temporary_files_name(
        desk: tuple[AgentCore, Path], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # a read-only disk's error names the temporary file, a new random name each time: deduplicated on the text, the
    # warning came every 5 s
    core, state = desk
    service = service_on(state, core)
    names = iter(range(100))

    def read_only(folder: Path, status: PublishedStatus) -> None:
        raise OSError(30, "Read-only file system", f"{folder}/.status.json.{next(names)}.tmp")

    monkeypatch.setattr(service_module, "write_status_file", read_only)
    with records_of("deskfleet.agent.service", logging.DEBUG) as records:
        assert not asyncio.run(service.publish_status())
        assert not asyncio.run(service.publish_status())
        monkeypatch.setattr(service_module, "write_status_file", write_status_file)
        assert asyncio.run(service.publish_status())
    said = records.messages()
    assert len(said) == 2, said
    assert said[0].startswith("cannot write this PC's status for its tray ([Errno 30] Read-only file system")
    assert "goes on serving" in said[0] and said[1] == "this PC's status is written for its tray again"


def test_a_status_that_cannot_be_made_does_not_stop_the_agent(desk: tuple[AgentCore, Path],  # noqa: F811
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    core, state = desk
    service = service_on(state, core)
    looks: list[int] = []

    async def broken() -> None:
        looks.append(1)
        raise RuntimeError("sensor library blew up")

    monkeypatch.setattr(core, "local_status", broken)
    monkeypatch.setattr(service_module, "STATUS_CHECK_S", 0.0)

    async def scenario() -> None:
        task = asyncio.create_task(service._publish_status_forever())
        while len(looks) < 5 and not task.done():
            await asyncio.sleep(0)
        assert not task.done(), task.exception() if task.done() else None
        task.cancel()

    with records_of("deskfleet.agent.service", logging.DEBUG) as records:
        asyncio.run(scenario())
    errors = [record for record in records.records if record.levelno >= logging.WARNING]
    assert len(errors) == 1 and "logged once for each kind of failure" in errors[0].getMessage()
