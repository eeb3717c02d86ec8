"""Screenshots of the tray for docs/images/ (docs/fleet.md, "The tray"): its icons, and its menu serving and paused.

Run under Xvfb from the repository's root (Debian: xvfb, libxcb-cursor0, libxcb-icccm4):
    xvfb-run -a -s "-screen 0 800x600x24" .venv/bin/python docs/runs/tray-screenshots.py docs/images
The menu is opened where a click would open it; the status is one an agent would publish (made here, no agent runs).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QPoint, QTimer
from PySide6.QtGui import QColor, QPainter, QPixmap
from PySide6.QtWidgets import QApplication

from deskfleet.agent.opt_out import write_opt_out
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.shard_cache import CacheUsage
from deskfleet.agent.standing import MEMBERSHIP_FILE
from deskfleet.agent.status import PauseSource, make_status
from deskfleet.agent.status_file import PublishedStatus, this_process_started_at, write_status_file
from deskfleet.agent.tray import AgentTray, icon_for
from deskfleet.agent.tray_view import TrayIcon
from deskfleet.common.availability import GIB, AvailabilityPolicy, MonitorReading, TemperatureReading
from deskfleet.common.wire import StageRef

LAPTOP = MonitorReading(0.23, 7 * GIB, 16 * GIB, 64.0, False, (TemperatureReading("cpu", 58.0),), 0.04)
CACHE = CacheUsage(2 << 30, 20 << 30, 9, 0, 0)


def menu_shot(app: QApplication, out: Path, paused: bool) -> None:
    paths = AgentPaths.resolve(Path(tempfile.mkdtemp()) / "agent")
    paths.create()
    (paths.state_dir / MEMBERSHIP_FILE).write_text("{}")
    if paused:
        write_opt_out(paths.state_dir, True, "2026-12-07T09:00:00+00:00")
    stages = () if paused else (StageRef("2f9c1a0b7d4e55aa", 4, 8),)
    status = make_status(LAPTOP, AvailabilityPolicy(paused=paused), stages, CACHE, None, time.time())
    write_status_file(paths.state_dir, PublishedStatus(status, "a" * 52, os.getpid(), this_process_started_at(),
                                                       PauseSource.USER if paused else None, True))
    tray = AgentTray(paths)
    tray.refresh()
    tray.menu.popup(QPoint(10, 10))
    name = "tray-menu-paused.png" if paused else "tray-menu-serving.png"
    QTimer.singleShot(800, lambda: (app.primaryScreen().grabWindow(0).copy(0, 0, 700, 270).save(str(out / name)),
                                    tray.menu.close(), app.quit()))
    app.exec()


def main() -> None:
    out = Path(sys.argv[1])
    app = QApplication([])
    strip = QPixmap(len(TrayIcon) * 72, 72)
    strip.fill(QColor("white"))
    painter = QPainter(strip)
    for index, kind in enumerate(TrayIcon):
        painter.drawPixmap(index * 72 + 4, 4, icon_for(kind).pixmap(64, 64))
    painter.end()
    strip.save(str(out / "tray-icons.png"))
    menu_shot(app, out, paused=False)
    menu_shot(app, out, paused=True)


if __name__ == "__main__":
    main()
