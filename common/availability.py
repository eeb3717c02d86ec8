"""Whether an agent may take work: one monitor reading + the employee's policy -> a state and reasons.

Pure code (no psutil, no clock): the agent's monitor produces `MonitorReading`s, `decide_availability`
turns one into an `Availability`, and the status snapshot, discovery TXT record and planner carry the
result. A sensor the OS does not expose is None (unknown); an unknown sensor never makes an agent
unavailable, because we only act on evidence. Reasons are listed in a fixed order so two identical
readings always give identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

from deskfleet.common.agent_state import AgentState, UnavailableReason

GIB = 1 << 30
PLAUSIBLE_CELSIUS = (-50.0, 200.0)  # what a working sensor reads; broken ones read -128 or 255
MAX_RELEASE_AFTER_S = 3600.0
# The limits that protect the PC itself: crossed for long enough while serving, the agent gives its stages up
# (StageReleaseWatch). Low memory and a busy CPU are left to the planner: a stage's own memory and its own
# inference would cross them, and giving the stage up would only bring it back at the next plan.
RELEASE_REASONS = (UnavailableReason.ON_BATTERY, UnavailableReason.TOO_HOT)
CLEAR_ENDS_SPELL_S = 10.0  # that long within the limits ends a spell of crossing them (StageReleaseWatch)
CALL_IN_MIN_INTERVAL_S = 60.0  # an agent tells the controller it is available again at most this often
CALL_IN_SETTLE_S = 20.0  # and only once it has been available this long (CallInWatch)


@dataclass(frozen=True)
class TemperatureReading:
    """One temperature sensor: `label` names it as the OS does ("coretemp/Package id 0")."""

    label: str
    celsius: float


@dataclass(frozen=True)
class MonitorReading:
    """What the host looks like now. None / empty means the OS does not tell us (unknown, not zero)."""

    cpu_load: float  # fraction of all cores busy, [0, 1]
    memory_free_bytes: int  # available to new allocations without swapping
    memory_total_bytes: int
    battery_percent: float | None  # None: no battery, or not exposed
    on_ac_power: bool | None  # None: unknown (a desktop without a battery reads None)
    temperatures: tuple[TemperatureReading, ...]  # empty: no sensor exposed
    igpu_busy: float | None  # fraction of the integrated GPU's busiest engine, [0, 1]

    @property
    def max_temperature_c(self) -> float | None:
        """The hottest sensor, or None when no sensor is exposed."""
        return max((sensor.celsius for sensor in self.temperatures), default=None)


@dataclass(frozen=True)
class AvailabilityPolicy:
    """The employee's limits. Each threshold set to None is not checked; one out of range (NaN included)
    is a ValueError, so a typo never switches a limit off."""

    require_ac_power: bool = True  # unplugged -> unavailable, whatever the charge
    min_battery_percent: float | None = 50.0  # on battery below this -> unavailable
    max_temperature_c: float | None = 90.0  # hottest sensor above this -> unavailable
    min_free_memory_bytes: int | None = 2 * GIB  # less free memory than this -> unavailable
    max_cpu_load: float | None = None  # the employee's own work above this -> unavailable (user busy)
    # the iGPU's busiest engine above this -> unavailable (user busy: a game, a render, a video call's effects);
    # it counts a stage of this PC that runs on the GPU too, so it suits PCs whose stages run on the CPU or NPU
    max_igpu_busy: float | None = None
    # on battery or too hot this long while serving -> the agent gives its stages up; None: it keeps them
    release_stages_after_s: float | None = 30.0
    paused: bool = False  # out of the fleet: the admin's settings, or its user's `deskfleet-agent pause`

    def __post_init__(self) -> None:
        if self.min_battery_percent is not None and not 0.0 <= self.min_battery_percent <= 100.0:
            raise ValueError(f"min_battery_percent must be within [0, 100], got {self.min_battery_percent}")
        low_c, high_c = PLAUSIBLE_CELSIUS
        if self.max_temperature_c is not None and not low_c <= self.max_temperature_c <= high_c:
            raise ValueError(f"max_temperature_c must be within [{low_c:g}, {high_c:g}], got {self.max_temperature_c}")
        if self.max_cpu_load is not None and not 0.0 < self.max_cpu_load <= 1.0:
            raise ValueError(f"max_cpu_load must be within (0, 1], got {self.max_cpu_load}")
        if self.max_igpu_busy is not None and not 0.0 < self.max_igpu_busy <= 1.0:
            raise ValueError(f"max_igpu_busy must be within (0, 1], got {self.max_igpu_busy}")
        if self.min_free_memory_bytes is not None and self.min_free_memory_bytes < 0:
            raise ValueError(f"min_free_memory_bytes must be >= 0, got {self.min_free_memory_bytes}")
        release = self.release_stages_after_s
        if release is not None and not 0.0 <= release <= MAX_RELEASE_AFTER_S:
            raise ValueError(f"release_stages_after_s must be within [0, {MAX_RELEASE_AFTER_S:g}] seconds, "
                             f"got {release}")


@dataclass(frozen=True)
class Availability:
    """The decision: `state`, every reason that applies (even when paused), and the numbers behind them."""

    state: AgentState
    reasons: tuple[UnavailableReason, ...]
    detail: str  # for humans, each crossed limit's numbers and setting: "CPU 97 °C (max_temperature_c 90)"; "": none

    @property
    def reason(self) -> UnavailableReason | None:
        """The first reason, or None (what the planner's AgentCandidate.reason takes)."""
        return self.reasons[0] if self.reasons else None


# Public functions

def decide_availability(reading: MonitorReading, policy: AvailabilityPolicy, serving: bool) -> Availability:
    """Decide the agent's state from one reading.

    Precedence: PAUSED (the employee said so) > UNAVAILABLE (a limit is crossed) > SERVING (`serving`:
    the agent hosts stages now) > AVAILABLE. A SERVING agent that crosses a limit becomes UNAVAILABLE;
    the controller must then drain or re-plan its stages.
    """
    found: list[tuple[UnavailableReason, str]] = []
    power = _power_problem(reading, policy)
    if power:
        found.append((UnavailableReason.ON_BATTERY, power))
    hottest = reading.max_temperature_c
    if policy.max_temperature_c is not None and hottest is not None and hottest > policy.max_temperature_c:
        found.append((UnavailableReason.TOO_HOT,
                      f"{_hottest_label(reading)} {hottest:.0f} °C (max_temperature_c {policy.max_temperature_c:g})"))
    if (policy.min_free_memory_bytes is not None
            and reading.memory_free_bytes < policy.min_free_memory_bytes):
        found.append((UnavailableReason.LOW_MEMORY,
                      f"{reading.memory_free_bytes / GIB:.1f} GiB free of {reading.memory_total_bytes / GIB:.1f} "
                      f"(min_free_memory_bytes {policy.min_free_memory_bytes / GIB:.1f} GiB)"))
    busy = []  # one USER_BUSY reason, however many of the employee's processors are busy
    if policy.max_cpu_load is not None and reading.cpu_load > policy.max_cpu_load:
        busy.append(f"CPU {reading.cpu_load:.0%} busy (max_cpu_load {policy.max_cpu_load:.0%})")
    if (policy.max_igpu_busy is not None and reading.igpu_busy is not None
            and reading.igpu_busy > policy.max_igpu_busy):
        busy.append(f"iGPU {reading.igpu_busy:.0%} busy (max_igpu_busy {policy.max_igpu_busy:.0%})")
    if busy:
        found.append((UnavailableReason.USER_BUSY, ", ".join(busy)))
    reasons = tuple(reason for reason, _ in found)
    detail = "; ".join(text for _, text in found)
    if policy.paused:
        return Availability(AgentState.PAUSED, reasons, detail)
    if reasons:
        return Availability(AgentState.UNAVAILABLE, reasons, detail)
    return Availability(AgentState.SERVING if serving else AgentState.AVAILABLE, (), "")


class StageReleaseWatch:
    """When a serving agent gives its stages up: one of RELEASE_REASONS (on battery, too hot) crossed for a
    spell of `release_stages_after_s`. A moment unplugged or a short spike of heat does not; the clock starts
    again once the readings have been clear for CLEAR_ENDS_SPELL_S. Pure: the caller passes each reading's
    decision and the time."""

    def __init__(self) -> None:
        self._since: float | None = None  # when the limit was first seen crossed, in this spell
        self._clear_since: float | None = None  # the first clear reading since the last crossed one

    def reset(self) -> None:
        """Forget a spell under way (the agent holds nothing to give up)."""
        self._since = self._clear_since = None

    def update(self, availability: Availability, policy: AvailabilityPolicy, serving: bool, now: float) -> str | None:
        """The reason to release the stages now (the numbers and for how long), else None.

        A spell ends once the limit has been clear for CLEAR_ENDS_SPELL_S: a single clear reading among hot
        ones (a sensor that dips below the limit one check in seven) kept restarting the clock, and such a PC
        never gave its stages up."""
        crossed = serving and policy.release_stages_after_s is not None and any(
            reason in RELEASE_REASONS for reason in availability.reasons)
        if not crossed:
            if self._clear_since is None:
                self._clear_since = now
            if now - self._clear_since >= CLEAR_ENDS_SPELL_S or not serving:
                self._since = None
            return None
        if self._clear_since is not None and now - self._clear_since >= CLEAR_ENDS_SPELL_S:
            self._since = None  # clear long enough since the last crossed reading (readings came sparsely)
        self._clear_since = None
        if self._since is None:
            self._since = now
        held = now - self._since
        assert policy.release_stages_after_s is not None
        if held < policy.release_stages_after_s:
            return None
        self._since = None
        return f"{availability.detail} for {held:.0f} s"


class CallInWatch:
    """When an agent tells the controller it can take stages again: once it has been available for CALL_IN_SETTLE_S
    after a spell of not being (paused by its user or its admin, on battery, too hot, short of memory, busy), so
    that the next fleet run takes back a PC a re-plan left out meanwhile (controller/fleet_deploy.py, pcs_back). A
    registration is such a word too. At most one in CALL_IN_MIN_INTERVAL_S, and none for an availability that does
    not last CALL_IN_SETTLE_S: a PC whose free memory hovers about its limit, or whose CPU crosses it now and then,
    would otherwise have every idle `serve --fleet` re-plan for it once a minute. The one owed is said once both
    have passed, if the PC is still available then. Pure: the caller passes each look's verdict and the time."""

    def __init__(self) -> None:
        self._available_since: float | None = None  # start of the current available streak after a spell
        self._was_available: bool | None = None  # None: no look yet (the registration said the rest)
        self._last: float | None = None  # when the agent last called in (or registered)
        self._spells = 0  # went_away() calls: a look that began before one is no evidence of availability

    def registered(self, now: float) -> None:
        """The agent registered at `now`: that tells the controller all a call-in would."""
        self._last, self._available_since = now, None

    def went_away(self) -> None:
        """The fleet saw the PC unable to take stages between two looks (it gave its stages up, a status said it
        was paused or unavailable): a pause ended within seconds is a spell too, once a plan may have left it out."""
        self._was_available, self._available_since = False, None
        self._spells += 1

    def mark(self) -> int:
        """Taken as a look begins (before its sensor read): update() counts a look that a spell overtook as not
        available, so a reading begun before a pause does not call in for the paused PC."""
        return self._spells

    def update(self, available: bool, now: float, mark: int | None = None) -> bool:
        """Whether to call in now, from whether the PC is available at `now` (a look begun at `mark`)."""
        if mark is not None and mark != self._spells:
            available = False
        if not available:
            self._available_since = None
        elif self._was_available is False:
            self._available_since = now
        self._was_available = available
        since = self._available_since
        if since is None or now - since < CALL_IN_SETTLE_S or \
                (self._last is not None and now - self._last < CALL_IN_MIN_INTERVAL_S):
            return False
        self._available_since, self._last = None, now
        return True


# Private functions

def _power_problem(reading: MonitorReading, policy: AvailabilityPolicy) -> str:
    """A description of the power problem and the setting it crosses, or "" when there is none or the sensors do
    not tell."""
    percent = reading.battery_percent
    unplugged = reading.on_ac_power is False
    if unplugged and policy.require_ac_power:
        return f"battery {percent:.0f}%, unplugged (require_ac_power)" if percent is not None else \
            "unplugged (require_ac_power)"
    low = policy.min_battery_percent is not None and percent is not None and percent < policy.min_battery_percent
    # Unknown AC with a low battery: low charge alone is evidence enough not to drain it further.
    if low and reading.on_ac_power is not True:
        return (f"battery {percent:.0f}%, {'unplugged' if unplugged else 'power source unknown'} "
                f"(min_battery_percent {policy.min_battery_percent:g})")
    return ""


def _hottest_label(reading: MonitorReading) -> str:
    return max(reading.temperatures, key=lambda sensor: sensor.celsius).label
