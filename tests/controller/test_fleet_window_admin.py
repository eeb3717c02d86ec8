"""The fleet window's admin commands besides deploying: a join token made, copied and saved; a PC removed from the
fleet once the admin says yes. Each runs the command an admin would type (`fleet token`, `fleet remove`) as a child
of this Python, against a real controller data dir; a removal against real agents on loopback (tests/controller/
windows.py's office)."""

from __future__ import annotations

import datetime
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication

from deskfleet.agent.link import utc_now
from deskfleet.common.join_tokens import decode_join_token
from deskfleet.controller.fleet_ca import Revocations
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_token_dialog import TokenDialog, token_arguments, write_secret
from tests.controller.windows import LOOK_ONCE, FakeSurveys, Office, Opener, pc, surveys, table, wait_for

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


def test_write_secret_is_its_owners_alone_from_its_first_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    real_replace = os.replace

    def replace(source: str, target: Path) -> None:  # what the file is as it takes the path's place
        modes.append(stat.S_IMODE(os.stat(source).st_mode))
        assert Path(source).read_text() == "abc\n"
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    shared = tmp_path / "token.txt"
    shared.write_text("an older token\n")
    os.chmod(shared, 0o666)
    write_secret(shared, "abc")
    assert modes == [0o600] and shared.read_text() == "abc\n" and stat.S_IMODE(shared.stat().st_mode) == 0o600
    assert sorted(path.name for path in tmp_path.iterdir()) == ["token.txt"]  # no temporary file left


def test_write_secret_replaces_a_link_and_leaves_its_target(tmp_path: Path) -> None:
    # a symbolic link at the path had its target overwritten and made 600 (another file of the user's, or of root's)
    target = tmp_path / "settings.conf"
    target.write_text("important\n")
    os.chmod(target, 0o644)
    link = tmp_path / "token.txt"
    link.symlink_to(target)
    write_secret(link, "abc")
    assert not link.is_symlink() and link.read_text() == "abc\n"
    assert target.read_text() == "important\n" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_token_is_forgotten_when_its_dialog_closes(app: QApplication, store: FleetStore) -> None:
    dialog = TokenDialog(store.data_dir)
    dialog.show()
    dialog.make()
    wait_for("the token", lambda: not dialog.child.running, COMMAND_S)
    assert dialog.token.text()
    dialog.reject()  # Esc
    dialog.show()  # opened again from the window
    assert dialog.token.text() == "" and not dialog.copy_button.isEnabled()


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


def test_a_peer_that_never_answered_has_no_id_to_remove(open_window: Opener, store: FleetStore,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    stranger = replace(pc("pc-x", None), agent_id=None, hostname="?", address="10.0.0.9:7431")  # a --peer: no id
    FakeSurveys(monkeypatch, [pc("pc-a"), stranger])
    window = open_window(store, LOOK_ONCE)
    wait_for("the look", surveys(window, None))
    window.table.selectRow(0)
    assert window.remove_button.isEnabled()
    window.table.selectRow(1)
    assert window.selected_agent() is stranger and not window.remove_button.isEnabled()
    window.table.clearSelection()
    assert not window.remove_button.isEnabled()


def test_a_removal_said_yes_to_is_let_finish_when_the_window_closes(open_window: Opener, office: Office) -> None:
    window = open_window(office.store, LOOK_ONCE)
    wait_for("the first look", surveys(window, None))
    window.confirm = lambda title, question: True
    window.table.selectRow(0)
    window.remove_selected()
    window.close()  # at once: the removal was stopped, and the PC stayed a member with nothing said
    assert office.cores["pc-desk"].agent_id in Revocations(office.store)().agent_ids
