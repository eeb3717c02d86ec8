"""A middle stage's PC paused by its user mid-generation: the refusal of the next step names it and must reach
the driver that runs the chain, even when the agent's registration link with `fleet serve` spoke after the
chain opened (an agent that registered again, a `fleet remove` of another PC): sent to `fleet serve`, it was
only logged there, and the driver waited out its 120 s step timeout, then re-planned blaming no one."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from deskfleet.agent.core import AgentCore, HostedStage
from deskfleet.agent.link import Link, LinkError
from deskfleet.agent.opt_out import write_opt_out
from deskfleet.agent.service import AgentService
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.wire import (
    AssignStage,
    Error,
    ErrorCode,
    Message,
    NextHop,
    Precision,
    Register,
    RevocationUpdate,
    Role,
    StageRef,
)
from tests.agent.test_core import RecordingLink, ScriptedLink
from tests.agent.test_opt_out import desk  # noqa: F401  (the fixture: a core that reads its user's opt-out)
from tests.agent.test_stage_release import _one_step

PREVIOUS_AGENT = "b" * 52


class OpenLink(RecordingLink):
    """A controller link that delivers `incoming`, then stays open and silent until `hang_up` is set."""

    def __init__(self, incoming: list[Message], hang_up: asyncio.Event) -> None:
        super().__init__(Role.CONTROLLER, "c" * 52)
        self.incoming = list(incoming)
        self.hang_up = hang_up
        self.address = "10.0.0.1:7341"
        self.connection = SimpleNamespace(transport=SimpleNamespace(get_extra_info=lambda name: ("10.0.0.7", 50000)))

    async def receive(self) -> Message:
        if self.incoming:
            return self.incoming.pop(0)
        await self.hang_up.wait()
        raise LinkError("closed")


def test_a_paused_middle_stage_tells_the_driver_not_fleet_serve(desk: tuple[AgentCore, Path]) -> None:  # noqa: F811
    core, state = desk
    middle = AssignStage(StageRef("tiny@1", 2, 3), False, False, "CPU", Precision.F32,
                         NextHop("127.0.0.1:9", "d" * 52), (), previous_agent_id=PREVIOUS_AGENT)
    core.stages[middle.stage] = HostedStage(middle, cast(StageExecutor, None), asyncio.Lock(), "tiny_1-2-3")

    async def scenario() -> tuple[OpenLink, OpenLink]:
        hang_up = asyncio.Event()
        driver = OpenLink([], hang_up)  # a middle stage's driver link says nothing after its Hello
        registration = OpenLink([RevocationUpdate(b"")], hang_up)  # fleet serve answers a registration
        service = AgentService.__new__(AgentService)
        service.core, service.listen, service.bound_port = core, "0.0.0.0:7431", 7431
        service.listen_families = frozenset({4})  # listening on IPv4 alone: it registers the address it reached from
        service.membership = SimpleNamespace(token_sha256=None)  # type: ignore[assignment]
        service._outage = SimpleNamespace(failed=lambda error: None, ended=lambda: "",  # type: ignore[assignment]
                                          began=lambda: None)
        served = [asyncio.create_task(core.serve_link(cast(Link, driver)))]
        await asyncio.sleep(0)
        served.append(asyncio.create_task(service._registered(cast(Link, registration))))  # registered again
        async with asyncio.timeout(10):  # until fleet serve's answer was read: the registration link spoke last
            while registration.incoming or core._controller_links[-1] is not registration:
                await asyncio.sleep(0.01)
        write_opt_out(state, True, "now")
        assert await core.enforce_limits(0.0) == (middle.stage,)
        step = replace(_one_step(), model_id="tiny@1")
        await core.serve_link(cast(Link, _from_previous_hop(step)))  # the previous hop's next step
        hang_up.set()
        await asyncio.gather(*served)
        return driver, registration

    driver, registration = asyncio.run(scenario())
    assert [type(message) for message in registration.sent] == [Register]  # nothing but its own registration
    assert len(driver.sent) == 1
    refusal = driver.sent[0]
    assert isinstance(refusal, Error) and refusal.code is ErrorCode.NOT_ASSIGNED and "paused" in refusal.message
    assert refusal.agent_id == core.agent_id  # the driver re-plans without this PC


def _from_previous_hop(message: Message) -> ScriptedLink:
    link = ScriptedLink(Role.AGENT, [message])
    link.peer = replace(link.peer, agent_id=PREVIOUS_AGENT)
    return link
