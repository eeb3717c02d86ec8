"""The fleet window's "Join token" dialog: `deskfleet fleet token` from the window, for the PCs to join with.

It runs the command (controller/fleet_child.py) with the window's data dir and the uses and lifetime chosen here, and
shows the token with what the command says of it (how long it lasts, a `fleet serve` that is not running, addresses
that are not this PC's). The token is a password for joining PCs: Copy puts it on the clipboard, Save writes it to a
file only its owner may read, for a rollout's `deskfleet-agent join - < token.txt`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from PySide6.QtGui import QGuiApplication, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from deskfleet.controller.fleet_ca import MAX_TOKEN_USES
from deskfleet.controller.fleet_child import FleetChild

LIFETIMES = ("1h", "24h", "7d")  # offered; any `fleet token --ttl` duration may be typed


def token_arguments(uses: int, lifetime: str, data_dir: Path) -> list[str]:
    """`fleet token`'s arguments (after `fleet`)."""
    return ["token", "--uses", str(uses), "--ttl", lifetime, "--data-dir", str(data_dir)]


def write_secret(path: Path, text: str) -> None:
    """`text` and a newline as the file `path`, readable by its owner alone from its first byte: it lets whoever reads
    it join PCs to the fleet. Written to a new file beside it (made with mode 600, exclusively: no link followed), then
    renamed over `path`: a file that was there is replaced, with the readers it had, and a symbolic link there is
    replaced itself, its target untouched (a link to another file had that file overwritten and its mode changed).
    On Windows the new file takes its folder's permissions: save it in your own folders."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class TokenDialog(QDialog):
    def __init__(self, data_dir: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.data_dir = data_dir
        self.child = FleetChild(merged=False, parent=self)  # the token alone on its standard output
        self.child.output.connect(self._token_text)
        self.child.errors.connect(self._said)
        self.child.ended.connect(self._ended)
        self._printed = ""
        self.setWindowTitle("Join token")
        self.resize(760, 340)
        self.uses = QSpinBox()
        self.uses.setRange(1, MAX_TOKEN_USES)
        self.uses.setValue(1)
        self.lifetime = QComboBox()
        self.lifetime.setEditable(True)  # 90m, 3d, 1h30m...: the command says what it cannot read
        self.lifetime.addItems(LIFETIMES)
        self.lifetime.setCurrentText("24h")
        form = QFormLayout()
        form.addRow("PCs that may join with it", self.uses)
        form.addRow("Valid for", self.lifetime)
        self.token = QLineEdit()
        self.token.setReadOnly(True)
        self.token.setPlaceholderText("Make a token: it lets whoever holds it join PCs while it lasts, as a password")
        self.notes = QPlainTextEdit()
        self.notes.setReadOnly(True)
        self.state = QLabel("")
        self.make_button = QPushButton("Make a token")
        self.make_button.clicked.connect(self.make)
        self.copy_button = QPushButton("Copy")
        self.copy_button.clicked.connect(self.copy)
        self.save_button = QPushButton("Save as...")
        self.save_button.clicked.connect(self._save_as)
        buttons = QHBoxLayout()
        buttons.addWidget(self.state, 1)
        buttons.addWidget(self.make_button)
        buttons.addWidget(self.copy_button)
        buttons.addWidget(self.save_button)
        layout = QVBoxLayout()
        layout.addLayout(form)
        layout.addWidget(self.token)
        layout.addWidget(self.notes, 1)
        layout.addLayout(buttons)
        self.setLayout(layout)
        self._show_buttons()

    def make(self) -> None:
        lifetime = self.lifetime.currentText().strip()
        if not lifetime:
            self.state.setText("Say how long the token is valid for (1h, 24h, 7d, 90m...)")
            return
        self.token.clear()
        self.notes.clear()
        self._printed = ""
        self.state.setText("Making a token...")
        self.child.start("token", token_arguments(self.uses.value(), lifetime, self.data_dir))
        self._show_buttons()

    def copy(self) -> None:
        if self.token.text():
            QGuiApplication.clipboard().setText(self.token.text())
            self.state.setText("Copied: it stays on the clipboard until you copy something else; paste it where only "
                               "the PCs' rollout reads it")

    def save(self, path: Path) -> None:
        try:
            write_secret(path, self.token.text())
        except OSError as error:
            self.state.setText(f"Cannot save it to {path}: {error.strerror or error}")
            return
        readers = "only you may read it" if os.name == "posix" else "with its folder's permissions"
        self.state.setText(f"Saved to {path} ({readers}): on each PC, deskfleet-agent join - < {path.name}")

    def done(self, result: int) -> None:  # Qt's name: every close (the window's, Esc, its title bar's) comes here
        """Closed: a token under way is stopped (nothing to undo), and the token shown is forgotten, so that the
        dialog opened again shows none."""
        self.child.stop_and_wait(5_000)
        self.token.clear()
        self.notes.clear()
        self.state.setText("")
        self._show_buttons()
        super().done(result)

    # What the command does

    def _token_text(self, text: str) -> None:
        self._printed += text
        self.token.setText(self._printed.strip())

    def _said(self, text: str) -> None:
        self.notes.moveCursor(QTextCursor.MoveOperation.End)  # at the end, wherever a click left the cursor
        self.notes.insertPlainText(text)

    def _ended(self, said: str) -> None:
        made = said == "Token done" and bool(self.token.text())
        self.state.setText("Made: keep it as a password" if made else
                           f"{said}: its words are above" if said.startswith("Token failed") else said)
        if not made:
            self.token.clear()
        self._show_buttons()

    def _save_as(self) -> None:
        chosen, _ = QFileDialog.getSaveFileName(self, "Save the join token", "token.txt")
        if chosen:
            self.save(Path(chosen))

    def _show_buttons(self) -> None:
        self.make_button.setEnabled(not self.child.running)
        has_token = bool(self.token.text()) and not self.child.running
        self.copy_button.setEnabled(has_token)
        self.save_button.setEnabled(has_token)
