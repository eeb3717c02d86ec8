"""The fleet window's "Deploy a model" dialog: `deskfleet fleet plan` and `fleet deploy` from the window.

It runs the very commands an admin would type, as a child process of this install's Python (`python -P -m
deskfleet.controller fleet ...`), with the window's data dir and survey options, and shows what they print as they
print it: the plan, each file sent, the stages made ready, or the error that stopped them. Nothing of the deploy is
done here (its locks, checks and records stay the command's), so the window and the command line cannot differ.
Stop sends the command SIGTERM, which `fleet deploy` unwinds as on Ctrl-C (the PCs release the stages it gave them);
on Windows it ends it hard (QProcess's terminate() there asks a program's windows to close, and a console program has
none), and a PC keeps what it was given until the next deploy of the model or its agent's restart.
"""

from __future__ import annotations

import codecs
import sys
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QProcess, QProcessEnvironment, Signal
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
from deskfleet.controller.fleet_survey import SurveyOptions


@dataclass(frozen=True)
class DeployRequest:
    """What the dialog asks of the fleet: a model folder and how to place it."""

    model: Path
    policy: str = PlanPolicy.FEWEST_AGENTS.value
    precision: str = Precision.DEVICE_DEFAULT.value
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

    deploy_ended = Signal()  # whatever its exit status: the fleet may have changed either way

    def __init__(self, data_dir: Path, survey: SurveyOptions, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.data_dir = data_dir
        self.survey = survey
        self.process: QProcess | None = None
        self._action = ""
        self._stopping = False  # Stop was pressed
        self._close_when_ended = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character may come in two reads
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
        if self.process is not None:
            return
        request = self.request()
        if request is None:
            return
        process = QProcess(self)
        process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        environment = QProcessEnvironment.systemEnvironment()
        # UTF-8, whatever the console's code page (a Windows child writes to a pipe in the ANSI one), and each line as
        # it is printed: a pipe's standard output is block-buffered, and showed the plan after the notes that follow it
        environment.insert("PYTHONIOENCODING", "utf-8")
        environment.insert("PYTHONUNBUFFERED", "1")
        process.setProcessEnvironment(environment)
        process.readyReadStandardOutput.connect(self._read)
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._error)
        self.process, self._action = process, action
        self._decoder.reset()
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
            self._stop_then_close()
            event.ignore()
            return
        super().closeEvent(event)  # QDialog's calls reject(), which hides it

    def reject(self) -> None:  # Qt's name: Esc, which hid the dialog with no closeEvent and left the command running
        if self.process is not None:
            self._stop_then_close()
            return
        super().reject()

    def _stop_then_close(self) -> None:
        self._close_when_ended = True
        self.stop()

    # What the command does

    def _read(self) -> None:
        if self.process is not None:
            self.take_output(bytes(self.process.readAllStandardOutput().data()))

    def take_output(self, data: bytes, final: bool = False) -> None:
        """Show what the command printed, as UTF-8 (a character split over two reads is decoded whole)."""
        text = self._decoder.decode(data, final=final)
        if text:
            self._append(text)

    def _append(self, text: str) -> None:
        end = QTextCursor(self.output.document())
        end.movePosition(QTextCursor.MoveOperation.End)
        end.insertText(text)
        bar = self.output.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _finished(self, code: int, status: QProcess.ExitStatus) -> None:
        self._read()
        self.take_output(b"", final=True)
        self._ended(ending(self._action, code, status == QProcess.ExitStatus.CrashExit, self._stopping))
        if self._action == "deploy":
            self.deploy_ended.emit()

    def _error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:  # no finished() follows
            self._ended(f"Cannot start {sys.executable}: {self.process.errorString() if self.process else error}")

    def _ended(self, said: str) -> None:
        if self.process is not None:
            self.process.deleteLater()
        self.process = None
        self._stopping = False
        self.state.setText(said)
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


def ending(action: str, code: int, crashed: bool, stop_asked: bool) -> str:
    """How a command ended, in words: "Deploy done", "Plan failed (exit status 2): its words are above", "Deploy
    stopped" (asked, and it ended as a stopped command does), "Deploy ended by a signal" (not asked: killed by the OS
    for memory, or it crashed). `code`: its exit status, or where `crashed` the signal's number (Qt's)."""
    stopped_statuses = (130, 143, 137)  # Ctrl-C, SIGTERM and SIGKILL as the shell reports them (128 + the signal)
    if code == 0 and not crashed:
        said = f"{action} done"  # it had ended before Stop came, or finished all the same
    elif stop_asked and (crashed or code in stopped_statuses):  # Windows' kill() is a crash, to Qt
        said = f"{action} stopped"
    elif crashed:
        said = f"{action} ended by a signal ({code}): killed (by the OS, for memory?) or crashed"
    else:
        said = f"{action} failed (exit status {code}): its words are above"
    return said[0].upper() + said[1:]
