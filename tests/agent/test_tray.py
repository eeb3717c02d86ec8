"""The tray (agent/tray.py) on Qt's offscreen platform: the menu it builds from the agent's published status, the
toggle writing the employee's pause, and the ways it refuses to start. Offscreen Qt has no system tray, so the
icon's menu is driven directly, as a click would."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from deskfleet.agent import tray as tray_module
from deskfleet.agent.cli import main
from deskfleet.agent.core import AgentCore
from deskfleet.agent.opt_out import OPT_OUT_FILE, read_opt_out, write_opt_out
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.standing import MEMBERSHIP_FILE
from deskfleet.agent.status_file import (
    STATUS_FILE,
    PublishedStatus,
    this_process_started_at,
    write_status_file,
)
from deskfleet.agent.tray import AgentTray, TrayError, icon_for, run_tray
from deskfleet.agent.tray_view import TrayIcon
from tests.agent.test_opt_out import PluggedInDesktop
from tests.fleet_pki import make_ca, make_member


@pytest.fixture(scope="module")
def app() -> Iterator[QApplication]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # no display here: Qt's xcb plugin would abort the process
    existing = QApplication.instance()
    yield existing if isinstance(existing, QApplication) else QApplication([])


@pytest.fixture
def agent(tmp_path: Path) -> tuple[AgentCore, AgentPaths]:
    """A joined agent's data dir, and a real core over it whose status the test publishes as the service does."""
    from deskfleet.agent.paths import AgentSettings
    from deskfleet.agent.shard_cache import ShardCache

    paths = AgentPaths.resolve(tmp_path / "agent")
    paths.create()
    (paths.state_dir / MEMBERSHIP_FILE).write_text("{}")  # the tray only asks whether the PC joined
    files = make_member(make_ca(tmp_path / "ca"), tmp_path / "tls", "agent")
    core = AgentCore(files, AgentSettings(), ShardCache(paths.shard_dir, 1 << 30), PluggedInDesktop(),
                     opt_out_dir=paths.state_dir)
    return core, paths


def publish(core: AgentCore, paths: AgentPaths) -> None:
    write_status_file(paths.state_dir, PublishedStatus(asyncio.run(core.local_status()), core.agent_id, os.getpid(),
                                                       this_process_started_at(), core.pause_source(), True, 30.0))


def menu_texts(tray: AgentTray) -> list[str]:
    return [action.text() for action in tray.menu.actions() if not action.isSeparator() and action.isVisible()]


def test_the_menu_shows_the_published_status(app: QApplication, agent: tuple[AgentCore, AgentPaths]) -> None:
    core, paths = agent
    tray = AgentTray(paths)
    assert tray.refresh().headline == "the deskfleet agent is not running"  # nothing published yet
    assert menu_texts(tray)[0] == "The deskfleet agent is not running"
    publish(core, paths)
    view = tray.refresh()
    assert view.icon is TrayIcon.AVAILABLE and tray.icon.toolTip() == "deskfleet: available to the fleet"
    texts = menu_texts(tray)
    assert texts[0] == "Available to the fleet" and texts[1:-2] == list(view.lines)
    assert texts[-2:] == ["Pause deskfleet on this PC", "Quit the tray (the agent keeps running)"]
    assert not tray.headline.isEnabled() and all(not line.isEnabled() for line in tray.lines)
    assert tray.toggle.isEnabled() and not tray.toggle.isChecked()


def test_the_toggle_pauses_and_resumes_the_pc_through_its_opt_out_file(
        app: QApplication, agent: tuple[AgentCore, AgentPaths]) -> None:
    core, paths = agent
    publish(core, paths)
    tray = AgentTray(paths)
    tray.refresh()
    tray.toggle.trigger()  # the employee's click
    assert read_opt_out(paths.state_dir).paused
    assert tray.view is not None and tray.view.headline == "pausing..." and tray.toggle.isChecked()
    publish(core, paths)  # the agent's next status: it read the file
    assert tray.refresh().headline == "paused by you: this PC serves no model"
    assert core.policy().paused
    tray.toggle.trigger()
    assert not read_opt_out(paths.state_dir).paused and not core.policy().paused
    assert tray.view is not None and tray.view.headline == "resuming..." and not tray.toggle.isChecked()


def test_showing_a_pause_writes_nothing(app: QApplication, agent: tuple[AgentCore, AgentPaths]) -> None:
    # setChecked from the file would fire the toggle's signal: the tray would write the pause it had just read,
    # moving its time, or undo a `deskfleet-agent resume` typed meanwhile
    core, paths = agent
    write_opt_out(paths.state_dir, True, "2026-12-07T08:00:00+00:00")
    publish(core, paths)
    tray = AgentTray(paths)
    tray.refresh()
    assert tray.toggle.isChecked()
    write_opt_out(paths.state_dir, False, "2026-12-07T09:00:00+00:00")  # `deskfleet-agent resume` in a terminal
    tray.refresh()
    assert not tray.toggle.isChecked()
    assert read_opt_out(paths.state_dir).since == "2026-12-07T09:00:00+00:00"


