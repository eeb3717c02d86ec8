"""A deploy's release of a stage it assigned, read after another deploy assigned that stage again, is stale: the
agent keeps the stage. Two runs that started together after a PC came back both ended on a chain whose first stage
nobody hosted: one run's failed deploy released the stage its PC had just finished building, after the other run's
re-plan had been told that stage was ready."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import cast

import pytest

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import Link
from deskfleet.common.wire import Message, ReleaseStage, Role, StageReady
from tests.agent.test_core import FakeLink, _host_tiny_stage, core  # noqa: F401 (the core fixture)


def _over(agent: AgentCore, link: FakeLink, message: Message) -> Message | None:
    return asyncio.run(agent.handle(cast(Link, link), message))


def test_a_release_undoing_an_assignment_made_again_since_keeps_the_stage(
        core: AgentCore, tiny_export: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    assignment = _host_tiny_stage(core, tiny_export)
    failed_deploy, replan, later_deploy = (FakeLink(Role.CONTROLLER) for _ in range(3))
    assert isinstance(_over(core, failed_deploy, assignment), StageReady)  # its deploy failed elsewhere meanwhile
    assert isinstance(_over(core, replan, assignment), StageReady)  # a re-plan found it hosted: ready
    with caplog.at_level(logging.INFO, logger="deskfleet.agent.core"):
        _over(core, failed_deploy, ReleaseStage(assignment.stage))  # the failed deploy's release, read late
    assert assignment.stage in core.stages
    assert "kept tiny_1-0-" in caplog.text and "another deploy has assigned it again since" in caplog.text
    _over(core, later_deploy, ReleaseStage(assignment.stage))  # a deploy that leaves this PC out: released
    assert assignment.stage not in core.stages


def test_a_deploy_releases_what_it_assigned_itself(core: AgentCore, tiny_export: Path) -> None:  # noqa: F811
    assignment = _host_tiny_stage(core, tiny_export)
    deploy = FakeLink(Role.CONTROLLER)
    assert isinstance(_over(core, deploy, assignment), StageReady)
    _over(core, deploy, ReleaseStage(assignment.stage))  # a deploy stopped by Ctrl-C: its own assignment undone
    assert assignment.stage not in core.stages
