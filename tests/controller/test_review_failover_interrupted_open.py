"""Ctrl-C while a chain opens (a failover's re-plan opening the new chain, in `deskfleet chat --fleet`, which
goes on to the next message): the chain's network thread must not go on to hold links to the agents. It did:
the links it finished opening stayed up (and the last stage's results link pointed at them) until the chat
ended, with a thread and an event loop for each interrupted re-plan."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from deskfleet.agent.link import Link, LinkError, TlsFiles, open_link, start_server
from deskfleet.common.wire import Role
from deskfleet.controller import fleet_pipeline
from deskfleet.controller.fleet_deploy import StagePlacement
from deskfleet.controller.fleet_pipeline import FleetPipeline
from tests.fleet_pki import make_ca, make_member


@dataclass
class ServedAgent:
    """An agent serving links on loopback from a thread of its own; `link_closed` is set when a link ends."""

    agent_files: TlsFiles
    driver_files: TlsFiles
    port: int
    link_closed: threading.Event

    def placement(self) -> StagePlacement:
        return StagePlacement(self.agent_files.own_identity().agent_id, f"127.0.0.1:{self.port}", 0, 4)


@pytest.fixture
def served_agent(tmp_path: Path) -> Iterator[ServedAgent]:
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    driver_files = make_member(ca, tmp_path / "driver", "driver", Role.CONTROLLER)
    listening, link_closed, stop_serving = threading.Event(), threading.Event(), threading.Event()
    ports: list[int] = []

    async def agent(link: Link) -> None:
        try:
            while True:
                await link.receive()
        except LinkError:
            link_closed.set()

    async def serve() -> None:
        async with await start_server(agent, "127.0.0.1", 0, agent_files) as server:
            ports.append(server.sockets[0].getsockname()[1])
            listening.set()
            while not stop_serving.is_set():
                await asyncio.sleep(0.05)

    server_thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    server_thread.start()
    assert listening.wait(10)
    try:
        yield ServedAgent(agent_files, driver_files, ports[0], link_closed)
    finally:
        stop_serving.set()
        server_thread.join(10)


def test_a_chain_interrupted_while_it_opens_closes_its_links(served_agent: ServedAgent,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's Ctrl-C while the driver waits for the chain to open, played without a real SIGINT: a signal sent
    # to the pytest process, with the native threads of every earlier test alive, ended a CI run with a
    # segmentation fault (so did a SIGUSR2 in stop 29's); the KeyboardInterrupt comes out of the same wait.
    opening, interrupted = threading.Event(), threading.Event()

    class CtrlCWhileOpening(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            assert opening.wait(10), "the chain's thread never began opening its link"
            raise KeyboardInterrupt

    async def open_after_ctrl_c(*args: object, **kwargs: object) -> Link:
        opening.set()  # the user presses Ctrl-C...
        while not interrupted.is_set():  # ...and the link opens after it has reached the driver
            await asyncio.sleep(0.01)
        return await open_link(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fleet_pipeline, "open_link", open_after_ctrl_c)
    # the driver's wait for the chain only: the module's own threading, Event aside
    monkeypatch.setattr(fleet_pipeline, "threading", SimpleNamespace(Event=CtrlCWhileOpening, Thread=threading.Thread))
    try:
        with pytest.raises(KeyboardInterrupt):
            FleetPipeline([served_agent.placement()], served_agent.driver_files)
        interrupted.set()
        assert served_agent.link_closed.wait(10), "the interrupted chain's link to the agent is still open"
        chain_threads = [thread for thread in threading.enumerate() if thread.name == "fleet-chain"]
        for thread in chain_threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in chain_threads)
    finally:
        interrupted.set()


def test_a_ctrl_c_that_comes_as_the_chain_thread_starts_gives_the_opening_up_too(
        served_agent: ServedAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a busy machine the thread may run (and the Ctrl-C land) before the constructor reaches its wait: the
    # interrupt then came out of Thread.start(), outside the block that gives the opening up (CI saw it).
    class InterruptedAtStart(threading.Thread):  # threading's own class for the rest of the test: only the chain's
        def start(self) -> None:
            super().start()
            if self.name == "fleet-chain":
                raise KeyboardInterrupt  # the user's Ctrl-C, as start() returns

    monkeypatch.setattr(fleet_pipeline.threading, "Thread", InterruptedAtStart)
    with pytest.raises(KeyboardInterrupt):
        FleetPipeline([served_agent.placement()], served_agent.driver_files)
    assert served_agent.link_closed.wait(10), "the interrupted chain's link to the agent is still open"