def test_the_menu_grows_and_shrinks_with_what_there_is_to_say(app: QApplication,
                                                              agent: tuple[AgentCore, AgentPaths]) -> None:
    core, paths = agent
    tray = AgentTray(paths)
    publish(core, paths)
    long = len(menu_texts(tray.refresh() and tray))
    (paths.state_dir / STATUS_FILE).write_text("{")
    view = tray.refresh()
    assert view.icon is TrayIcon.PROBLEM and len(menu_texts(tray)) == 4 < long
    assert menu_texts(tray)[1].startswith(f"{paths.state_dir / STATUS_FILE} is not valid JSON")
    publish(core, paths)
    assert len(menu_texts(tray.refresh() and tray)) == long


def test_a_pause_that_cannot_be_written_is_said_and_not_shown_as_done(
        app: QApplication, agent: tuple[AgentCore, AgentPaths], monkeypatch: pytest.MonkeyPatch) -> None:
    core, paths = agent
    publish(core, paths)
    tray = AgentTray(paths)
    tray.refresh()
    said: list[str] = []
    monkeypatch.setattr(tray.icon, "showMessage", lambda title, text, *rest: said.append(text))
    (paths.state_dir / OPT_OUT_FILE).mkdir()  # a folder in the file's place: the write fails
    tray.toggle.trigger()
    assert len(said) == 1 and said[0].startswith("Could not pause this PC: ") and str(paths.state_dir) in said[0]
    assert "is a folder, not a regular file" in said[0]
    # the toggle shows what the file says, as the agent reads it (a file that cannot be read counts as paused)
    assert tray.toggle.isChecked() == read_opt_out(paths.state_dir).paused


def test_hours_of_refreshes_keep_pythons_none_alive(app: QApplication, agent: tuple[AgentCore, AgentPaths]) -> None:
    # PySide6 6.12.0 dropped a reference to None at each Qt call returning nothing: on Python 3.11 the tray aborted
    # ("deallocating None") after ~1000 refreshes, 33 minutes (pyproject.toml excludes it)
    core, paths = agent
    publish(core, paths)
    tray = AgentTray(paths)
    problem = paths.state_dir / "problem"
    gc.collect()
    before = sys.getrefcount(None)
    for turn in range(300):  # the menu changing shape too: lines added and removed
        tray.refresh()
        if turn % 2:
            (paths.state_dir / STATUS_FILE).rename(problem)
        elif problem.exists():
            problem.rename(paths.state_dir / STATUS_FILE)
    gc.collect()  # what cycles hold is not what Qt lost
    assert abs(sys.getrefcount(None) - before) < 100, "Qt calls are losing references to None"


def test_a_status_the_view_cannot_show_is_named_not_left_frozen(app: QApplication,
                                                                agent: tuple[AgentCore, AgentPaths],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    core, paths = agent
    publish(core, paths)
    tray = AgentTray(paths)
    tray.refresh()

    def broken(facts: object) -> None:
        raise TypeError("unsupported operand type(s) for *: 'NoneType' and 'int'")

    monkeypatch.setattr(tray_module, "tray_view", broken)
    view = tray.refresh()
    assert view.icon is TrayIcon.PROBLEM and menu_texts(tray)[:2] == [
        "Cannot show the agent's status", "TypeError: unsupported operand type(s) for *: 'NoneType' and 'int'"]
    tray.toggle.trigger()  # the employee can still pause the PC
    assert read_opt_out(paths.state_dir).paused and tray.toggle.isChecked() and tray.toggle.isEnabled()


def test_each_state_has_its_own_icon(app: QApplication) -> None:
    images = {kind: icon_for(kind).pixmap(32, 32).toImage() for kind in TrayIcon}
    assert all(not image.isNull() for image in images.values())
    assert len({bytes(image.constBits()) for image in images.values()}) == len(TrayIcon)


def test_a_mistyped_data_dir_and_a_desktop_without_a_tray_are_refused(
        app: QApplication, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TrayError, match="does not exist: give --data-dir the agent's data dir"):
        run_tray(tmp_path / "typo")
    (tmp_path / "agent" / "state").mkdir(parents=True)
    monkeypatch.setattr(tray_module, "TRAY_WAIT_S", 0.0)  # offscreen Qt has no tray area
    assert main(["tray", "--data-dir", str(tmp_path / "agent")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("deskfleet-agent: error: this desktop shows no system tray") and "pause" in error


def test_one_tray_per_data_dir(agent: tuple[AgentCore, AgentPaths]) -> None:
    _, paths = agent
    with tray_module._tray_lock(paths):
        with pytest.raises(TrayError, match=f"a tray already shows this PC's agent \\(pid {os.getpid()}"):
            with tray_module._tray_lock(paths):
                pass


def test_the_tray_loads_no_inference_runtime_and_no_network_stack() -> None:
    # it runs all day in the employee's session: OpenVINO alone would add ~100 MB to it, and the agent's TLS and
    # websockets modules (through enroll.py, for a file name) took it from 77 to 95 MB
    code = ("import sys, deskfleet.agent.tray; print(sorted(m for m in ('openvino', 'torch', 'websockets', "
            "'cryptography') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert json.loads(result.stdout.replace("'", '"')) == []
