"""The fleet window's "Deploy a model" dialog: `deskfleet fleet plan` and `fleet deploy` from the window.

It runs the very commands an admin would type (controller/fleet_child.py), with the window's data dir and survey
options, and shows what they print as they print it: the plan, each file sent, the stages made ready, or the error
that stopped them. Stop, Esc and closing stop a command under way as Ctrl-C would: a deploy stopped midway has the PCs
release the stages it gave them (on Windows it is ended hard, and a PC keeps what it was given until the model's next
deploy or its agent's restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QCloseEvent, QFontDatabase, QTextCursor
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
    QVBoxLayout,
    QWidget,
)

from deskfleet.common.planner import PlanPolicy
from deskfleet.common.wire import Precision
from deskfleet.controller.fleet_child import FleetChild
from deskfleet.controller.fleet_survey import SurveyOptions


@dataclass(frozen=True)
class DeployRequest:
    """What the dialog asks of the fleet: a model folder and how to place it."""

    model: Path
    policy: str = PlanPolicy.FEWEST_AGENTS.value
    precision: str = Precision.DEVICE_DEFAULT.value
    device: str = "CPU"


def fleet_command(action: str, request: DeployRequest, data_dir: Path, survey: SurveyOptions) -> list[str]:
    """The arguments of `deskfleet fleet plan|deploy` for `request` (after `fleet`), with the window's data dir and
    survey options (survey_arguments)."""
    if action not in ("plan", "deploy"):
        raise ValueError(f"no fleet command {action!r}: plan or deploy")
    return [action, "--model", str(request.model), "--policy", request.policy, "--precision", request.precision,
            "--device", request.device, *survey_arguments(data_dir, survey)]


def survey_arguments(data_dir: Path, survey: SurveyOptions) -> list[str]:
    """A `fleet` command's --data-dir, and the window's own --peer and --discover-seconds, so that the command looks
    for the PCs the window shows."""
    arguments = ["--data-dir", str(data_dir), "--discover-seconds", f"{survey.discover_seconds:g}"]
    for peer in survey.peers:
        arguments += ["--peer", peer]
    return arguments


class DeployDialog(QDialog):
    """Choose a model folder and how to place it; Plan shows the split, Deploy pushes it; what the command prints
    shows below as it comes."""

    deploy_ended = Signal()  # whatever its exit status: the fleet may have changed either way

    def __init__(self, data_dir: Path, survey: SurveyOptions, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.data_dir = data_dir
        self.survey = survey
        self.child = FleetChild(merged=True, parent=self)  # the plan's table and the notes after it, in order
        self.child.output.connect(self._append)
        self.child.ended.connect(self._ended)
        self._close_when_ended = False
        self.setWindowTitle("Deploy a model")
        self.resize(900, 560)
        self.model = QLineEdit()
        self.model.setPlaceholderText("a folder made by `deskfleet export`")
        browse = QPushButton("Browse...")
        browse.clicked.connect(self._browse)
        folder = QHBoxLayout()
        folder.addWidget(self.model, 1)
        folder.addWidget(browse)
        self.policy = QComboBox()
        self.policy.addItems([policy.value for policy in PlanPolicy])
        self.precision = QComboBox()
        self.precision.addItems([precision.value for precision in Precision])
        self.device = QLineEdit("CPU")
        form = QFormLayout()
        form.addRow("Model folder", folder)
        form.addRow("Policy", self.policy)
        form.addRow("Precision", self.precision)
        form.addRow("Device", self.device)
        self.output = QPlainTextEdit()
        self.output.setReadOnly(True)
        self.output.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))  # the plan's table lines up
        self.output.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.output.setPlaceholderText("Plan shows how the model would be split over the PCs; Deploy sends each PC "
                                       "what it lacks and assigns the stages")
        self.state = QLabel("")
        self.plan_button = QPushButton("Plan")
        self.plan_button.clicked.connect(lambda: self.start("plan"))
        self.deploy_button = QPushButton("Deploy")
        self.deploy_button.clicked.connect(lambda: self.start("deploy"))
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        buttons = QHBoxLayout()
        buttons.addWidget(self.state, 1)
        buttons.addWidget(self.plan_button)
        buttons.addWidget(self.deploy_button)
        buttons.addWidget(self.stop_button)
        layout = QVBoxLayout()
        layout.addLayout(form)
        layout.addWidget(self.output, 1)
        layout.addLayout(buttons)
        self.setLayout(layout)
        self._show_buttons()

    def request(self) -> DeployRequest | None:
        """What the form asks for; None (said) where the folder is not given or is no folder."""
        text = self.model.text().strip()
        if not text:
            self.state.setText("Choose the model's folder first")
            return None
        model = Path(text).expanduser().absolute()  # the child runs in this process's folder: the same path either way
        if not model.is_dir():
            self.state.setText(f"{model} is not a folder")
            return None
        device = self.device.text().strip() or "CPU"
        return DeployRequest(model, self.policy.currentText(), self.precision.currentText(), device)

    def start(self, action: str) -> None:
        """Run `fleet plan` or `fleet deploy` (one at a time)."""
        if self.child.running:
            return
        request = self.request()
        if request is None:
            return
        self.output.clear()
        self.state.setText("Planning..." if action == "plan" else "Deploying...")
        self.child.start(action, fleet_command(action, request, self.data_dir, self.survey))
        self._show_buttons()

    def stop(self) -> None:
        if self.child.running:
            self.state.setText("Stopping...")
            self.child.stop()

    def stop_and_wait(self) -> None:
        """Stop a command under way and wait for its end (the window's close, as the application ends)."""
        self.child.stop_and_wait()

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        """Closed while a command runs: it is stopped, and the dialog closes once it has ended (a deploy unwinds)."""
        if self.child.running:
            self._stop_then_close()
            event.ignore()
            return
        super().closeEvent(event)  # QDialog's calls reject(), which hides it

    def reject(self) -> None:  # Qt's name: Esc, which hid the dialog with no closeEvent and left the command running
        if self.child.running:
            self._stop_then_close()
            return
        super().reject()

    def _stop_then_close(self) -> None:
        self._close_when_ended = True
        self.stop()

    # What the command does

    def _append(self, text: str) -> None:
        end = QTextCursor(self.output.document())
        end.movePosition(QTextCursor.MoveOperation.End)
        end.insertText(text)
        bar = self.output.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _ended(self, said: str) -> None:
        self.state.setText(f"{said}: its words are above" if " failed " in said else said)
        self._show_buttons()
        if self.child.action == "deploy":
            self.deploy_ended.emit()
        if self._close_when_ended:
            self._close_when_ended = False
            self.close()

    def _browse(self) -> None:
        chosen = QFileDialog.getExistingDirectory(self, "The model's folder (made by `deskfleet export`)",
                                                  self.model.text())
        if chosen:
            self.model.setText(chosen)

    def _show_buttons(self) -> None:
        running = self.child.running
        self.plan_button.setEnabled(not running)
        self.deploy_button.setEnabled(not running)
        self.stop_button.setEnabled(running)

