"""`deskfleet fleet window`: the fleet as its admin sees it on the controller PC, kept up to date, and the admin's
commands on it.

A thin view of controller/fleet_listing.py: every PC a survey finds (its state, CPU and iGPU load, temperature,
power, free memory, the stages it holds or why it did not answer), the selected PC in full, and the notes and
warnings `deskfleet fleet ls` prints. A survey runs on a thread of its own, so the window never waits on the
network, and the next one starts `every` seconds after the last ended (Refresh starts one now); looking changes
nothing. The buttons run the commands an admin would type (controller/fleet_child.py): `fleet plan` and `fleet deploy`
(controller/fleet_deploy_dialog.py), `fleet token` (controller/fleet_token_dialog.py) and `fleet remove`, once the
admin says yes.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QBrush, QCloseEvent, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from deskfleet.common import event_loop
from deskfleet.common.stop_signal import Stopped, StopSignal
from deskfleet.controller.fleet_child import FleetChild
from deskfleet.controller.fleet_deploy_dialog import DeployDialog
from deskfleet.controller.fleet_listing import (
    AgentCells,
    FleetListing,
    agent_cells,
    agent_json,
    list_fleet,
    state_counts,
)
from deskfleet.controller.fleet_store import FleetStore, FleetStoreError
from deskfleet.controller.fleet_survey import AgentView, SurveyOptions
from deskfleet.controller.fleet_token_dialog import TokenDialog
from deskfleet.controller.qt_window import in_thread, run_until_closed
from deskfleet.controller.text_table import terminal_safe

WINDOW_TITLE = "deskfleet fleet"
# the table's columns, in its order: what an admin looks at first (host, state, load) left, and last the stages (or
# why a PC did not answer), as wide as the window leaves; its id, addresses and sources are in the selected PC's pane
COLUMNS: tuple[str, ...] = ("host", "state", "cpu", "igpu", "temperature", "power", "free", "disk", "version",
                            "stages")
HEADINGS = {"temperature": "temp", "free": "free memory", "disk": "shard room"}
RIGHT_ALIGNED = frozenset({"cpu", "igpu", "temperature", "free", "disk"})
# a state's colour: at work, ready, kept out by its user or limits, not to be had
STATE_COLOURS = {"serving": "#2e7d32", "available": "#1565c0", "paused": "#6d6d6d", "unavailable": "#b26a00",
                 "outdated": "#c62828", "newer": "#c62828", "unreachable": "#c62828"}


@dataclass(frozen=True)
class FleetWindowOptions:
    survey: SurveyOptions
    every_s: float  # from the end of a survey to the start of the next


class _Bridge(QObject):
    """Carries a survey's end from its thread to the window's (Qt queues signals across threads)."""

    listed = Signal(object)  # a FleetListing
    failed = Signal(str)


class FleetWindow(QMainWindow):
    def __init__(self, store: FleetStore, options: FleetWindowOptions) -> None:
        super().__init__()
        self.store = store
        self.options = options
        self.listing: FleetListing | None = None
        self._surveying = False
        self._again = False  # look again as soon as the look under way ends (look_again)
        self._stop = StopSignal()  # set as the window closes: a survey under way is cut short
        self._bridge = _Bridge(self)  # deleted with the window: a survey that ends after it tells no one
        self._bridge.listed.connect(self._listed)
        self._bridge.failed.connect(self._failed)
        self._next = QTimer(self)
        self._next.setSingleShot(True)
        self._next.setInterval(round(options.every_s * 1000))
        self._next.timeout.connect(self.refresh)

        self.setWindowTitle(f"{WINDOW_TITLE}: {store.data_dir}")
        self.resize(1180, 640)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels([HEADINGS.get(column, column) for column in COLUMNS])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        # the stages: what the window leaves, cut where longer (its tooltip holds it whole)
        header.setSectionResizeMode(COLUMNS.index("stages"), QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._show_selected)
        self.details = QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setPlaceholderText("Select a PC to see all it reported")
        self.notes = QPlainTextEdit()
        self.notes.setReadOnly(True)
        self.notes.setPlaceholderText("Notes and warnings on the fleet show here")
        self.summary = QLabel("Looking for the fleet's PCs...")
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.deploy_button = QPushButton("Deploy a model...")
        self.deploy_button.clicked.connect(self.open_deploy)
        self.deploy_dialog: DeployDialog | None = None
        self.token_button = QPushButton("Join token...")
        self.token_button.clicked.connect(self.open_token)
        self.token_dialog: TokenDialog | None = None
        self.remove_button = QPushButton("Remove PC...")
        self.remove_button.clicked.connect(self.remove_selected)
        self.remover = FleetChild(merged=True, parent=self)
        self.remover.output.connect(self._removal_said)
        self.remover.ended.connect(self._removal_ended)
        self._removal_words = ""
        self.confirm: Callable[[str, str], bool] = self._ask  # a test answers for the admin
        below = QSplitter(Qt.Orientation.Horizontal)
        below.addWidget(self.details)
        below.addWidget(self.notes)
        whole = QSplitter(Qt.Orientation.Vertical)
        whole.addWidget(self.table)
        whole.addWidget(below)
        whole.setStretchFactor(0, 3)
        whole.setStretchFactor(1, 1)
        bar = QHBoxLayout()
        bar.addWidget(self.summary, 1)
        bar.addWidget(self.token_button)
        bar.addWidget(self.remove_button)
        bar.addWidget(self.deploy_button)
        bar.addWidget(self.refresh_button)
        layout = QVBoxLayout()
        layout.addWidget(whole, 1)
        layout.addLayout(bar)
        central = QWidget()
        central.setLayout(layout)
        self.setCentralWidget(central)
        self._show_buttons()
        self.refresh()

    # What the admin does

    def refresh(self) -> None:
        """Survey the fleet now (nothing where one is under way: its end shows)."""
        if self._surveying or self._stop.is_set():
            return
        self._surveying = True
        self._next.stop()
        self.refresh_button.setEnabled(False)
        self.refresh_button.setText("Looking...")
        store, options, stop = self.store, self.options.survey, self._stop

        def listed() -> FleetListing:
            return event_loop.run(list_fleet(store, options), stop)

        # a store's error is the whole story (a data dir damaged, not initialised); anything else is said with its
        # type, and ends the look all the same (a look that ended in silence left the window "Looking..." for good)
        in_thread(listed, self._bridge.listed.emit, self._bridge.failed.emit, said_alone=(FleetStoreError,),
                  silent=(Stopped,), name="deskfleet-fleet-survey")

    def look_again(self) -> None:
        """Look at the fleet now, or as soon as the look under way ends: that one may have begun before what it
        should show (a deploy's stages)."""
        if self._surveying:
            self._again = True
        else:
            self.refresh()

    def open_deploy(self) -> DeployDialog:
        """The deploy dialog (one: shown again where it is open), whose deploy's end makes the window look again."""
        if self.deploy_dialog is None:
            self.deploy_dialog = DeployDialog(self.store.data_dir, self.options.survey, self)
            self.deploy_dialog.deploy_ended.connect(self.look_again)
        self.deploy_dialog.show()
        self.deploy_dialog.raise_()
        return self.deploy_dialog

    def open_token(self) -> TokenDialog:
        """The join token dialog (one: shown again where it is open)."""
        if self.token_dialog is None:
            self.token_dialog = TokenDialog(self.store.data_dir, self)
        self.token_dialog.show()
        self.token_dialog.raise_()
        return self.token_dialog

    def remove_selected(self) -> None:
        """Remove the selected PC from the fleet (`fleet remove`), once the admin has said yes: its certificate is
        revoked for good."""
        agent = self.selected_agent()
        if agent is None or agent.agent_id is None or self.remover.running:
            return
        if not self.confirm("Remove a PC from the fleet", f"Remove {agent.hostname} ({agent.agent_id[:12]}) from "
                            "the fleet for good?\n\nIts certificate is revoked: every PC of the fleet refuses it "
                            "from now on, and the stages it holds stop being used. It can join again only as a new "
                            "agent, with a new key and a new join token."):
            return
        self._removal_words = ""
        self.statusBar().showMessage(f"Removing {agent.hostname}...")
        self.remover.start("removal", ["remove", agent.agent_id, "--data-dir", str(self.store.data_dir)])
        self._show_buttons()

    def selected_agent(self) -> AgentView | None:
        key, listing = self._selected_key(), self.listing
        if key is None or listing is None:
            return None
        return next((agent for agent in listing.agents if _key(agent) == key), None)

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        self.stop()
        super().closeEvent(event)

    def stop(self) -> None:
        """Cut a survey under way short and start no other; stop a plan, deploy or token under way and wait for its
        end; let a removal under way finish."""
        self._stop.set()
        self._next.stop()
        if self.deploy_dialog is not None:
            self.deploy_dialog.stop_and_wait()
        if self.token_dialog is not None:
            self.token_dialog.close()  # a token under way stopped, the one shown forgotten
        self.remover.finish()  # a removal the admin said yes to is let finish (it takes a moment)

    # What the survey's thread reports

    def _listed(self, listing: FleetListing) -> None:
        self.listing = listing
        self._show(listing)
        self._surveyed()

    def _failed(self, error: str) -> None:
        """A survey that could not run (a data dir not initialised, or damaged): said, the last table kept."""
        when = datetime.datetime.now().strftime("%H:%M:%S")
        self.summary.setText(f"At {when} the fleet could not be listed: {error}")
        self._surveyed()

    def _surveyed(self) -> None:
        self._surveying = False
        self.refresh_button.setEnabled(True)
        self.refresh_button.setText("Refresh")
        if self._again:
            self._again = False
            self.refresh()
        elif not self._stop.is_set():
            self._next.start()

    def _removal_said(self, text: str) -> None:
        self._removal_words += text

    def _removal_ended(self, said: str) -> None:
        words = " ".join(self._removal_words.split())  # "removed agent ...: it is refused from now on", or the error
        # in the status bar, which the next look leaves as it is (the summary line is the look's)
        self.statusBar().showMessage(words if said == "Removal done" else f"{said}: {words}" if words else said)
        if said == "Removal done":
            self.table.clearSelection()  # the PC is gone: nothing to remove again until the look shows what is left
        self._show_buttons()
        self.look_again()

    def _ask(self, title: str, question: str) -> bool:
        answer = QMessageBox.question(self, title, question, QMessageBox.StandardButton.Yes |
                                      QMessageBox.StandardButton.Cancel, QMessageBox.StandardButton.Cancel)
        return answer == QMessageBox.StandardButton.Yes

    # Drawing

    def _show_buttons(self) -> None:
        agent = self.selected_agent()
        self.remove_button.setEnabled(agent is not None and agent.agent_id is not None and not self.remover.running)

    def _show(self, listing: FleetListing) -> None:
        """The PCs, the one selected kept selected (by agent id, else address) while the rows are drawn again."""
        chosen = self._selected_key()
        self.table.blockSignals(True)
        # emptied, then filled: an item written over another in a column that fits its contents made Qt measure the
        # whole column again, each time (300 PCs: 30 s a look, longer than the time between looks)
        self.table.setRowCount(0)
        self.table.setRowCount(len(listing.agents))
        for row, agent in enumerate(listing.agents):
            cells = agent_cells(agent, listing.undeployed)
            for column, name in enumerate(COLUMNS):
                item = _cell(cells, name)
                if name == "host":
                    item.setData(Qt.ItemDataRole.UserRole, _key(agent))  # what keeps it selected (_selected_key)
                self.table.setItem(row, column, item)
        keys = [_key(agent) for agent in listing.agents]
        if chosen in keys:
            self.table.selectRow(keys.index(chosen))
        self.table.blockSignals(False)
        self._show_selected()
        when = datetime.datetime.fromtimestamp(listing.taken_at).strftime("%H:%M:%S")
        counts = state_counts(listing.agents, listing.undeployed) if listing.agents else \
            "no agents found (is `deskfleet fleet serve` running, and have agents joined?)"
        self.summary.setText(f"{counts}. Looked at {when}; again {self.options.every_s:g} s after each look ends.")
        self.notes.setPlainText("\n\n".join(terminal_safe(line) for line in
                                            listing.advice + listing.notes + listing.warnings))

    def _selected_key(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or self.listing is None:
            return None
        item = self.table.item(rows[0].row(), COLUMNS.index("host"))
        key = item.data(Qt.ItemDataRole.UserRole) if item is not None else None
        return key if isinstance(key, str) else None

    def _show_selected(self) -> None:
        """The selected PC, all its report holds (as `fleet ls --json` gives it)."""
        self._show_buttons()
        agent = self.selected_agent()
        if agent is None or self.listing is None:
            self.details.setPlainText("")
            return
        whole = agent_json(agent, self.listing.undeployed)
        self.details.setPlainText("\n".join(f"{name}: {terminal_safe(_value_text(value))}"
                                            for name, value in whole.items()))


def _key(agent: object) -> str:
    """What keeps a PC selected from one survey to the next: its agent id, else (a peer that did not answer) its
    address."""
    return str(getattr(agent, "agent_id", None) or getattr(agent, "address", ""))


def _cell(cells: AgentCells, name: str) -> QTableWidgetItem:
    # a PC's words (its hostname, a status detail) may hold a newline or a bidirectional override: shown as `fleet ls`
    # shows them, as '?', so that no PC can forge a line or reorder a cell
    text = terminal_safe(getattr(cells, name))
    item = QTableWidgetItem(text)
    item.setToolTip(text)  # a long stages cell, cut at the window's edge, reads whole on hover
    if name in RIGHT_ALIGNED:
        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
    if name == "state":
        colour = STATE_COLOURS.get(text)
        if colour is not None:
            item.setForeground(QBrush(QColor(colour)))
    return item


def _value_text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, dict)):
        return json.dumps(value) if value else "-"
    return str(value)


def run_fleet_window(store: FleetStore, options: FleetWindowOptions) -> int:
    """Show the window until it is closed, or a signal stops it (exit 0)."""
    run_until_closed(lambda: FleetWindow(store, options)).stop()
    return 0
