"""A `deskfleet fleet ...` command that a window runs as the admin would type it: a child process of this install's
own Python (`python -P -m deskfleet.controller fleet ...`, never a `deskfleet` found on the PATH, nor a folder of the
same name in the working directory), whose output comes back decoded as it is printed, and which Stop ends as Ctrl-C
would. The command keeps its own locks, checks and records: the window and the command line cannot differ.
"""

from __future__ import annotations

import codecs
import sys

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal

STOPPED_STATUSES = (130, 143, 137)  # Ctrl-C, SIGTERM and SIGKILL as the shell reports them (128 + the signal)


def child_arguments(fleet_arguments: list[str]) -> list[str]:
    """The arguments, after the Python that runs them, of `deskfleet fleet FLEET_ARGUMENTS...`."""
    return ["-P", "-m", "deskfleet.controller", "fleet", *fleet_arguments]


def ending(action: str, code: int, crashed: bool, stop_asked: bool) -> str:
    """How a command ended, in words: "Deploy done", "Plan failed (exit status 2)" (what it printed says why), "Deploy
    stopped" (asked, and it ended as a stopped command does), "Deploy ended by a signal" (not asked: killed by the OS
    for memory, or it crashed). `code`: its exit status, or where `crashed` the signal's number (Qt's)."""
    if code == 0 and not crashed:
        said = f"{action} done"  # it had ended before Stop came, or finished all the same
    elif stop_asked and (crashed or code in STOPPED_STATUSES):  # Windows' kill() is a crash, to Qt
        said = f"{action} stopped"
    elif crashed:
        said = f"{action} ended by a signal ({code}): killed (by the OS, for memory?) or crashed"
    else:
        said = f"{action} failed (exit status {code})"
    return said[0].upper() + said[1:]


class FleetChild(QObject):
    """One command at a time. `output` carries what it prints (standard error too, in order, where `merged`; else
    `errors` carries that), `ended` how it ended in words (`ending`) once all it printed has been given."""

    output = Signal(str)
    errors = Signal(str)
    ended = Signal(str)

    def __init__(self, merged: bool = True, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.merged = merged
        self.process: QProcess | None = None
        self.action = ""
        self._stop_asked = False
        self._decoders = {channel: codecs.getincrementaldecoder("utf-8")("replace") for channel in ("out", "err")}

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, action: str, fleet_arguments: list[str]) -> bool:
        """Run `deskfleet fleet FLEET_ARGUMENTS...`, `action` naming it in the words of its end; False (and nothing
        run) where a command runs already."""
        if self.process is not None:
            return False
        process = QProcess(self)
        if self.merged:
            process.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        environment = QProcessEnvironment.systemEnvironment()
        # UTF-8, whatever the console's code page (a Windows child writes to a pipe in the ANSI one), and each line as
        # it is printed: a pipe's standard output is block-buffered, and showed the plan after the notes that follow it
        environment.insert("PYTHONIOENCODING", "utf-8")
        environment.insert("PYTHONUNBUFFERED", "1")
        process.setProcessEnvironment(environment)
        process.readyReadStandardOutput.connect(self._read)
        if not self.merged:
            process.readyReadStandardError.connect(self._read)
        process.finished.connect(self._finished)
        process.errorOccurred.connect(self._error)
        self.process, self.action, self._stop_asked = process, action, False
        for decoder in self._decoders.values():
            decoder.reset()
        process.start(sys.executable, child_arguments(fleet_arguments))
        return True

    def stop(self) -> None:
        """Ask the command to stop: SIGTERM, which a `fleet` command unwinds as Ctrl-C; on Windows it is ended hard
        (QProcess's terminate() there asks a program's windows to close, and a console program has none)."""
        if self.process is None:
            return
        self._stop_asked = True
        if sys.platform == "win32":
            self.process.kill()
        else:
            self.process.terminate()

    def stop_and_wait(self, timeout_ms: int = 30_000) -> None:
        """Stop the command and wait for its end (a deploy unwinds, telling the PCs it had begun with); one that does
        not end within `timeout_ms` is killed."""
        process = self.process
        if process is None:
            return
        self.stop()
        if not process.waitForFinished(timeout_ms):
            process.kill()
            process.waitForFinished(5_000)

    def finish(self, timeout_ms: int = 30_000) -> None:
        """Wait for the command to end by itself (one that must not be cut short: a removal); one that has not ended
        within `timeout_ms` is stopped, then killed."""
        process = self.process
        if process is not None and not process.waitForFinished(timeout_ms):
            self.stop_and_wait(5_000)

    def take(self, data: bytes, channel: str = "out", final: bool = False) -> None:
        """Give what the command printed on `channel` ("out", "err"), decoded as UTF-8: a character split over two
        reads is decoded whole."""
        text = self._decoders[channel].decode(data, final=final)
        if text:
            (self.output if channel == "out" or self.merged else self.errors).emit(text)

    # What the process does

    def _read(self) -> None:
        if self.process is not None:
            self.take(bytes(self.process.readAllStandardOutput().data()), "out")
            if not self.merged:  # merged, standard error comes with the output (Qt warns of reading it apart)
                self.take(bytes(self.process.readAllStandardError().data()), "err")

    def _finished(self, code: int, status: QProcess.ExitStatus) -> None:
        self._read()
        for channel in self._decoders:
            self.take(b"", channel, final=True)
        self._end(ending(self.action, code, status == QProcess.ExitStatus.CrashExit, self._stop_asked))

    def _error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:  # no finished() follows
            why = self.process.errorString() if self.process is not None else str(error)
            self._end(f"Cannot start {sys.executable}: {why}")

    def _end(self, said: str) -> None:
        if self.process is not None:
            self.process.deleteLater()
        self.process = None
        self.ended.emit(said)
