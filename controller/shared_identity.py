"""Two PCs holding one agent identity: a disk image, or a copied state folder, made after `deskfleet-agent join`.

The controller keeps one registration link per agent id, the latest (controller/fleet_server.py): a PC that
restarted, or moved to another network, replaces its old link once. Two PCs with the same key and certificate
replace each other's link again and again, each calling back in when it loses its link, and the roster's
address flips between them: nothing failed, so nothing was said. `SharedIdentityWatch` sees the flip-back (a
registration at the addresses that an earlier takeover within `window_s` replaced) and says so, once a window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 600.0  # a takeover back to addresses replaced within this long counts; one warning a window


@dataclass(frozen=True)
class _Takeover:
    at: float
    replaced: frozenset[str]  # the listen addresses of the link that was live
    by: frozenset[str]  # those of the registration that replaced it


class SharedIdentityWatch:
    """Call `takeover()` when an agent's registration replaces its live link; it returns the warning to log, when
    the takeovers show two PCs taking turns, else None."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._takeovers: dict[str, list[_Takeover]] = {}  # agent id -> its takeovers within the window, oldest first
        self._warned_at: dict[str, float] = {}

    def takeover(self, agent_id: str, replaced: tuple[str, ...], by: tuple[str, ...]) -> str | None:
        """`replaced`: the live link's listen addresses; `by`: the new registration's. The same addresses are one
        PC calling in again before its old link was found dead: not counted."""
        now = self._clock()
        if set(replaced) == set(by):
            return None
        recent = [seen for seen in self._takeovers.get(agent_id, []) if now - seen.at <= self.window_s]
        recent.append(_Takeover(now, frozenset(replaced), frozenset(by)))
        self._takeovers[agent_id] = recent
        back = [seen for seen in recent[:-1] if seen.replaced == recent[-1].by]
        warned = self._warned_at.get(agent_id)
        if not back or (warned is not None and now - warned <= self.window_s):
            return None
        self._warned_at[agent_id] = now
        turns = sum(1 for seen in recent if {seen.replaced, seen.by} == {recent[-1].replaced, recent[-1].by})
        return (f"agent {agent_id[:12]} registered at {_listed(recent[-1].by)} while its link from "
                f"{_listed(recent[-1].replaced)} was live, and the other way round: {turns} takeovers in the last "
                f"{self.window_s:.0f} s. Two PCs hold one agent identity (a disk image or a state folder copied "
                "after `deskfleet-agent join`?): the controller keeps one link per agent, so they take turns. "
                "Give one of them an empty state folder and join it again with a new token: it gets an id of "
                "its own")

def _listed(addresses: frozenset[str]) -> str:
    return ", ".join(sorted(addresses)) or "no address"
