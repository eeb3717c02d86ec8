"""The shipped systemd unit starts the agent as its command line takes it, and stops it the way it stops cleanly; the
shipped autostart entry starts the tray."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

from deskfleet.agent.cli import build_parser

UNIT = Path(__file__).resolve().parents[1] / "assets" / "systemd" / "deskfleet-agent.service"
AUTOSTART = Path(__file__).resolve().parents[1] / "assets" / "autostart" / "deskfleet-tray.desktop"


def test_the_unit_runs_the_agent_headless_and_stops_it_with_sigterm() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    unit.read_string(UNIT.read_text(encoding="utf-8"))
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
