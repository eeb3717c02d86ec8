"""An agent started paused wrote nothing about it: an admin reading its log could not tell why the PC was
never planned."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.opt_out import write_opt_out
from deskfleet.agent.paths import AgentPaths
from tests.agent.test_service_certificates import joined


def started_log(service: service_module.AgentService, caplog: pytest.LogCaptureFixture) -> list[str]:
    async def briefly() -> None:
        asyncio.get_running_loop().call_later(0.3, service.stop)
        await service.run()

    with caplog.at_level(logging.INFO, logger="deskfleet"):
        asyncio.run(briefly())
    return [record.getMessage() for record in caplog.records
            if record.name == service_module.log.name and record.getMessage().startswith("this PC is paused")]


def test_an_agent_started_paused_by_its_user_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    service = joined(tmp_path)
    write_opt_out(AgentPaths.resolve(tmp_path).state_dir, paused=True, now="2026-12-01T09:00:00+00:00")
    assert started_log(service, caplog) == ["this PC is paused by its user, until `deskfleet-agent resume`: it "
                                            "serves no model"]


def test_an_agent_started_with_an_unreadable_opt_out_file_says_that_not_its_user(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # it logged "taken as paused" for the damaged file, then "paused by its user (deskfleet-agent pause)"
    service = joined(tmp_path)
    (AgentPaths.resolve(tmp_path).state_dir / "opt_out.json").write_text('{"broken')
    said = started_log(service, caplog)
    assert "this PC is paused as its opt_out.json cannot be read (this agent's log says why; `deskfleet-agent " \
           "resume` or `pause` writes it anew): it serves no model" in said
    assert not any("by its user" in line for line in said)


def test_an_agent_not_paused_says_nothing_of_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert started_log(joined(tmp_path), caplog) == []


def test_an_agent_paused_by_its_settings_names_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = AgentPaths.resolve(tmp_path).settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('{"paused": true}')
    assert started_log(joined(tmp_path), caplog) == [f"this PC is paused by its settings (paused: true in "
                                                     f"{settings}): it serves no model"]
