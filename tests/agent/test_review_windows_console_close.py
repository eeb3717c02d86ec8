"""On Windows, closing the agent's console, logging off or shutting down arrives as SIGBREAK, whose default
ends the process at once (stages, links and the lock file as they are); the agent must stop as on Ctrl-C.
Simulated here: the loop refuses signal handlers (as Windows' loops do) and SIGBREAK is a Linux signal."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from deskfleet.agent.service import AgentService


def test_sigbreak_stops_the_agent_as_ctrl_c_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signal, "SIGBREAK", signal.SIGUSR2, raising=False)
    previous = signal.getsignal(signal.SIGUSR2)
    service = AgentService.__new__(AgentService)

    async def scenario() -> bool:
        service._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()

        def refused(*args: object) -> None:
            raise NotImplementedError  # Windows' event loops have no add_signal_handler

        monkeypatch.setattr(loop, "add_signal_handler", refused)
        service._install_signal_handlers()
        os.kill(os.getpid(), signal.SIGUSR2)
        try:
            await asyncio.wait_for(service._stopping.wait(), 5)
        except TimeoutError:
            return False
        return True

    try:
        assert asyncio.run(scenario())
    finally:
        signal.signal(signal.SIGUSR2, previous)
