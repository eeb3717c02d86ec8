"""What one look costs the fleet window to draw, at an office's size (docs/fleet.md, "The fleet window"): the window is
given the same listing of N PCs again and again, as its looks give it, and the time each redraw takes (Qt's events
processed) is printed as JSON. A PC stays selected, as an admin's would. Run from the repository root:

    QT_QPA_PLATFORM=offscreen .venv/bin/python docs/runs/fleet-window-redraw-cost.py 100,300 5
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtWidgets import QApplication

from deskfleet.agent.link import utc_now
from deskfleet.common.agent_state import AgentState
from deskfleet.common.wire import StageRef, StatusReport
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_listing import FleetListing
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import AgentView, SurveyOptions
from deskfleet.controller.fleet_window import FleetWindow, FleetWindowOptions


def office(size: int) -> FleetListing:
    """`size` PCs: most available, one in ten serving a stage, one in twenty off."""
    agents = []
    for index in range(size):
        state = None if index % 20 == 19 else AgentState.SERVING if index % 10 == 0 else AgentState.AVAILABLE
        stages = (StageRef("llama-70b@0123456789ab", index % 80, index % 80 + 1),) if state == AgentState.SERVING \
            else ()
        report = None if state is None else StatusReport(state, 9 << 30, 0.12, 81.0, True, 52.0, 0.03, stages, None)
        agents.append(AgentView(f"{index:052d}", f"pc-{index:04d}", f"10.0.{index // 250}.{index % 250}:7431",
                                ("registration",), report, None if report else "cannot reach: timed out"))
    return FleetListing(agents, taken_at=time.time())


def main() -> None:
    sizes, looks = [int(size) for size in sys.argv[1].split(",")], int(sys.argv[2])
    app = QApplication([])
    store = FleetStore(Path(tempfile.mkdtemp(prefix="deskfleet-redraw-")) / "controller")
    init_fleet(store, "office", ("127.0.0.1:7341",), utc_now())
    window = FleetWindow(store, FleetWindowOptions(SurveyOptions(discover_seconds=0), every_s=3600.0))
    window.stop()  # no survey of its own: only the listings given below
    window.show()
    report = []
    for size in sizes:
        listing = office(size)
        seconds = []
        for _ in range(looks):
            window.table.selectRow(size // 2)
            began = time.perf_counter()
            window._listed(listing)  # what the survey's thread hands the window
            app.processEvents()
            seconds.append(time.perf_counter() - began)
        report.append({"pcs": size, "looks": looks, "median_s": round(statistics.median(seconds), 3),
                       "max_s": round(max(seconds), 3)})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
