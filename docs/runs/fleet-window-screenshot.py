"""A screenshot of `deskfleet fleet window` for docs/images/ (README, "Seeing the fleet"): a fleet made for it in a
temporary folder, of five PCs on loopback. Four run a real agent (AgentCore on the real TLS link); as this machine has
no temperature sensor or battery, their sensors are set here, a desktop's and three laptops'. The demo target is then
deployed from the window's "Deploy a model" dialog (which runs `deskfleet fleet deploy`) with the all_by_speed policy,
and the PCs it places host its stages for real (the laptop on battery is kept out by its limits). The fifth PC is
enrolled and off. Both the dialog and the window are saved. Run from the repository root after `bash scripts/demo.sh`:

    xvfb-run -a -s "-screen 0 1280x800x24" .venv/bin/python docs/runs/fleet-window-screenshot.py docs/images
"""

from __future__ import annotations

import asyncio
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtWidgets import QApplication

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import TlsFiles, start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common import pki
from deskfleet.common.availability import MonitorReading, TemperatureReading
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import SurveyOptions
from deskfleet.controller.fleet_window import FleetWindow, FleetWindowOptions

GIB = 1 << 30
PCS = {  # hostname: its sensors
    "desk-ana": MonitorReading(0.04, 22 * GIB, 32 * GIB, None, None, (TemperatureReading("cpu", 46.0),), 0.0),
    "lap-ben": MonitorReading(0.07, 13 * GIB, 16 * GIB, 92.0, True, (TemperatureReading("cpu", 51.0),), 0.02),
    "lap-carla": MonitorReading(0.31, 9 * GIB, 16 * GIB, 64.0, True, (TemperatureReading("cpu", 58.0),), 0.12),
    "lap-dev": MonitorReading(0.02, 11 * GIB, 16 * GIB, 38.0, False, (TemperatureReading("cpu", 44.0),), None),
}


class Monitor:
    def __init__(self, reading: MonitorReading) -> None:
        self.reading = reading

    def read(self) -> MonitorReading:
        return self.reading


def member(ca: pki.FleetCa, folder: Path) -> TlsFiles:
    folder.mkdir(parents=True)
    files = TlsFiles.in_folder(folder, "agent")
    key = pki.create_private_key()
    files.ca_path.write_bytes(pki.certificate_pem(ca.certificate))
    files.cert_path.write_bytes(pki.certificate_pem(pki.sign_csr(ca, pki.create_csr(key, "agent"), utc_now())))
    pki.write_private_key(files.key_path, key)
    return files


def serve_agents(store: FleetStore, root: Path) -> None:
    """The four agents on a thread's event loop, for as long as the script runs; the roster says where each is."""
    cores = {name: AgentCore(member(load_ca(store), root / name), AgentSettings(thresholds=Thresholds()),
                             ShardCache(root / name / "cache", 4 * GIB), Monitor(reading))
             for name, reading in PCS.items()}
    off = member(load_ca(store), root / "lap-eli").own_identity().agent_id
    ready = threading.Event()

    async def serve() -> None:
        servers = [await start_server(core.serve_link, "127.0.0.1", 0, core.files) for core in cores.values()]
        roster = {core.agent_id: RosterEntry(core.agent_id, name, utc_now().isoformat(),
                                             (f"127.0.0.1:{server.sockets[0].getsockname()[1]}",))
                  for (name, core), server in zip(cores.items(), servers, strict=True)}
        with socket.socket() as unused:  # a port nobody listens on: the PC that is off
            unused.bind(("127.0.0.1", 0))
            roster[off] = RosterEntry(off, "lap-eli", utc_now().isoformat(), (f"127.0.0.1:{unused.getsockname()[1]}",))
        store.save_roster(roster)
        ready.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait(60)


def main() -> None:
    out = Path(sys.argv[1])
    root = Path(tempfile.mkdtemp(prefix="deskfleet-window-shot-"))
    store = FleetStore(root / "controller")
    init_fleet(store, "office", ("127.0.0.1:7341",), utc_now())
    serve_agents(store, root)
    app = QApplication([])
    window = FleetWindow(store, FleetWindowOptions(SurveyOptions(discover_seconds=0), every_s=15.0))
    window.resize(1240, 560)
    window.show()
    wait(app, lambda: window.listing is not None)
    dialog = window.open_deploy()  # the deploy, as the admin makes it from the window
    dialog.model.setText(str(Path("out/demo/target-int4").absolute()))
    dialog.policy.setCurrentText("all_by_speed")
    first = window.listing
    dialog.start("deploy")
    wait(app, lambda: not dialog.child.running and window.listing is not first)
    assert dialog.state.text() == "Deploy done", dialog.output.toPlainText()
    dialog.grab().save(str(out / "fleet-deploy-dialog.png"))
    dialog.close()
    window.table.selectRow(0)
    wait(app, lambda: False, 0.4)
    window.grab().save(str(out / "fleet-window.png"))
    window.stop()


def wait(app: QApplication, done: Callable[[], bool], seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)


if __name__ == "__main__":
    main()
