"""On Windows, closing the agent's console, logging off or shutting down arrives as SIGBREAK, whose default
ends the process at once (stages, links and the lock file as they are); the agent must stop as on Ctrl-C.
Simulated here: the loop refuses signal handlers (as Windows' loops do), and the handler the agent installs for
SIGBREAK is called as Python would call it. No real signal is raised: this process holds the native threads of
every earlier test, and CI's run of a version that sent itself SIGUSR2 here died of a segmentation fault with no
traceback (never seen on the development VM, 8 runs)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

import pytest

from deskfleet.agent.service import AgentService

SIGBREAK = 21  # its number on Windows; absent from Linux's signal module


def test_sigbreak_stops_the_agent_as_ctrl_c_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signal, "SIGBREAK", SIGBREAK, raising=False)
    installed: dict[int, Callable[[int, Any], object]] = {}

    def install(signum: int, handler: Callable[[int, Any], object]) -> None:
        installed[signum] = handler

    monkeypatch.setattr(signal, "signal", install)
    service = AgentService.__new__(AgentService)

    async def scenario() -> bool:
        service._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()

        def refused(*args: object) -> None:
            raise NotImplementedError  # Windows' event loops have no add_signal_handler

        monkeypatch.setattr(loop, "add_signal_handler", refused)
        installed.clear()  # asyncio.run's own SIGINT handler
        service._install_signal_handlers()
        assert set(installed) == {SIGBREAK}, "SIGBREAK's default handler would end the agent on the spot"
        assert not service._stopping.is_set()
        installed[SIGBREAK](SIGBREAK, None)  # as Python runs a handler: in the main thread, between bytecodes
        try:
            await asyncio.wait_for(service._stopping.wait(), 5)
        except TimeoutError:
            return False
        return True

    assert asyncio.run(scenario())


def test_without_sigbreak_no_handler_is_installed_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Windows, Ctrl-C and SIGTERM go through the loop's handlers and nothing is installed with signal.signal
    (which would replace a handler the host application set)."""
    monkeypatch.delattr(signal, "SIGBREAK", raising=False)
    installed: list[int] = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.append(signum))
    service = AgentService.__new__(AgentService)
    added: list[int] = []

    async def scenario() -> None:
        service._stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "add_signal_handler", lambda signum, callback: added.append(signum))
        installed.clear()  # asyncio.run's own SIGINT handler
        service._install_signal_handlers()
        assert installed == []

    asyncio.run(scenario())
    assert sorted(added) == sorted([signal.SIGINT, signal.SIGTERM, signal.SIGHUP])  # SIGHUP: a closed terminal
