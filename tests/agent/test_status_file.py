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

from deskfleet.agent.core import AgentCore
from deskfleet.agent.opt_out import write_opt_out
from deskfleet.agent.service import AgentService
from deskfleet.agent.status import PauseSource
from deskfleet.agent.status_file import (
    STATUS_FILE,
    PublishedStatus,
    StatusFileError,
    publisher_running,
    read_status_file,
    this_process_started_at,
    write_status_file,
)
from deskfleet.common.agent_state import AgentState
from tests.agent.test_opt_out import desk  # noqa: F401  # the fixture: a real AgentCore on a plugged-in desktop
from tests.log_records import records_of


def published(core: AgentCore, connected: bool = True) -> PublishedStatus:
    return PublishedStatus(asyncio.run(core.local_status()), core.agent_id, os.getpid(), this_process_started_at(),
                           core.pause_source(), connected)


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
    assert publisher_running(mine)
    assert not publisher_running(replace(mine, process_started_at=mine.process_started_at - 3600))  # pid reused
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    assert not publisher_running(replace(mine, pid=int(ended.stdout)))


def service_on(state: Path, core: AgentCore) -> AgentService:
    service = AgentService.__new__(AgentService)
    service.core = core
    service.paths = SimpleNamespace(state_dir=state)  # type: ignore[assignment]
    service._registration = None
    service._started_at = this_process_started_at()
    service._status_unwritten = None
    return service


def test_the_service_publishes_and_says_a_failed_write_once(desk: tuple[AgentCore, Path],  # noqa: F811
                                                            tmp_path: Path) -> None:
    core, state = desk
    service = service_on(state, core)
    assert asyncio.run(service.publish_status())
    on_file = read_status_file(state)
    assert on_file is not None and publisher_running(on_file) and on_file.agent_id == core.agent_id
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    service.paths = SimpleNamespace(state_dir=blocked)  # type: ignore[assignment]
    with records_of("deskfleet.agent.service", logging.DEBUG) as records:
        assert not asyncio.run(service.publish_status())
        assert not asyncio.run(service.publish_status())
        service.paths = SimpleNamespace(state_dir=state)  # type: ignore[assignment]
        assert asyncio.run(service.publish_status())
    said = records.messages()
    assert len(said) == 2, said
    assert said[0].startswith("cannot write this PC's status for its tray (") and "goes on serving" in said[0]
    assert said[1] == "this PC's status is written for its tray again"
