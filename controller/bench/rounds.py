"""The order in which one round of a benchmark runs its configurations.

Every benchmark interleaves its configurations round by round so that the host's drift hits them alike. A fixed
order within the round still favours some: the first after a pause, the one that follows the heaviest, the one
whose process last warmed the caches. So each round starts one place further along the list: round r runs
items[r:] + items[:r], and over as many rounds as there are configurations each runs once in every position
(two configurations, as in `bench streams`' pairs, simply take turns going first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Item = TypeVar("Item")


def round_order(items: Sequence[Item], round_index: int) -> list[Item]:
    """`items` rotated left by `round_index` places (any integer: warm-up rounds may count from below 0)."""
    if not items:
        return []
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]
