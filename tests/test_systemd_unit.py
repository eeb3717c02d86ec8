"""The shipped systemd units start the agent, the controller's `fleet serve` and its `serve --fleet` as their command
lines take them, and stop them the way they stop cleanly; the shipped autostart entry starts the tray."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

from deskfleet.agent.cli import build_parser
from deskfleet.controller.cli import build_parser as build_controller_parser

UNIT = Path(__file__).resolve().parents[1] / "assets" / "systemd" / "deskfleet-agent.service"
AUTOSTART = Path(__file__).resolve().parents[1] / "assets" / "autostart" / "deskfleet-tray.desktop"
FLEET_UNIT = UNIT.with_name("deskfleet-fleet.service")
SERVE_UNIT = UNIT.with_name("deskfleet-serve.service")


def _unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    unit.read_string(path.read_text(encoding="utf-8"))
    return unit


def test_the_unit_runs_the_agent_headless_and_stops_it_with_sigterm() -> None:
    unit = _unit(UNIT)
    program, *arguments = shlex.split(unit["Service"]["ExecStart"].replace("%h", "/home/user"))
    assert program.endswith("/deskfleet-agent")
    parsed = build_parser().parse_args(arguments)  # every option the unit gives exists, spelled as the agent takes it
    assert parsed.headless and parsed.command is None
    assert unit["Service"]["KillSignal"] == "SIGTERM"  # the agent's clean stop (exit 0)
    assert "2" in unit["Service"]["RestartPreventExitStatus"].split()  # a refused start waits for the admin
    assert unit["Install"]["WantedBy"] == "default.target"  # a user unit: it runs as the PC's user


def test_the_autostart_entry_starts_the_tray_in_the_desktop_session() -> None:
    entry = configparser.ConfigParser(strict=False, interpolation=None)
    entry.optionxform = str  # type: ignore[assignment,method-assign]  # desktop entry keys are case-sensitive
    entry.read_string(AUTOSTART.read_text(encoding="utf-8"))
    desktop = entry["Desktop Entry"]
    program, *arguments = shlex.split(desktop["Exec"])
    assert program == "deskfleet-agent"
    assert build_parser().parse_args(arguments).command == "tray"
    assert desktop["Type"] == "Application" and desktop["Terminal"] == "false"


def test_the_controller_units_run_fleet_serve_and_serve_on_one_data_dir_as_one_user() -> None:
    fleet, serve = _unit(FLEET_UNIT), _unit(SERVE_UNIT)
    for unit in (fleet, serve):
        assert unit["Service"]["User"] == "deskfleet"  # not root: its data dir holds the fleet's CA key
        assert unit["Service"]["Environment"] == "DESKFLEET_CONTROLLER_DIR=/var/lib/deskfleet/controller"
        assert unit["Service"]["KillSignal"] == "SIGTERM"  # both stop cleanly on it, exit 0
        assert "2" in unit["Service"]["RestartPreventExitStatus"].split()  # a refused start waits for the admin
        assert unit["Install"]["WantedBy"] == "multi-user.target"  # a system service: the controller PC's, at boot
    program, *arguments = shlex.split(fleet["Service"]["ExecStart"])
    parsed = build_controller_parser().parse_args(arguments)
    assert program.endswith("/deskfleet") and (parsed.command, parsed.fleet_command) == ("fleet", "serve")
    program, *arguments = shlex.split(serve["Service"]["ExecStart"])
    parsed = build_controller_parser().parse_args(arguments)  # every option exists, spelled as `serve` takes it
    assert program.endswith("/deskfleet") and parsed.command == "serve" and parsed.fleet
    assert parsed.api_key_file is not None and not parsed.no_api_key  # an address others reach needs a key
    assert "deskfleet-fleet.service" in serve["Unit"]["After"].split()  # the registry first: the PCs call in there
