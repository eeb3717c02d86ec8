"""The fleet window's "Deploy a model" dialog: `deskfleet fleet plan` and `fleet deploy` from the window.

It runs the very commands an admin would type, as a child process of this install's Python (`python -P -m
deskfleet.controller fleet ...`), with the window's data dir and survey options, and shows what they print as they
print it: the plan, each file sent, the stages made ready, or the error that stopped them. Nothing of the deploy is
done here (its locks, checks and records stay the command's), so the window and the command line cannot differ.
Stop sends the command SIGTERM, which a deploy unwinds as on Ctrl-C; on Windows it ends it hard (QProcess's
terminate() there asks a program's windows to close, and a console program has none).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QProcess, Signal
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
from deskfleet.controller.fleet_survey import SurveyOptions

PRECISIONS = ("device_default", "f16", "f32")  # `fleet deploy --precision`'s choices


@dataclass(frozen=True)
class DeployRequest:
    """What the dialog asks of the fleet: a model folder and how to place it."""

    model: Path
    policy: str = PlanPolicy.FEWEST_AGENTS.value
    precision: str = "device_default"
    device: str = "CPU"


def fleet_command(action: str, request: DeployRequest, data_dir: Path, survey: SurveyOptions) -> list[str]:
    """The arguments of `deskfleet fleet plan|deploy` for `request` (after the Python that runs them): this data dir,
    and the window's own --peer and --discover-seconds, so that the command looks for the PCs the window shows."""
    if action not in ("plan", "deploy"):
        raise ValueError(f"no fleet command {action!r}: plan or deploy")
    arguments = ["-P", "-m", "deskfleet.controller", "fleet", action, "--model", str(request.model),
                 "--policy", request.policy, "--precision", request.precision, "--device", request.device,
                 "--data-dir", str(data_dir), "--discover-seconds", f"{survey.discover_seconds:g}"]
    for peer in survey.peers:
        arguments += ["--peer", peer]
    return arguments


class DeployDialog(QDialog):
    """Choose a model folder and how to place it; Plan shows the split, Deploy pushes it; what the command prints
    shows below as it comes."""

    deployed = Signal()  # a deploy ended (whatever its exit status: the fleet may have changed either way)

    def __init__(self, data_dir: Path, survey: SurveyOptions, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.data_dir = data_dir
        self.survey = survey
        self.process: QProcess | None = None
        self._action = ""
        self._stopping = False  # Stop was pressed: the command's end is "stopped", whatever its exit status
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
        self.precision.addItems(PRECISIONS)
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
        if self.process is not None:
            return
        request = self.request()
        if request is None:
            return
        process = QProcess(self)
        process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        process.readyReadStandardOutput.connect(self._read)
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._error)
        self.process, self._action = process, action
        self.output.clear()
        self.state.setText("Planning..." if action == "plan" else "Deploying...")
        process.start(sys.executable, fleet_command(action, request, self.data_dir, self.survey))
        self._show_buttons()

    def stop(self) -> None:
        if self.process is not None:
            self._stopping = True
            self.state.setText("Stopping...")
            if sys.platform == "win32":  # terminate() there only asks a program's windows to close: a console
                self.process.kill()      # program has none, and would run on
            else:
                self.process.terminate()  # SIGTERM: a deploy unwinds, telling the PCs it had begun with

    def stop_and_wait(self, timeout_ms: int = 30_000) -> None:
        """Stop a command under way and wait for it to end (the window's close, as the application ends): a deploy
        unwinds, telling the PCs it had begun with. One that does not end within `timeout_ms` is killed."""
        process = self.process
        if process is None:
            return
        self.stop()
        if not process.waitForFinished(timeout_ms):
            process.kill()
            process.waitForFinished(5_000)

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        """Closed while a command runs: it is stopped, and the dialog closes once it has ended (a deploy unwinds)."""
        if self.process is not None:
            self._close_when_ended = True
            self.stop()
            event.ignore()
            return
        super().closeEvent(event)

    # What the command does

    def _read(self) -> None:
        if self.process is None:
            return
        text = bytes(self.process.readAllStandardOutput().data()).decode("utf-8", "replace")
        end = QTextCursor(self.output.document())
        end.movePosition(QTextCursor.MoveOperation.End)
        end.insertText(text)
        bar = self.output.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _finished(self, code: int, status: QProcess.ExitStatus) -> None:
        self._read()
        action = self._action
        if self._stopping or status == QProcess.ExitStatus.CrashExit:
            said = f"{action} stopped" + ("" if self._stopping else f" (it crashed; exit status {code})")
        else:
            said = f"{action} done" if code == 0 else f"{action} failed (exit status {code}): its words are above"
        self._ended(said)
        if action == "deploy":
            self.deployed.emit()

    def _error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:  # no finished() follows
            self._ended(f"cannot start {sys.executable}: {self.process.errorString() if self.process else error}")

    def _ended(self, said: str) -> None:
        if self.process is not None:
            self.process.deleteLater()
        self.process = None
        self._stopping = False
        self.state.setText(said[0].upper() + said[1:])
        self._show_buttons()
        if self._close_when_ended:
            self._close_when_ended = False
            self.close()

    def _browse(self) -> None:
        chosen = QFileDialog.getExistingDirectory(self, "The model's folder (made by `deskfleet export`)",
                                                  self.model.text())
        if chosen:
            self.model.setText(chosen)

    def _show_buttons(self) -> None:
        running = self.process is not None
        self.plan_button.setEnabled(not running)
        self.deploy_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
