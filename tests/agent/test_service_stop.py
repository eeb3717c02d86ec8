"""The agent service's --listen and what its log says when it stops."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from deskfleet.agent import service as service_module
from deskfleet.agent.service import AgentOptions, AgentService
from tests.agent.test_core import FakeMonitor
from tests.agent.test_service_certificates import joined


def test_an_empty_listen_is_refused_not_taken_for_the_settings_address(tmp_path: Path) -> None:
    # `--listen "$ADDRESS"` with ADDRESS unset listened on the settings' 0.0.0.0:7431, every interface
    from deskfleet.common.wire import ProtocolError

    joined(tmp_path)  # enrolled
    for listen in ("", "10.0.0.5:"):
        with pytest.raises(ProtocolError, match=f"^--listen: address '{listen}' "):
            AgentService(AgentOptions(tmp_path, listen=listen), monitor=FakeMonitor())
    # a host alone takes the agent's port (`--listen 10.0.0.5` was refused as "not host:port")
    assert AgentService(AgentOptions(tmp_path, listen="127.0.0.1"), monitor=FakeMonitor()).listen == "127.0.0.1:7431"


def test_a_stopped_agent_names_the_stages_that_go_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    # its log said only "agent ... stopped": an admin could not tell the stages it hosted were given up
    from deskfleet.common.wire_messages import StageRef

    async def idle(*args: object) -> None:
        await asyncio.sleep(3600)

    for task in ("_check_certificates_forever", "_register_forever", "_advertise_forever", "_sweep_idle_forever",
                 "_enforce_limits_forever"):
        monkeypatch.setattr(AgentService, task, idle)
    agent = joined(tmp_path)
    agent.core.stages[StageRef("demo-target", 4, 8)] = object()  # type: ignore[assignment]

    async def serve_then_stop() -> None:
        serving = asyncio.create_task(agent.run())
        await asyncio.sleep(0.2)
        agent.stop()
        await serving

    with caplog.at_level(logging.INFO, logger=service_module.log.name):
        asyncio.run(serve_then_stop())
    assert f"agent {agent.core.agent_id[:12]} stopped; the stage(s) it hosted go with it: demo-target layers " \
           "[4:8]" in caplog.messages
