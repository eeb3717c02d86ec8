"""`deskfleet-agent tray`: the agent's icon in the employee's system tray, and the pause toggle.

A thin view. The agent runs on its own (`deskfleet-agent --headless`, a user service) and publishes its status in
its state folder (agent/status_file.py); the tray, started with the employee's desktop session as the same user,
reads that file and the employee's opt-out file every REFRESH_MS, lets tray_view.py decide what to show, and draws
it. Its toggle writes the opt-out file (agent/opt_out.py), as `deskfleet-agent pause` and `resume` do: no rights
over the agent's process are needed, and quitting the tray leaves the agent running.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from PySide6.QtCore import QObject, QPointF, QRectF, Qt, QTimer
from PySide6.QtGui import QAction, QColor, QCursor, QIcon, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QApplication, QMenu, QSystemTrayIcon

from deskfleet.agent.opt_out import OptOut, read_opt_out, write_opt_out
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.standing import joined, removed_seen
from deskfleet.agent.status_file import StatusFileError, publisher_running, read_status_file
from deskfleet.agent.tray_view import TOGGLE_TEXT, ToggleView, TrayFacts, TrayIcon, TrayView, tray_view
from deskfleet.common.file_lock import pid_lock

REFRESH_MS = 2000  # how often the tray looks at the files (the agent looks at its status every 5 s)
TRAY_WAIT_S = 60.0  # how long a tray started with the session waits for the desktop's tray area to appear
TRAY_LOCK_FILE = "tray.lock"  # in the state folder: one tray per data dir
ICON_PIXELS = 64
COLOURS = {TrayIcon.SERVING: "#2e7d32", TrayIcon.AVAILABLE: "#1565c0", TrayIcon.PAUSED: "#ef8f00",
           TrayIcon.UNAVAILABLE: "#6d4c41", TrayIcon.STOPPED: "#757575", TrayIcon.PROBLEM: "#c62828"}


class TrayError(RuntimeError):
    """The tray cannot run here; the message says why and what works instead."""


def look(paths: AgentPaths, now: float | None = None) -> TrayFacts:
    """What the tray shows now, read from the agent's data dir (nothing is written)."""
    state = paths.state_dir
    member = joined(state)
    opt_out = read_opt_out(state) if state.is_dir() else OptOut(False, "")
    published, problem = None, None
    try:
        published = read_status_file(state) if member else None
    except StatusFileError as error:
        problem = str(error)
    now = time.time() if now is None else now
    return TrayFacts(joined=member, removed_seen=removed_seen(state) if member else None, opt_out=opt_out,
                     published=published, status_problem=problem,
                     running=published is not None and publisher_running(published, now), now=now)


def icon_for(kind: TrayIcon) -> QIcon:
    """The tray's icon for `kind`: a disc of the state's colour with a sign drawn on it (no font: a desktop may lack
    the one asked for)."""
    pixmap = QPixmap(ICON_PIXELS, ICON_PIXELS)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(QColor(COLOURS[kind]))
    painter.drawEllipse(QRectF(2, 2, ICON_PIXELS - 4, ICON_PIXELS - 4))
    painter.setBrush(QColor("white"))
    if kind in (TrayIcon.SERVING, TrayIcon.AVAILABLE):  # a model's layers, stacked; hollow when none is hosted
        if kind is TrayIcon.AVAILABLE:
            painter.setPen(QPen(QColor("white"), 3))
            painter.setBrush(Qt.BrushStyle.NoBrush)
        for top in (17, 28, 39):
            painter.drawRoundedRect(QRectF(16, top, 32, 8), 2, 2)
    elif kind is TrayIcon.PAUSED:
        painter.drawRect(QRectF(20, 17, 8, 30))
        painter.drawRect(QRectF(36, 17, 8, 30))
    elif kind is TrayIcon.UNAVAILABLE:
        painter.drawRect(QRectF(16, 28, 32, 8))
    elif kind is TrayIcon.STOPPED:
        painter.setPen(QPen(QColor("white"), 5))
        painter.drawLine(QPointF(22, 22), QPointF(42, 42))
        painter.drawLine(QPointF(42, 22), QPointF(22, 42))
    else:  # a problem: an exclamation mark
        painter.drawRoundedRect(QRectF(28, 13, 8, 26), 3, 3)
        painter.drawEllipse(QRectF(27.5, 43, 9, 9))
    painter.end()
    return QIcon(pixmap)


