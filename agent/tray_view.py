"""What the tray shows, decided without Qt: the tray (agent/tray.py) reads the facts, this turns them into the
icon, the menu's lines and the pause toggle, and the tray draws them. Everything an employee reads is here.

The facts come from three places: the status the running agent published (agent/status_file.py), whether that
agent still runs, and the employee's own opt-out file (agent/opt_out.py), which the tray writes and reads itself,
so that a pause shows at once, before the agent has taken it in.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from enum import Enum

from deskfleet.agent.opt_out import OptOut
from deskfleet.agent.status import AgentStatus, PauseSource
from deskfleet.agent.status_file import STALE_AFTER_S, PublishedStatus
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import RELEASE_REASONS
from deskfleet.common.wire import StageRef

GB = 1 << 30  # as Windows' Task Manager and Explorer count a "GB": what the employee compares it with
TOOLTIP_CHARS = 120  # Windows cuts a tray icon's tooltip at 127 characters
ERROR_CHARS = 160  # of the agent's last error, in the menu
TOGGLE_TEXT = "Pause deskfleet on this PC"


class TrayIcon(str, Enum):
    """The icon's look, one per kind of state."""

    SERVING = "serving"  # hosting a part of a model for the fleet
    AVAILABLE = "available"  # ready, nothing hosted
    PAUSED = "paused"  # out of the fleet by someone's choice
    UNAVAILABLE = "unavailable"  # out of the fleet by its limits (battery, heat, memory, the user's own work)
    STOPPED = "stopped"  # no agent runs, or this PC has not joined a fleet
    PROBLEM = "problem"  # something the employee or the admin must look at


@dataclass(frozen=True)
class ToggleView:
    text: str
    checked: bool  # paused
    enabled: bool


@dataclass(frozen=True)
class TrayView:
    icon: TrayIcon
    headline: str  # the menu's first line, and the tooltip's
    lines: tuple[str, ...]  # the menu's other lines (not clickable)
    toggle: ToggleView

    @property
    def tooltip(self) -> str:
        text = f"deskfleet: {self.headline}"
        return text if len(text) <= TOOLTIP_CHARS else text[:TOOLTIP_CHARS - 3] + "..."


@dataclass(frozen=True)
class TrayFacts:
    """What the tray found at one look."""

    joined: bool  # the data dir holds a fleet membership
    removed_seen: str | None  # when the fleet refused this PC as removed (standing.removed_seen)
    opt_out: OptOut  # the employee's pause as the file says now
    published: PublishedStatus | None  # the agent's last status; None: none was ever written
    status_problem: str | None  # why the status file cannot be used (StatusFileError), else None
    running: bool  # the process that published the status still runs
    now: float  # wall seconds


def tray_view(facts: TrayFacts) -> TrayView:
    """The tray's look for `facts`."""
    toggle = ToggleView(TOGGLE_TEXT, facts.opt_out.paused, enabled=True)
    if not facts.joined:
        return TrayView(TrayIcon.STOPPED, "this PC has not joined a fleet",
                        ("Your IT admin joins it with a token (deskfleet-agent join).",),
                        ToggleView(TOGGLE_TEXT, facts.opt_out.paused, enabled=False))
    if facts.removed_seen is not None:
        return TrayView(TrayIcon.PROBLEM, "this PC was removed from its fleet",
                        (f"Its controller refused it ({facts.removed_seen}): it serves no model until your IT admin "
                         "joins it again.",), ToggleView(TOGGLE_TEXT, facts.opt_out.paused, enabled=False))
    kept = _pause_kept_line(facts.opt_out)
    if facts.status_problem is not None:
        return TrayView(TrayIcon.PROBLEM, "cannot read the agent's status", (facts.status_problem, *kept), toggle)
    published = facts.published
    if published is None or not facts.running:
        since = () if published is None else (f"Last seen {_clock(published.status.taken_at, facts.now)}.",)
        return TrayView(TrayIcon.STOPPED, "the deskfleet agent is not running", (*since, *kept), toggle)
    return _running_view(published, facts, toggle)


def _running_view(published: PublishedStatus, facts: TrayFacts, toggle: ToggleView) -> TrayView:
    status = published.status
    icon, headline, first = _state_of(published, facts.opt_out)
    if published.paused_by is PauseSource.SETTINGS:
        toggle = ToggleView("Paused by your IT admin", checked=True, enabled=False)
    lines = [*first, _controller_line(published.controller_connected), *_reading_lines(status)]
    if status.last_error:
        error = status.last_error
        lines.append("Last error: " + (error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS - 3] + "..."))
    if (age := facts.now - status.taken_at) > STALE_AFTER_S:
        lines.append(f"This is as of {_clock(status.taken_at, facts.now)}: the agent has not said more since "
                     f"({_duration(age)}).")
    return TrayView(icon, headline, tuple(lines), toggle)


