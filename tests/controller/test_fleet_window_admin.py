"""The fleet window's admin commands besides deploying: a join token made, copied and saved; a PC removed from the
fleet once the admin says yes. Each runs the command an admin would type (`fleet token`, `fleet remove`) as a child
of this Python, against a real controller data dir; a removal against real agents on loopback (tests/controller/
windows.py's office)."""

from __future__ import annotations

import datetime
import os
import stat
from pathlib import Path

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication

from deskfleet.agent.link import utc_now
from deskfleet.common.join_tokens import decode_join_token
from deskfleet.controller.fleet_ca import Revocations
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_token_dialog import TokenDialog, token_arguments, write_secret
from tests.controller.windows import LOOK_ONCE, Office, Opener, surveys, table, wait_for

COMMAND_S = 60.0  # a child Python importing deskfleet on a loaded 2-core machine


def test_a_token_is_made_with_the_uses_and_lifetime_asked_and_kept_as_a_password(
        app: QApplication, store: FleetStore, tmp_path: Path) -> None:
    assert token_arguments(25, "7d", store.data_dir) == ["token", "--uses", "25", "--ttl", "7d", "--data-dir",
                                                         str(store.data_dir)]
    dialog = TokenDialog(store.data_dir)
    assert not dialog.copy_button.isEnabled() and not dialog.save_button.isEnabled()  # nothing to copy yet
    dialog.uses.setValue(25)
    dialog.lifetime.setCurrentText("7d")
    dialog.make()
    assert not dialog.make_button.isEnabled()
    wait_for("the token", lambda: not dialog.child.running, COMMAND_S)
    assert dialog.state.text() == "Made: keep it as a password", dialog.notes.toPlainText()
    lasts = decode_join_token(dialog.token.text()).expires_at - utc_now()
    assert datetime.timedelta(days=6, hours=23) < lasts <= datetime.timedelta(days=7)
    notes = dialog.notes.toPlainText()
    assert "for 25 join(s)" in notes and "no `deskfleet fleet serve` runs" in notes  # what the command says of it
    dialog.copy()
    assert QGuiApplication.clipboard().text() == dialog.token.text()
    saved = tmp_path / "token.txt"
    saved.write_text("an older token\n")
    os.chmod(saved, 0o644)
    dialog.save(saved)
    assert saved.read_text() == dialog.token.text() + "\n"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600  # a file that was there loses its other readers too
    dialog.save(tmp_path / "missing" / "token.txt")
    assert dialog.state.text().startswith(f"Cannot save it to {tmp_path / 'missing' / 'token.txt'}:")


def test_a_lifetime_the_command_cannot_read_is_said_and_no_token_shown(app: QApplication, store: FleetStore) -> None:
    dialog = TokenDialog(store.data_dir)
    dialog.lifetime.setCurrentText("soon")
    dialog.make()
    wait_for("the refusal", lambda: not dialog.child.running, COMMAND_S)
    assert dialog.state.text() == "Token failed (exit status 2): its words are above"
    assert "deskfleet: error:" in dialog.notes.toPlainText() and dialog.token.text() == ""
    assert not dialog.copy_button.isEnabled()


def test_write_secret_leaves_the_file_to_its_owner(tmp_path: Path) -> None:
    write_secret(tmp_path / "token.txt", "abc")
    assert (tmp_path / "token.txt").read_text() == "abc\n"
    assert stat.S_IMODE((tmp_path / "token.txt").stat().st_mode) == 0o600


def test_a_pc_is_removed_only_once_the_admin_says_yes(open_window: Opener, office: Office) -> None:
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look", surveys(window, None))
    assert not window.remove_button.isEnabled()  # no PC selected
    asked: list[str] = []
    window.confirm = lambda title, question: asked.append(question) is not None and False  # Cancel
    window.table.selectRow(0)  # pc-desk
    desk = office.cores["pc-desk"].agent_id
    assert window.remove_button.isEnabled()
    window.remove_selected()
    assert asked and asked[0].startswith(f"Remove pc-desk ({desk[:12]}) from the fleet for good?")
    assert not window.remover.running and desk not in Revocations(office.store)().agent_ids
    window.confirm = lambda title, question: True
    first = window.listing
    window.remove_selected()
    wait_for("the removal and the look after it", lambda: not window.remover.running and
             surveys(window, first)(), COMMAND_S)
    assert desk in Revocations(office.store)().agent_ids
    assert window.statusBar().currentMessage() == f"removed agent {desk}: it is refused from now on"
    assert list(table(window)) == ["pc-laptop", "pc-off"]  # a removed PC is dialled no more
    assert not window.remove_button.isEnabled()  # what was selected is gone


def test_a_pc_that_never_answered_with_an_id_cannot_be_removed_from_here(
        open_window: Opener, office: Office) -> None:
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look", surveys(window, None))
    window.table.selectRow(2)  # pc-off: enrolled, so its id is known
    assert window.remove_button.isEnabled()
    window.table.clearSelection()
    assert not window.remove_button.isEnabled()
