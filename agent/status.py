"""The agent's status snapshot: one typed, immutable value the tray, the CLI and the controller read.

The agent core makes a new `AgentStatus` with `make_status` after each monitor reading or event (a stage
assigned, an error) and hands it to whoever watches; nothing reads status from log lines. `to_wire()`
gives the controller's StatusReport; `to_dict()`/`from_dict()` carry it to a tray in another process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from deskfleet.agent.shard_cache import CacheUsage
from deskfleet.common.agent_state import AgentState, UnavailableReason
from deskfleet.common.availability import AvailabilityPolicy, MonitorReading, TemperatureReading, decide_availability
from deskfleet.common.version import software_version
from deskfleet.common.wire import StageRef, StatusReport
from deskfleet.common.wire_messages import MAX_STATUS_DETAIL


class PauseSource(str, Enum):
    """Who keeps a paused PC out of the fleet."""

    USER = "user"  # the employee: `deskfleet-agent pause`, or the tray's toggle (agent/opt_out.py)
    SETTINGS = "settings"  # the admin: `"paused": true` in the agent's settings file
    UNREADABLE_OPT_OUT = "unreadable_opt_out"  # an opt-out file that cannot be read counts as paused


@dataclass(frozen=True)
class AgentStatus:
    """What the agent is doing and how its host is, at `taken_at` (wall seconds). None = unknown."""

    state: AgentState
    reasons: tuple[UnavailableReason, ...]  # every limit crossed (also listed while paused)
    detail: str  # the numbers behind `reasons`, for humans
    stages: tuple[StageRef, ...]  # stages this agent hosts now
    reading: MonitorReading  # load, memory, temperatures, battery, iGPU
    cache: CacheUsage
    last_error: str | None
    version: str
    taken_at: float

    def to_wire(self) -> StatusReport:
        """The StatusReport the agent sends the controller (hottest sensor only, values clamped to range)."""
        reading = self.reading
        return StatusReport(
            state=self.state,
            free_memory_bytes=max(0, reading.memory_free_bytes),
            cpu_load=min(1.0, max(0.0, reading.cpu_load)),
            battery_percent=reading.battery_percent,
            on_ac_power=reading.on_ac_power,
            temperature_c=reading.max_temperature_c,
            igpu_busy=reading.igpu_busy,
            stages=self.stages,
            last_error=self.last_error,
            reasons=self.reasons,
            detail=self.detail[:MAX_STATUS_DETAIL],
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (enums as their string values)."""
        body = asdict(self)
        body["state"] = self.state.value
        body["reasons"] = [reason.value for reason in self.reasons]
        return body

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> AgentStatus:
        """Inverse of `to_dict`; KeyError/TypeError/ValueError on a malformed body."""
        reading = dict(body["reading"])
        reading["temperatures"] = tuple(TemperatureReading(**sensor) for sensor in reading["temperatures"])
        return cls(
            state=AgentState(body["state"]),
            reasons=tuple(UnavailableReason(reason) for reason in body["reasons"]),
            detail=str(body["detail"]),
            stages=tuple(StageRef(**stage) for stage in body["stages"]),
            reading=MonitorReading(**reading),
            cache=CacheUsage(**body["cache"]),
            last_error=body["last_error"],
            version=str(body["version"]),
            taken_at=float(body["taken_at"]),
        )


def make_status(reading: MonitorReading, policy: AvailabilityPolicy, stages: tuple[StageRef, ...],
                cache: CacheUsage, last_error: str | None, taken_at: float,
                version: str | None = None) -> AgentStatus:
    """Decide the state from `reading` and `policy` (SERVING when `stages` is not empty) and snapshot it."""
    availability = decide_availability(reading, policy, serving=bool(stages))
    return AgentStatus(
        state=availability.state,
        reasons=availability.reasons,
        detail=availability.detail,
        stages=stages,
        reading=reading,
        cache=cache,
        last_error=last_error,
        version=version if version is not None else software_version(),
        taken_at=taken_at,
    )