def _state_of(published: PublishedStatus, opt_out: OptOut) -> tuple[TrayIcon, str, tuple[str, ...]]:
    """The icon, the headline and what comes first under it, for a running agent."""
    status = published.status
    by_user = published.paused_by in (PauseSource.USER, PauseSource.UNREADABLE_OPT_OUT)
    if opt_out.paused and published.paused_by is None:  # written a moment ago: the agent reads it within seconds
        giving_up = ("The part of a model this PC hosts is given up within seconds.",)
        return TrayIcon.PAUSED, "pausing...", giving_up if status.stages else ()
    if not opt_out.paused and by_user:
        return TrayIcon.PAUSED, "resuming...", ()
    if status.state is AgentState.PAUSED:
        if published.paused_by is PauseSource.SETTINGS:
            return TrayIcon.PAUSED, "paused by your IT admin", ("The agent's settings keep this PC out of the fleet.",)
        if published.paused_by is PauseSource.UNREADABLE_OPT_OUT:
            return TrayIcon.PROBLEM, "paused: its pause file cannot be read", (
                opt_out.problem or "Pause or resume here to write it anew.",)
        return TrayIcon.PAUSED, "paused by you: this PC serves no model", ()
    why = ", ".join(reason.describe() for reason in status.reasons) or "over its limits"
    numbers = f" ({status.detail})" if status.detail else ""
    if status.stages:  # serving, over its limits or not: the agent keeps its part while it can
        over = (_over_limits_line(published, why, numbers),) if status.state is AgentState.UNAVAILABLE else ()
        return TrayIcon.SERVING, "serving the fleet: " + _stages_text(status.stages), over
    if status.state is AgentState.UNAVAILABLE:
        return TrayIcon.UNAVAILABLE, f"not available to the fleet now: {why}", (numbers.strip(),) if numbers else ()
    return TrayIcon.AVAILABLE, "available to the fleet", ("No model is hosted here now.",)


def _over_limits_line(published: PublishedStatus, why: str, numbers: str) -> str:
    """What a serving PC over its limits does about it: on battery or too hot for `releases_after_s`, the agent
    gives its part up (common/availability.StageReleaseWatch); over the others (memory, the user's own work), or
    with no release set, it keeps it."""
    releases = published.releases_after_s
    if releases is not None and any(reason in RELEASE_REASONS for reason in published.status.reasons):
        return f"Now {why}{numbers}: this PC gives its part up if that lasts {_duration(releases)}."
    return f"Now {why}{numbers}: this PC keeps its part meanwhile."


def _stages_text(stages: tuple[StageRef, ...]) -> str:
    parts = [f"layers {stage.layer_start}-{stage.layer_end - 1} of model {stage.model_id[:12]}" for stage in stages]
    return "; ".join(parts) or "a part of a model"


def _controller_line(connected: bool) -> str:
    return "Fleet controller: connected" if connected else \
        "Fleet controller: not connected (the agent keeps trying)"


def _reading_lines(status: AgentStatus) -> list[str]:
    reading, cache = status.reading, status.cache
    lines = [f"Memory free: {reading.memory_free_bytes / GB:.1f} of {reading.memory_total_bytes / GB:.1f} GB",
             f"Processor: {reading.cpu_load * 100:.0f}% busy"]
    hottest = reading.max_temperature_c
    lines.append("Temperature: not exposed by this PC" if hottest is None else f"Temperature: {hottest:.0f} °C")
    power = {True: "plugged in", False: "on battery", None: "power source not exposed"}[reading.on_ac_power]
    lines.append(f"Battery: none or not exposed ({power})" if reading.battery_percent is None else
                 f"Battery: {reading.battery_percent:.0f}% ({power})")
    lines.append("Integrated GPU: activity not exposed" if reading.igpu_busy is None else
                 f"Integrated GPU: {reading.igpu_busy * 100:.0f}% busy")
    lines.append(f"Model cache: {cache.used_bytes / GB:.1f} of {cache.limit_bytes / GB:.1f} GB")
    return lines


def _pause_kept_line(opt_out: OptOut) -> tuple[str, ...]:
    if opt_out.problem is not None:
        return (opt_out.problem,)
    return ("Your pause is kept: the agent starts paused.",) if opt_out.paused else ()


def _clock(at: float, now: float) -> str:
    """A time of day, with the date when it is not today's."""
    moment, today = datetime.datetime.fromtimestamp(at), datetime.datetime.fromtimestamp(now)
    return moment.strftime("%H:%M:%S" if moment.date() == today.date() else "%Y-%m-%d %H:%M")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"
