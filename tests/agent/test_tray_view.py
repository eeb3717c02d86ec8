"""What the tray shows for each state of the agent and of the employee's pause (agent/tray_view.py, no Qt)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deskfleet.agent.opt_out import OptOut
from deskfleet.agent.shard_cache import CacheUsage
from deskfleet.agent.status import AgentStatus, PauseSource, make_status
from deskfleet.agent.status_file import PublishedStatus
from deskfleet.agent.tray_view import TOGGLE_TEXT, TOOLTIP_CHARS, TrayFacts, TrayIcon, tray_view
from deskfleet.common.availability import GIB, AvailabilityPolicy, MonitorReading, TemperatureReading
from deskfleet.common.wire import StageRef

NOW = 1_800_000_000.0
DESKTOP = MonitorReading(cpu_load=0.12, memory_free_bytes=9 * GIB, memory_total_bytes=16 * GIB, battery_percent=None,
                         on_ac_power=True, temperatures=(), igpu_busy=None)
LAPTOP = MonitorReading(cpu_load=0.3, memory_free_bytes=6 * GIB, memory_total_bytes=16 * GIB, battery_percent=41.0,
                        on_ac_power=False, igpu_busy=0.07,
                        temperatures=(TemperatureReading("cpu", 61.4), TemperatureReading("gpu", 55.0)))
CACHE = CacheUsage(used_bytes=1_200_000_000, limit_bytes=20_000_000_000, shard_count=12, partial_count=0,
                   pinned_bytes=0)
STAGE = StageRef("0123456789abcdef0123", 0, 4)
NOT_PAUSED = OptOut(False, "")
PAUSED = OptOut(True, "2026-12-07T10:00:00+00:00")


def status(reading: MonitorReading = DESKTOP, stages: tuple[StageRef, ...] = (), paused: bool = False,
           last_error: str | None = None, taken_at: float = NOW - 1) -> AgentStatus:
    return make_status(reading, AvailabilityPolicy(paused=paused), stages, CACHE, last_error, taken_at, "0.16.0")


def facts(agent: AgentStatus | None = None, opt_out: OptOut = NOT_PAUSED, paused_by: PauseSource | None = None,
          connected: bool = True, running: bool = True, releases_after_s: float | None = 30.0,
          **changes: object) -> TrayFacts:
    published = None if agent is None else PublishedStatus(agent, "a" * 52, 4242, NOW - 600, paused_by, connected,
                                                           releases_after_s)
    base = TrayFacts(joined=True, removed_seen=None, opt_out=opt_out, published=published, status_problem=None,
                     running=running, now=NOW)
    return replace(base, **changes)  # type: ignore[arg-type]


def test_an_idle_desktop_is_available_with_what_it_reads() -> None:
    view = tray_view(facts(status()))
    assert view.icon is TrayIcon.AVAILABLE and view.headline == "available to the fleet"
    assert view.lines == ("No model is hosted here now.", "Fleet controller: connected", "Memory free: 9.0 of 16.0 GB",
                          "Processor: 12% busy", "Temperature: not exposed by this PC",
                          "Battery: none or not exposed (plugged in)", "Integrated GPU: activity not exposed",
                          "Model cache: 1.1 of 18.6 GB")
    assert view.toggle.text == TOGGLE_TEXT and not view.toggle.checked and view.toggle.enabled
    assert view.tooltip == "deskfleet: available to the fleet"


def test_a_serving_laptop_names_its_layers_and_its_sensors() -> None:
    plugged_in = replace(LAPTOP, on_ac_power=True)
    view = tray_view(facts(status(plugged_in, stages=(STAGE,)), connected=False))
    assert view.icon is TrayIcon.SERVING
    assert view.headline == "serving the fleet: layers 0-3 of model 0123456789ab"
    assert view.lines[0] == "Fleet controller: not connected (the agent keeps trying)"
    assert {"Temperature: 61 °C", "Battery: 41% (plugged in)", "Integrated GPU: 7% busy"} <= set(view.lines)


def test_a_serving_laptop_unplugged_keeps_its_part_a_while_and_says_so() -> None:
    agent = status(LAPTOP, stages=(STAGE,))  # the agent gives the stage up after release_stages_after_s
    view = tray_view(facts(agent))
    assert view.icon is TrayIcon.SERVING and view.headline.startswith("serving the fleet: layers 0-3")
    assert view.lines[0] == f"Now on battery ({agent.detail}): this PC gives its part up if that lasts 30 s."
    never = tray_view(facts(agent, releases_after_s=None))  # the admin's release_stages_after_s: null
    assert never.lines[0] == f"Now on battery ({agent.detail}): this PC keeps its part meanwhile."


def test_a_serving_pc_short_of_memory_keeps_its_part() -> None:
    # only on battery and too hot give a stage up; the stage's own inference often takes a PC under the memory floor
    agent = status(replace(DESKTOP, memory_free_bytes=GIB), stages=(STAGE,))
    view = tray_view(facts(agent))
    assert view.icon is TrayIcon.SERVING
    assert view.lines[0] == f"Now low memory ({agent.detail}): this PC keeps its part meanwhile."


def test_an_unavailable_pc_says_which_limits_and_their_numbers() -> None:
    agent = status(LAPTOP)  # on battery, under the default 50% floor
    view = tray_view(facts(agent))
    assert view.icon is TrayIcon.UNAVAILABLE and view.headline == "not available to the fleet now: on battery"
    assert view.lines[0] == f"({agent.detail})" and "41" in agent.detail


def test_the_employees_pause_shows_at_once_then_as_the_agent_took_it() -> None:
    serving = status(stages=(STAGE,))
    written = tray_view(facts(serving, opt_out=PAUSED))  # the toggle wrote the file; the agent has not read it
    assert written.icon is TrayIcon.PAUSED and written.headline == "pausing..." and written.toggle.checked
    assert written.lines[0] == "The part of a model this PC hosts is given up within seconds."
    taken = tray_view(facts(status(paused=True), opt_out=PAUSED, paused_by=PauseSource.USER))
    assert taken.headline == "paused by you: this PC serves no model" and taken.toggle.checked
    assert taken.toggle.enabled
    resumed = tray_view(facts(status(paused=True), opt_out=NOT_PAUSED, paused_by=PauseSource.USER))
    assert resumed.headline == "resuming..." and not resumed.toggle.checked


def test_the_admins_pause_cannot_be_toggled_away() -> None:
    view = tray_view(facts(status(paused=True), paused_by=PauseSource.SETTINGS))
    assert view.icon is TrayIcon.PAUSED and view.headline == "paused by your IT admin"
    assert view.toggle.checked and not view.toggle.enabled and view.toggle.text == "Paused by your IT admin"
    both = tray_view(facts(status(paused=True), opt_out=PAUSED, paused_by=PauseSource.SETTINGS))
    assert both.headline == "paused by your IT admin"


def test_a_damaged_pause_file_is_a_problem_the_toggle_mends() -> None:
    damaged = OptOut(True, "", "/x/opt_out.json is not valid JSON: ...: taken as paused; `deskfleet-agent pause` "
                                "or `resume` writes it anew")
    view = tray_view(facts(status(paused=True), opt_out=damaged, paused_by=PauseSource.UNREADABLE_OPT_OUT))
    assert view.icon is TrayIcon.PROBLEM and view.headline == "paused: its pause file cannot be read"
    assert view.lines[0] == damaged.problem and view.toggle.enabled and view.toggle.checked


def test_no_agent_running_says_so_and_keeps_the_pause() -> None:
    never = tray_view(facts())
    assert never.icon is TrayIcon.STOPPED and never.headline == "the deskfleet agent is not running"
    assert never.lines == () and never.toggle.enabled
    stopped = tray_view(facts(status(taken_at=NOW - 3600), opt_out=PAUSED, running=False))
    assert stopped.headline == "the deskfleet agent is not running"
    assert stopped.lines[0].startswith("Last seen ") and stopped.lines[1] == \
        "Your pause is kept: the agent starts paused."


def test_not_joined_and_removed_pcs_offer_no_toggle() -> None:
    unjoined = tray_view(facts(joined=False))
    assert unjoined.headline == "this PC has not joined a fleet" and not unjoined.toggle.enabled
    removed = tray_view(facts(status(), removed_seen="2026-12-01"))
    assert removed.icon is TrayIcon.PROBLEM and removed.headline == "this PC was removed from its fleet"
    assert "2026-12-01" in removed.lines[0] and not removed.toggle.enabled


def test_a_damaged_status_file_is_named_and_the_toggle_still_works() -> None:
    view = tray_view(facts(status_problem="/x/status.json is damaged (lacks 'pid')"))
    assert view.icon is TrayIcon.PROBLEM and view.lines == ("/x/status.json is damaged (lacks 'pid')",)
    assert view.toggle.enabled


def test_an_old_status_from_a_running_agent_is_said_to_be_old() -> None:
    view = tray_view(facts(status(taken_at=NOW - 300)))
    assert view.lines[-1].startswith("This is as of ") and view.lines[-1].endswith("(5 min).")
    assert not any(line.startswith("This is as of") for line in tray_view(facts(status())).lines)


@pytest.mark.parametrize("length", [10, 400])
def test_long_errors_and_tooltips_are_cut(length: int) -> None:
    view = tray_view(facts(status(last_error="e" * length, stages=(STAGE,) * 9)))
    error = next(line for line in view.lines if line.startswith("Last error: "))
    assert len(error) <= len("Last error: ") + 160 and (error.endswith("...") == (length > 160))
    assert len(view.tooltip) <= TOOLTIP_CHARS and view.tooltip.endswith("...")
