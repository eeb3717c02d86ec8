"""`deskfleet fleet window` and the sensors of `fleet ls`: real agents (AgentCore on the real TLS link, on loopback)
whose monitors report temperatures, battery and iGPU load, surveyed by the window on Qt's offscreen platform as the
admin would use it: rows, colours, a selected PC in full, Refresh, a survey that fails, closing under a survey."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QApplication

from deskfleet.agent.link import utc_now
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import TemperatureReading
from deskfleet.common.wire import StatusReport
from deskfleet.controller import fleet_survey
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_listing import percent_text, power_text, temperature_text
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import SurveyOptions
from deskfleet.controller.fleet_window import COLUMNS, STATE_COLOURS, FleetWindowOptions
from tests.controller.windows import (
    DESKTOP,
    LAPTOP_UNPLUGGED,
    LOOK_ONCE,
    FakeSurveys,
    Office,
    Opener,
    pc,
    surveys,
    table,
    wait_for,
)

# The sensors, in words

def test_sensor_texts_say_unknown_as_a_dash_and_power_in_one_word() -> None:
    report = StatusReport(AgentState.AVAILABLE, 1 << 30, 0.123, None, None, None, None, (), None)
    assert (percent_text(report.cpu_load), percent_text(None), percent_text(1.0)) == ("12%", "-", "100%")
    assert (temperature_text(report), temperature_text(replace(report, temperature_c=71.6)),
            temperature_text(None)) == ("-", "72C", "-")
    assert [power_text(replace(report, battery_percent=battery, on_ac_power=plugged)) for battery, plugged in (
        (None, None), (None, True), (81.0, True), (40.4, False), (55.0, None))] == [
        "-", "AC", "AC:81%", "battery:40%", "55%"]  # a desktop reports no battery and no AC: "-"
    assert power_text(None) == "-"


def test_fleet_ls_shows_each_pcs_sensors_in_its_table_and_json(office: Office,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data-dir", str(office.store.data_dir), "--discover-seconds", "0"]
    assert main(["fleet", "ls", *data]) == 0
    lines = capsys.readouterr().out.splitlines()
    heading = lines[0].split()
    rows = {row.split()[1]: row.split() for row in lines[1:4]}
    sensors = {host: {name: row[heading.index(name)] for name in ("state", "cpu", "igpu", "temp", "power")}
               for host, row in rows.items()}
    assert sensors == {"pc-desk": {"state": "available", "cpu": "25%", "igpu": "5%", "temp": "61C", "power": "-"},
                       "pc-laptop": {"state": "unavailable", "cpu": "0%", "igpu": "-", "temp": "-",
                                     "power": "battery:40%"},
                       "pc-off": {"state": "unreachable", "cpu": "-", "igpu": "-", "temp": "-", "power": "-"}}
    assert main(["fleet", "ls", "--json", *data]) == 0
    listed = {entry["hostname"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert {name: listed["pc-desk"][name] for name in ("cpu_load", "igpu_busy", "temperature_c", "battery_percent",
                                                       "on_ac_power")} == {
        "cpu_load": 0.25, "igpu_busy": 0.05, "temperature_c": 61.4, "battery_percent": None, "on_ac_power": None}
    assert (listed["pc-laptop"]["battery_percent"], listed["pc-laptop"]["on_ac_power"]) == (40.0, False)
    assert listed["pc-off"]["cpu_load"] is None and listed["pc-off"]["weight_gb_per_s"] is None


# The window

def test_the_window_shows_every_pc_its_state_in_colour_and_the_selected_one_in_full(open_window: Opener,
                                                                                     office: Office) -> None:
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look at the fleet", surveys(window, None))
    shown = table(window)
    assert [window.table.item(row, 0).text() for row in range(3)] == ["pc-desk", "pc-laptop", "pc-off"]
    assert {host: (cells["state"], cells["cpu"], cells["igpu"], cells["temperature"], cells["power"])
            for host, cells in shown.items()} == {
        "pc-desk": ("available", "25%", "5%", "61C", "-"),
        "pc-laptop": ("unavailable", "0%", "-", "-", "battery:40%"),
        "pc-off": ("unreachable", "-", "-", "-", "-")}
    assert shown["pc-desk"]["free"] == "12.0GiB"
    assert shown["pc-laptop"]["stages"] == "(battery 40%, unplugged (require_ac_power))"  # the limit it crossed
    assert "127.0.0.1" in shown["pc-off"]["stages"]  # why it did not answer
    state = COLUMNS.index("state")
    assert window.table.item(1, state).foreground().color() == QColor(STATE_COLOURS["unavailable"])
    assert window.table.item(2, state).foreground().color() == QColor(STATE_COLOURS["unreachable"])
    assert window.summary.text().startswith("3 agent(s): 1 available, 1 unavailable, 1 unreachable.")
    assert "no `deskfleet fleet serve` runs" in window.notes.toPlainText()  # fleet ls's warning, in the window
    assert window.details.toPlainText() == ""
    window.table.selectRow(0)
    details = dict(line.split(": ", 1) for line in window.details.toPlainText().splitlines())
    assert details["hostname"] == "pc-desk" and details["temperature_c"] == "61.4"
    assert details["agent_id"] == office.cores["pc-desk"].agent_id and details["stages"] == "-"


def test_refresh_shows_what_changed_and_keeps_the_pc_selected(open_window: Opener, office: Office) -> None:
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look at the fleet", surveys(window, None))
    window.table.selectRow(1)  # pc-laptop
    first = window.listing
    office.monitors["pc-laptop"].reading = replace(LAPTOP_UNPLUGGED, on_ac_power=True, battery_percent=90.0,
                                                   temperatures=(TemperatureReading("acpitz", 48.0),))
    office.monitors["pc-desk"].reading = replace(DESKTOP, temperatures=(TemperatureReading("cpu", 95.0),))
    window.refresh()
    assert not window.refresh_button.isEnabled()  # one look at a time
    wait_for("the second look", surveys(window, first))
    laptop = table(window)["pc-laptop"]
    assert (laptop["state"], laptop["power"], laptop["temperature"]) == ("available", "AC:90%", "48C")
    assert table(window)["pc-desk"]["state"] == "unavailable"  # too hot: it now sorts after the laptop
    assert window.table.selectionModel().selectedRows()[0].row() == 0  # the laptop, selected as it moved up
    assert "hostname: pc-laptop" in window.details.toPlainText()
    assert "on_ac_power: True" in window.details.toPlainText()


def test_a_survey_that_fails_is_said_and_the_last_table_kept(open_window: Opener, office: Office) -> None:
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look at the fleet", surveys(window, None))
    key = office.store.data_dir / "ca.pem"
    kept = key.read_bytes()
    key.unlink()  # the data dir damaged under the window (a restore under way)
    window.refresh()
    wait_for("the failure", lambda: "could not be listed" in window.summary.text())
    assert "ca.pem" in window.summary.text()
    assert window.table.rowCount() == 3 and window.refresh_button.isEnabled()
    key.write_bytes(kept)
    failed = window.listing
    window.refresh()
    wait_for("a look once it is mended", surveys(window, failed))
    assert window.summary.text().startswith("3 agent(s)")


def test_the_next_look_comes_by_itself(open_window: Opener, office: Office) -> None:
    window = open_window(office.store, FleetWindowOptions(SurveyOptions(discover_seconds=0), every_s=0.2))
    wait_for("the first look", surveys(window, None))
    first = window.listing
    wait_for("the next look, with no Refresh", surveys(window, first))


def test_closing_the_window_cuts_a_survey_under_way_short(open_window: Opener, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    began, ended = threading.Event(), threading.Event()
    calls = []

    async def stuck(*_: Any) -> Any:  # a survey waiting on PCs that are off
        calls.append(1)
        began.set()
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    monkeypatch.setattr(fleet_survey, "survey", stuck)
    window = open_window(store, FleetWindowOptions(SurveyOptions(discover_seconds=0), every_s=0.05))
    assert began.wait(30)
    window.close()
    assert ended.wait(10)  # cancelled, not left to run for a minute
    assert calls == [1]


def test_a_closed_window_looks_no_more(open_window: Opener, office: Office) -> None:
    window = open_window(office.store, FleetWindowOptions(SurveyOptions(discover_seconds=0), every_s=0.1))
    wait_for("the first look", surveys(window, None))
    window.close()
    last = window.listing
    window.refresh()  # asked, or by itself below
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        QApplication.processEvents()
        time.sleep(0.01)
    assert window.listing is last and window.refresh_button.isEnabled()


# The command

def test_fleet_window_refuses_a_data_dir_with_no_fleet_and_a_bad_every(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "window", "--data-dir", str(tmp_path / "none")]) == 2
    assert "holds no fleet: run `deskfleet fleet init" in capsys.readouterr().err
    for every, said in (("1", "must be from 2 to 3600 seconds"), ("nan", "must be from 2"),
                        ("soon", "expected seconds")):
        with pytest.raises(SystemExit) as exited:
            main(["fleet", "window", "--every", every])
        assert exited.value.code == 2
        assert said in capsys.readouterr().err


@pytest.fixture
def bare_store(tmp_path: Path) -> FleetStore:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    return store


def test_a_selected_pc_that_is_gone_at_the_next_look_leaves_nothing_selected(
        open_window: Opener, bare_store: FleetStore, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeSurveys(monkeypatch, [pc("pc-a"), pc("pc-b")], [pc("pc-a")], [])
    window = open_window(bare_store, LOOK_ONCE)
    wait_for("the first look", surveys(window, None))
    window.table.selectRow(1)
    assert "hostname: pc-b" in window.details.toPlainText()
    first = window.listing
    window.refresh()
    wait_for("the second look", surveys(window, first))
    assert list(table(window)) == ["pc-a"]
    assert not window.table.selectionModel().selectedRows() and window.details.toPlainText() == ""
    second = window.listing
    window.refresh()
    wait_for("a look that finds no PC", surveys(window, second))
    assert window.table.rowCount() == 0
    assert window.summary.text().startswith("no agents found (is `deskfleet fleet serve` running")


@pytest.mark.parametrize("error", [ValueError("a malformed roster entry"), asyncio.CancelledError()])
def test_a_look_that_breaks_is_said_with_its_type_and_the_next_one_comes(
        open_window: Opener, bare_store: FleetStore, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    # a CancelledError (no Exception) ended the look's thread in silence: the window stayed "Looking..." for good
    FakeSurveys(monkeypatch, [pc("pc-a")], error, [pc("pc-a"), pc("pc-b")])
    window = open_window(bare_store, LOOK_ONCE)
    wait_for("the first look", surveys(window, None))
    window.refresh()
    wait_for("the failure", lambda: "could not be listed" in window.summary.text())
    assert f"could not be listed: {type(error).__name__}" in window.summary.text()
    assert window.refresh_button.isEnabled() and list(table(window)) == ["pc-a"]
    first = window.listing
    window.refresh()
    wait_for("the next look", surveys(window, first))
    assert list(table(window)) == ["pc-a", "pc-b"]


def test_a_pcs_words_cannot_forge_a_line_or_reorder_a_cell(open_window: Opener, bare_store: FleetStore,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    paused = pc("pc-a", AgentState.PAUSED)
    assert paused.report is not None
    forged = replace(paused, hostname="pc-\u202eevil", report=replace(paused.report, detail="paused\nby: admin"))
    FakeSurveys(monkeypatch, [forged])
    window = open_window(bare_store, LOOK_ONCE)
    wait_for("the look", surveys(window, None))
    assert list(table(window)) == ["pc-?evil"] and table(window)["pc-?evil"]["stages"] == "(paused?by: admin)"
    window.table.selectRow(0)
    assert "hostname: pc-?evil" in window.details.toPlainText() and "\u202e" not in window.details.toPlainText()
