"""What an agent says about itself: can it take work, and if not, why not.

Shared by the agent's monitor (which decides), the wire protocol and discovery TXT records (which carry
it) and the planner (which explains it). The values are stable strings so they can travel as text.
"""

from __future__ import annotations

from enum import Enum


class AgentState(str, Enum):
    """An agent's availability to the fleet."""

    AVAILABLE = "available"  # idle and willing: the planner may give it stages
    SERVING = "serving"  # hosting stages now
    PAUSED = "paused"  # taken out of the fleet: by its user (`deskfleet-agent pause`) or its admin's settings
    UNAVAILABLE = "unavailable"  # the monitor says no (see UnavailableReason)


class UnavailableReason(str, Enum):
    """Why the monitor marked an agent UNAVAILABLE."""

    ON_BATTERY = "on_battery"
    TOO_HOT = "too_hot"
    LOW_MEMORY = "low_memory"
    USER_BUSY = "user_busy"  # the employee's own work is using the machine
    UNREACHABLE = "unreachable"  # the controller lost the link (no ping answered)

    def describe(self) -> str:
        """A short phrase for humans: 'on battery', 'too hot'."""
        return self.value.replace("_", " ")
