"""An agent said nothing of its settings file: one saved under a near name (agent_settings.json, Notepad's
agent-settings.json.txt) applied none of the admin's settings, the PC listened on every interface, and no line
said why. It now logs the file it read, or that it runs on the defaults, and warns of such a file."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from deskfleet.agent import service as service_module
from deskfleet.agent.paths import SETTINGS_FILE, AgentPaths, misnamed_settings_files
from tests.agent.test_service_certificates import joined
from tests.log_records import records_of


def test_files_that_look_meant_to_be_the_settings_file_are_named(tmp_path: Path) -> None:
    for name in ("agent_settings.json", "Agent-Settings.JSON", "agent-settings.json.txt", "agent settings.json",
                 SETTINGS_FILE, "notes.txt", "agent-settings.json.bak", "old.json"):
        (tmp_path / name).write_text("{}")
    assert [path.name for path in misnamed_settings_files(tmp_path)] == sorted(
        ["agent_settings.json", "Agent-Settings.JSON", "agent-settings.json.txt", "agent settings.json"])
    assert misnamed_settings_files(tmp_path / "missing") == []


def _started_log(tmp_path: Path) -> list[tuple[int, str]]:
    service = joined(tmp_path)

    async def briefly() -> None:
        asyncio.get_running_loop().call_later(0.3, service.stop)
        await service.run()

    with records_of(service_module.log.name) as logged:
        asyncio.run(briefly())
    return [(record.levelno, record.getMessage()) for record in logged.records
            if "settings" in record.getMessage() and "listening" not in record.getMessage()]


def test_an_agent_on_the_defaults_says_so_and_warns_of_a_misnamed_settings_file(tmp_path: Path) -> None:
    settings_dir = AgentPaths.resolve(tmp_path).settings_dir
    settings_dir.mkdir(parents=True, exist_ok=True)
    (settings_dir / "agent_settings.json").write_text('{"paused": true}')
    said = _started_log(tmp_path)
    assert said[0] == (logging.INFO, f"settings: the defaults (no {settings_dir / SETTINGS_FILE})")
    assert said[1] == (logging.WARNING, f"{settings_dir / 'agent_settings.json'} is not read: the agent reads its "
                                        f"settings from {settings_dir / SETTINGS_FILE} alone (rename it, and restart "
                                        "the agent)")


def test_an_agent_names_the_settings_file_it_read(tmp_path: Path) -> None:
    settings = AgentPaths.resolve(tmp_path).settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text("{}")
    assert _started_log(tmp_path) == [(logging.INFO, f"settings: {settings}")]
