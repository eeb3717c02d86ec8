"""The fleet window's deploy dialog: `fleet plan` and `fleet deploy` run as the admin would type them, in a child
process (`python -P -m deskfleet.controller`), against real agents on loopback (test_fleet_window's Office); their
output shows as it comes, a deploy's end makes the window look again, Stop and closing end a command under way."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from PySide6.QtWidgets import QApplication

from deskfleet.agent.link import utc_now
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_deploy_dialog import DeployDialog, DeployRequest, fleet_command
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import SurveyOptions
from tests.controller.fleet_office import ENROLLED, LOOK_ONCE, Office, Opener, surveys, table, wait_for

COMMAND_S = 120.0  # a child Python that imports deskfleet, surveys and (deploy) waits for stages compiled here


def ended(dialog: DeployDialog) -> bool:
    return dialog.process is None


def test_the_commands_are_the_admins_own_with_the_windows_data_dir_and_survey(tmp_path: Path) -> None:
    request = DeployRequest(tmp_path / "model", "all_by_speed", "f32", "GPU")
    assert fleet_command("deploy", request, tmp_path / "ctl", SurveyOptions(("10.0.0.9:7431",), 0.0)) == [
        "-P", "-m", "deskfleet.controller", "fleet", "deploy", "--model", str(tmp_path / "model"),
        "--policy", "all_by_speed", "--precision", "f32", "--device", "GPU", "--data-dir", str(tmp_path / "ctl"),
        "--discover-seconds", "0", "--peer", "10.0.0.9:7431"]
    assert fleet_command("plan", DeployRequest(tmp_path), tmp_path, SurveyOptions())[3:5] == ["fleet", "plan"]
    with pytest.raises(ValueError, match="no fleet command 'remove'"):
        fleet_command("remove", request, tmp_path, SurveyOptions())


def test_no_command_starts_without_a_model_folder(app: QApplication, tmp_path: Path) -> None:
    dialog = DeployDialog(tmp_path, SurveyOptions())
    dialog.start("plan")
    assert dialog.process is None and dialog.state.text() == "Choose the model's folder first"
    dialog.model.setText(str(tmp_path / "missing"))
    dialog.start("deploy")
    assert dialog.process is None and dialog.state.text() == f"{tmp_path / 'missing'} is not a folder"


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


def test_stop_and_closing_end_a_command_under_way(app: QApplication, tmp_path: Path, tiny_export: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    with socket.socket() as hung:  # a PC whose TLS never answers: a plan waits the link's whole open timeout (10 s)
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        agent = "b" * 52
        store.save_roster({agent: RosterEntry(agent, "pc-hung", ENROLLED, (f"127.0.0.1:{hung.getsockname()[1]}",))})
        dialog = DeployDialog(store.data_dir, SurveyOptions(discover_seconds=0))
        dialog.model.setText(str(tiny_export))
        for close in (False, True):
            dialog.show()
            dialog.start("plan")
            time.sleep(1.5)  # into the survey (or the imports: either is stopped alike)
            began = time.monotonic()
            if close:
                dialog.close()
                assert dialog.isVisible()  # not until the command has ended
            else:
                dialog.stop()
            wait_for("the stop", lambda: ended(dialog), 30)
            assert time.monotonic() - began < 8, "waited out the survey instead of stopping it"
            assert dialog.state.text() == "Plan stopped"
            assert dialog.isVisible() is not close
