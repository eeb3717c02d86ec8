"""What the window tests share: waiting on Qt's events, and for the fleet window a small office (a controller's data
dir and real agents, AgentCore on the real TLS link on loopback, whose sensors the test sets, served from a thread of
their own) and what reads its table."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QApplication

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import MonitorReading, TemperatureReading
from deskfleet.common.wire import StatusReport
from deskfleet.controller import fleet_survey
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_listing import FleetListing
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import AgentView, SurveyOptions
from deskfleet.controller.fleet_window import COLUMNS, FleetWindow, FleetWindowOptions
from tests.fleet_pki import make_member
from tests.ports import free_port

LOOPBACK = "127.0.0.1"
ENROLLED = "2026-01-01T00:00:00+00:00"
Opener = Callable[[FleetStore, FleetWindowOptions], FleetWindow]
LOOK_ONCE = FleetWindowOptions(SurveyOptions(discover_seconds=0), every_s=3600.0)  # Refresh alone looks again


class SettableMonitor:
    """A PC's sensors as the test sets them (a real monitor reads the OS's)."""

    def __init__(self, reading: MonitorReading) -> None:
        self.reading = reading

    def read(self) -> MonitorReading:
        return self.reading


DESKTOP = MonitorReading(cpu_load=0.25, memory_free_bytes=12 << 30, memory_total_bytes=32 << 30,
                         battery_percent=None, on_ac_power=None,
                         temperatures=(TemperatureReading("coretemp/Package id 0", 61.4),), igpu_busy=0.05)
LAPTOP_UNPLUGGED = MonitorReading(cpu_load=0.0, memory_free_bytes=6 << 30, memory_total_bytes=16 << 30,
                                  battery_percent=40.0, on_ac_power=False, temperatures=(), igpu_busy=None)


class Office:
    """A controller's data dir and two agents serving on loopback from a thread of their own (the CLI and the window
    run event loops of their own), plus a third enrolled PC that is off."""

    def __init__(self, root: Path) -> None:
        self.store = FleetStore(root / "controller")
        init_fleet(self.store, "test", ("127.0.0.1:1",), utc_now())
        self.monitors = {"pc-desk": SettableMonitor(DESKTOP), "pc-laptop": SettableMonitor(LAPTOP_UNPLUGGED)}
        self.cores: dict[str, AgentCore] = {}
        for hostname, monitor in self.monitors.items():
            files = make_member(load_ca(self.store), root / hostname, "agent")
            # the laptop's employee keeps it out of the fleet on battery (the default); the desk has no battery
            settings = AgentSettings(thresholds=Thresholds(min_free_memory_bytes=None))
            self.cores[hostname] = AgentCore(files, settings, ShardCache(root / hostname / "cache", 1 << 30), monitor)
        off = make_member(load_ca(self.store), root / "pc-off", "agent").own_identity().agent_id
        self.off_id = off
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        servers = [await start_server(core.serve_link, LOOPBACK, 0, core.files) for core in self.cores.values()]
        roster = {core.agent_id: RosterEntry(core.agent_id, hostname, ENROLLED,
                                             (f"{LOOPBACK}:{server.sockets[0].getsockname()[1]}",))
                  for (hostname, core), server in zip(self.cores.items(), servers, strict=True)}
        roster[self.off_id] = RosterEntry(self.off_id, "pc-off", ENROLLED, (f"{LOOPBACK}:{free_port()}",))
        self.store.save_roster(roster)
        self._ready.set()
        await self._stop.wait()
        for server in servers:
            server.close()
            await server.wait_closed()

    def __enter__(self) -> Office:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Run `callback` on the agents' event loop (an asyncio object of theirs is not the test thread's to touch)."""
        self._loop.call_soon_threadsafe(callback)

    def __exit__(self, *_: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._loop.close()


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        QApplication.processEvents()
        time.sleep(0.01)


def table(window: FleetWindow) -> dict[str, dict[str, str]]:
    """The window's rows by host: each column's text."""
    rows = {}
    for row in range(window.table.rowCount()):
        cells = {name: window.table.item(row, column).text() for column, name in enumerate(COLUMNS)}
        rows[cells["host"]] = cells
    return rows


def surveys(window: FleetWindow, after: FleetListing | None) -> Callable[[], bool]:
    """Whether a listing newer than `after` is shown, and the window ready to look again."""
    return lambda: window.listing is not after and window.refresh_button.isEnabled()


def pc(hostname: str, state: AgentState | None = AgentState.AVAILABLE) -> AgentView:
    """A PC as a survey gives it: its report, or (state None) the reason it did not answer."""
    report = None if state is None else StatusReport(state, 8 << 30, 0.5, None, None, 55.0, None, (), None)
    return AgentView(hostname[-1] * 52, hostname, "10.0.0.1:7431", ("registration",), report,
                     None if report else "cannot reach 10.0.0.1:7431: timed out")


class FakeSurveys:
    """Stands in for the survey: each look takes the next of `looks` (a list of PCs, or an error to raise)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *looks: list[AgentView] | BaseException) -> None:
        self.looks = list(looks)
        monkeypatch.setattr(fleet_survey, "survey", self.survey)

    async def survey(self, store: FleetStore, options: SurveyOptions) -> Any:
        look = self.looks.pop(0)
        if isinstance(look, BaseException):
            raise look
        return fleet_survey.Survey(look, {})