class AgentTray(QObject):
    """The icon, its menu and its timer for the agent whose folders are `paths`."""

    def __init__(self, paths: AgentPaths, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.paths = paths
        self.view: TrayView | None = None
        self.icons = {kind: icon_for(kind) for kind in TrayIcon}
        self.menu = QMenu()
        self.headline = self.menu.addAction("")
        self.headline.setEnabled(False)
        bold = self.headline.font()
        bold.setBold(True)
        self.headline.setFont(bold)
        self.lines: list[QAction] = []
        self._lines_end = self.menu.addSeparator()
        self.toggle = self.menu.addAction("")
        self.toggle.setCheckable(True)
        self.toggle.toggled.connect(self.set_paused)
        self.menu.addSeparator()
        self.quit = self.menu.addAction("Quit the tray (the agent keeps running)")
        self.quit.triggered.connect(QApplication.quit)
        self.icon = QSystemTrayIcon(self.icons[TrayIcon.STOPPED], self)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._activated)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)

    def start(self) -> None:
        self.refresh()
        self.icon.show()
        self.timer.start()

    def refresh(self) -> TrayView:
        """Look at the files again and show what they say (what went wrong looking, where that fails)."""
        try:
            view = tray_view(look(self.paths))
        except Exception as error:  # a slot that raised left the menu as it was, every 2 s, with no word of why
            try:  # the pause works whatever the status says
                toggle = ToggleView(TOGGLE_TEXT, read_opt_out(self.paths.state_dir).paused, enabled=True)
            except Exception:
                toggle = ToggleView(TOGGLE_TEXT, False, enabled=False)
            view = TrayView(TrayIcon.PROBLEM, "cannot show the agent's status", (f"{type(error).__name__}: {error}",),
                            toggle)
        self.show(view)
        return view

    def show(self, view: TrayView) -> None:
        self.view = view
        self.icon.setIcon(self.icons[view.icon])
        self.icon.setToolTip(view.tooltip)
        self.headline.setText(view.headline[:1].upper() + view.headline[1:])
        while len(self.lines) < len(view.lines):  # kept once made, hidden when not needed: no churn of actions
            action = QAction(self.menu)
            action.setEnabled(False)
            self.menu.insertAction(self._lines_end, action)
            self.lines.append(action)
        for index, action in enumerate(self.lines):
            shown = index < len(view.lines)
            if shown:
                action.setText(view.lines[index].replace("&", "&&"))  # a path with "&" is no keyboard accelerator
            action.setVisible(shown)
        with _quiet(self.toggle):  # showing the state is not the employee toggling it
            self.toggle.setText(view.toggle.text)
            self.toggle.setChecked(view.toggle.checked)
            self.toggle.setEnabled(view.toggle.enabled)

    def set_paused(self, paused: bool) -> None:
        """The employee's toggle: write the opt-out file for the agent, then show what it means."""
        try:
            self.paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_opt_out(self.paths.state_dir, paused, datetime.datetime.now(datetime.UTC).isoformat())
        except OSError as error:
            self.icon.showMessage("deskfleet", f"Could not {'pause' if paused else 'resume'} this PC: "
                                  f"{error.strerror or error} ({self.paths.state_dir})",
                                  QSystemTrayIcon.MessageIcon.Warning)
        self.refresh()

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        """A click on the icon (not the menu's right click) shows the menu too: Windows opens it on right click
        only."""
        if reason is QSystemTrayIcon.ActivationReason.Trigger:
            self.refresh()
            area = self.icon.geometry()  # empty on a D-Bus tray (KDE, GNOME's AppIndicator, Wayland): the pointer's
            self.menu.popup(area.center() if area.isValid() else QCursor.pos())


def run_tray(data_dir: Path | None) -> int:
    """`deskfleet-agent tray`: show the icon until the employee quits it, or a signal stops it (exit 0)."""
    paths = AgentPaths.resolve(data_dir)
    if data_dir is not None and not paths.state_dir.is_dir():  # a mistyped folder would show "not joined" for good
        raise TrayError(f"{paths.state_dir} does not exist: give --data-dir the agent's data dir, as given to `join` "
                        "and `--headless`")
    app = QApplication.instance() or QApplication(sys.argv[:1])
    assert isinstance(app, QApplication)
    app.setQuitOnLastWindowClosed(False)  # the menu is the only window: closing it must not end the tray
    app.setApplicationName("deskfleet")
    waited = 0.0
    while not QSystemTrayIcon.isSystemTrayAvailable():  # started with the session, before the desktop's panel
        if waited >= TRAY_WAIT_S:
            raise TrayError(f"this desktop shows no system tray (waited {TRAY_WAIT_S:.0f} s; GNOME needs the "
                            "AppIndicator extension): `deskfleet-agent pause` and `resume` work from a terminal")
        time.sleep(1.0)
        waited += 1.0
    with _tray_lock(paths):
        tray = AgentTray(paths)
        tray.start()
        for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if signum is not None:
                signal.signal(signum, lambda *_: QApplication.quit())  # run at the timer's next wake (Python's)
        app.exec()
    return 0


@contextlib.contextmanager
def _tray_lock(paths: AgentPaths) -> Iterator[None]:
    """One tray per data dir (two icons for one PC's agent); none for a PC not joined yet, whose state folder the
    join makes."""
    if not paths.state_dir.is_dir():
        yield
        return

    def refusal(pid: str, holder: str) -> TrayError:
        return TrayError(f"a tray already shows this PC's agent (pid {pid}, data dir {paths.state_dir.parent})")

    with pid_lock(paths.state_dir / TRAY_LOCK_FILE, refusal, "tray"):
        yield


@contextlib.contextmanager
def _quiet(action: QAction) -> Iterator[None]:
    blocked = action.blockSignals(True)
    try:
        yield
    finally:
        action.blockSignals(blocked)
