"""The fleet window's deploy dialog: `fleet plan` and `fleet deploy` run as the admin would type them, in a child
process (`python -P -m deskfleet.controller`), against real agents on loopback (test_fleet_window's Office); their
output shows as it comes, a deploy's end makes the window look again, Stop and closing end a command under way."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import utc_now
from deskfleet.common.wire import AssignStage, StageReady
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_child import child_arguments, ending
from deskfleet.controller.fleet_deploy_dialog import DeployDialog, DeployRequest, fleet_command
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import SurveyOptions
from tests.controller.windows import ENROLLED, LOOK_ONCE, Office, Opener, surveys, table, wait_for

COMMAND_S = 120.0  # a child Python that imports deskfleet, surveys and (deploy) waits for stages compiled here


def ended(dialog: DeployDialog) -> bool:
    return not dialog.child.running


def test_the_commands_are_the_admins_own_with_the_windows_data_dir_and_survey(tmp_path: Path) -> None:
    request = DeployRequest(tmp_path / "model", "all_by_speed", "f32", "GPU")
    assert child_arguments(fleet_command("deploy", request, tmp_path / "ctl", SurveyOptions(("10.0.0.9:7431",), 0.0))) \
        == ["-P", "-m", "deskfleet.controller", "fleet", "deploy", "--model", str(tmp_path / "model"),
            "--policy", "all_by_speed", "--precision", "f32", "--device", "GPU", "--data-dir", str(tmp_path / "ctl"),
            "--discover-seconds", "0", "--peer", "10.0.0.9:7431"]
    assert fleet_command("plan", DeployRequest(tmp_path), tmp_path, SurveyOptions())[0] == "plan"
    with pytest.raises(ValueError, match="no fleet command 'remove'"):
        fleet_command("remove", request, tmp_path, SurveyOptions())


def test_no_command_starts_without_a_model_folder(app: QApplication, tmp_path: Path) -> None:
    dialog = DeployDialog(tmp_path, SurveyOptions())
    dialog.start("plan")
    assert ended(dialog) and dialog.state.text() == "Choose the model's folder first"
    dialog.model.setText(str(tmp_path / "missing"))
    dialog.start("deploy")
    assert ended(dialog) and dialog.state.text() == f"{tmp_path / 'missing'} is not a folder"


@pytest.mark.slow
def test_plan_then_deploy_from_the_window(open_window: Opener, office: Office, tiny_export: Path) -> None:
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look", surveys(window, None))
    dialog = window.open_deploy()
    assert window.open_deploy() is dialog  # one dialog
    dialog.model.setText(str(tiny_export))
    dialog.start("plan")
    assert not dialog.deploy_button.isEnabled() and dialog.stop_button.isEnabled()  # one command at a time
    wait_for("the plan", lambda: ended(dialog), COMMAND_S)
    plan = dialog.output.toPlainText()
    assert dialog.state.text() == "Plan done", plan
    assert "1 stage(s):" in plan and "pc-desk" in plan and "pc-laptop" in plan  # placed, and left out (on battery)
    assert not office.cores["pc-desk"].stages  # a plan changes nothing
    shown = window.listing
    dialog.start("deploy")
    wait_for("the deploy", lambda: ended(dialog), COMMAND_S)
    assert dialog.state.text() == "Deploy done", dialog.output.toPlainText()
    assert "1 stage(s) ready" in dialog.output.toPlainText()
    assert [(ref.layer_start, ref.layer_end) for ref in office.cores["pc-desk"].stages] == [(0, 4)]
    wait_for("the window's look after the deploy", surveys(window, shown))
    desk = table(window)["pc-desk"]
    assert desk["state"] == "serving" and desk["stages"].endswith("[0:4]")


def test_a_command_that_fails_says_so_in_its_own_words(app: QApplication, tmp_path: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    dialog = DeployDialog(store.data_dir, SurveyOptions(discover_seconds=0))
    dialog.model.setText(str(tmp_path))  # a folder, but no export
    dialog.start("plan")
    wait_for("the plan", lambda: ended(dialog), COMMAND_S)
    assert dialog.state.text() == "Plan failed (exit status 2): its words are above"
    assert "deskfleet: error:" in dialog.output.toPlainText() and "manifest" in dialog.output.toPlainText()


@pytest.mark.parametrize("how", ["Stop", "closing", "Esc"])
def test_stop_closing_and_esc_end_a_command_under_way(app: QApplication, tmp_path: Path, tiny_export: Path,
                                                      how: str) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    with socket.socket() as hung:  # a PC whose TLS never answers: a plan waits the link's whole open timeout (10 s)
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        agent = "b" * 52
        store.save_roster({agent: RosterEntry(agent, "pc-hung", ENROLLED, (f"127.0.0.1:{hung.getsockname()[1]}",))})
        dialog = DeployDialog(store.data_dir, SurveyOptions(discover_seconds=0))
        dialog.model.setText(str(tiny_export))
        dialog.show()
        dialog.start("plan")
        process = dialog.child.process
        assert process is not None
        environment = process.processEnvironment()  # UTF-8 and each line as printed, whatever the console's
        assert (environment.value("PYTHONIOENCODING"), environment.value("PYTHONUNBUFFERED")) == ("utf-8", "1")
        time.sleep(1.5)  # into the survey (or the imports: either is stopped alike)
        began = time.monotonic()
        if how == "Stop":
            dialog.stop()
        elif how == "closing":
            dialog.close()
        else:
            dialog.reject()  # what Esc does: it hid the dialog and left the command running
        if how != "Stop":
            assert dialog.isVisible()  # not until the command has ended
        wait_for("the stop", lambda: ended(dialog), 30)
        assert time.monotonic() - began < 8, "waited out the survey instead of stopping it"
        assert dialog.state.text() == "Plan stopped"
        assert dialog.isVisible() is (how == "Stop")
        dialog.close()


@pytest.mark.slow
def test_a_deploy_stopped_midway_releases_the_stages_it_gave(office: Office, tiny_export: Path, tmp_path: Path) -> None:
    # `fleet deploy` ended on SIGTERM's default (the dialog's Stop, a service manager's stop): the PC that had its stage
    # kept it, on no record. Now it unwinds as on Ctrl-C, and the PCs are asked to release what it gave them.
    laptop = office.monitors["pc-laptop"]
    laptop.reading = replace(laptop.reading, on_ac_power=True, battery_percent=90.0)  # both PCs take a stage
    release = asyncio.Event()
    assigned: list[str] = []

    def second_waits(core: AgentCore) -> None:
        real = core._assign

        async def assign(message: AssignStage) -> StageReady:
            assigned.append(core.agent_id)
            if len(assigned) > 1:  # the second stage's PC holds the deploy until the test has stopped it
                await release.wait()
                raise RuntimeError("released by the test")
            return await real(message)

        core._assign = assign  # type: ignore[method-assign]

    for core in office.cores.values():
        second_waits(core)
    deploy = fleet_command("deploy", DeployRequest(tiny_export, "all_by_speed"), office.store.data_dir,
                           SurveyOptions(discover_seconds=0))
    command = [sys.executable, *child_arguments(deploy), "--hop-ms", "0"]
    said = tmp_path / "deploy.err"
    with said.open("w") as errors:  # a file, not a pipe nobody reads while it runs (its progress lines would fill it)
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
    try:
        deadline = time.monotonic() + COMMAND_S
        while not (len(assigned) > 1 and any(core.stages for core in office.cores.values())):
            assert child.poll() is None and time.monotonic() < deadline, said.read_text()
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        office.call_soon(release.set)
        if child.poll() is None:
            child.kill()
    err = said.read_text()
    assert child.returncode == 143, err
    assert "deskfleet: deploy stopped by SIGTERM: " in err and "asked to release the stages" in err
    wait_for("the stage released", lambda: not any(core.stages for core in office.cores.values()), 30)
    assert not (office.store.data_dir / "deployments.json").exists()  # nothing on record


def test_a_character_split_over_two_reads_shows_whole(app: QApplication, tmp_path: Path) -> None:
    dialog = DeployDialog(tmp_path, SurveyOptions())
    for piece in "pc-été 61°C\n".encode()[:6], "pc-été 61°C\n".encode()[6:]:  # the é's two bytes, apart
        dialog.child.take(piece)
    dialog.child.take(b"\xe2\x80", final=True)  # a command cut off mid-character: said as such
    assert dialog.output.toPlainText() == "pc-été 61°C\n\ufffd"


def test_how_a_command_ended_in_words() -> None:
    assert ending("deploy", 0, False, False) == "Deploy done"
    assert ending("deploy", 0, False, True) == "Deploy done"  # it had finished before Stop came
    assert ending("plan", 2, False, False) == "Plan failed (exit status 2)"
    assert ending("deploy", 143, False, True) == ending("deploy", 15, True, True) == "Deploy stopped"
    assert ending("deploy", 1, False, True) == "Deploy failed (exit status 1)"
    assert ending("deploy", 9, True, False) == \
        "Deploy ended by a signal (9): killed (by the OS, for memory?) or crashed"


def test_a_deploy_that_ends_during_a_look_is_looked_at_after_it(open_window: Opener, office: Office,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # its end asked for a look while one was under way, which was dropped: the stages showed a look later (15 s)
    from deskfleet.controller import fleet_survey

    real, looks, held = fleet_survey.survey, [], threading.Event()

    async def survey(store: FleetStore, options: SurveyOptions) -> fleet_survey.Survey:
        looks.append(1)
        if len(looks) == 2:
            await asyncio.to_thread(held.wait, 30)  # the look under way as the deploy ends
        return await real(store, options)

    monkeypatch.setattr(fleet_survey, "survey", survey)
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look", surveys(window, None))
    window.refresh()
    window.open_deploy().deploy_ended.emit()  # as a deploy's end does
    held.set()
    wait_for("the look after the deploy", lambda: len(looks) == 3 and window.refresh_button.isEnabled())
