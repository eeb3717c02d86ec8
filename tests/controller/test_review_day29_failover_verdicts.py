"""A failover's checks of a next-hop blame, where the reporter is at fault or the planner leaves one out.

Before: a reporter that could dial no PC at all (its own network or firewall at fault, or a member lying about
its next hop) was never left out: each failover marked one more link from it broken and put it before another PC,
until --max-failovers ended the run, where leaving it out once (as before the broken links) let the run go on.
And the verdict of a link found broken said "both are kept" even where the re-plan then left one of them out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.common.planner import GB, ModelFootprint
from deskfleet.controller.fleet_store import FleetStore
from tests.controller import test_review_broken_links_failover as office_tests
from tests.controller.test_review_broken_links_failover import (
    A,
    B,
    C,
    Office,
    chain_of,
    next_hop_unreachable,
)

D, E = "d" * 52, "e" * 52
# a 5 GB layer a PC (8 GiB free), and no head to weigh: a chain that ends on A, the fastest, is no faster, so A stays
# before another PC (with a head, all_by_speed put A last after the first failover, where it dials nobody)
FOUR_NEEDED = ModelFootprint.uniform("big", 4, 5 * GB, GB, 0, 0, 1024)


def test_a_reporter_that_cannot_dial_two_pcs_the_controller_reaches_is_left_out_and_the_run_goes_on(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # any four of the five PCs hold the model. Before, A was put before B, then C, then D (3 failovers: the run
    # ended at the default 2); before the broken links, A was left out at the first
    monkeypatch.setitem(office_tests.SPEEDS, D, 0.5)
    monkeypatch.setitem(office_tests.SPEEDS, E, 0.4)
    office = Office(tiny_export, {A, B, C, D, E}, chain_of(A, B, C, D), FOUR_NEEDED)
    told: list[str] = []
    failover = office.failover(store, monkeypatch, told)
    failover.max_failovers = 2  # chat's default
    for _ in range(2):  # A dials nobody: it reports whichever PC comes after it
        order = office.order()
        assert A in order[:-1], order
        failover(next_hop_unreachable(A, order[order.index(A) + 1], office.chain))
    # the first: the link A -> B is broken, both kept; the second, A -> another PC that answers: A is the fault
    assert [replan["lost_agent"] for replan in failover.replans] == [None, A]
    assert failover.lost == {A} and sorted(office.order()) == [B, C, D, E]
    assert failover.broken_links == {(A, B)} and failover.kept == {B, C}
    verdict = str(failover.replans[1]["blame_check"])
    assert (f"and agent {A[:12]} could not reach agent {B[:12]} either earlier in this run: agent {A[:12]} itself "
            f"is at fault, so it is left out of the next plan and agent {C[:12]} is kept") in verdict


def test_a_verdict_does_not_say_both_are_kept_where_the_re_plan_leaves_one_out(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    office = Office(tiny_export, {A, B}, chain_of(A, B))
    failover = office.failover(store, monkeypatch, [])
    failover(next_hop_unreachable(A, B, office.chain))
    assert "the new chain keeps both" in str(failover.replans[0]["blame_check"])
    failover(next_hop_unreachable(B, A, office.chain))
    assert office.order() == [A] and failover.replans[1]["lost_agent"] == B
    verdict = str(failover.replans[1]["blame_check"])
    assert f"the new plan leaves agent {B[:12]} out (broken link:" in verdict
    assert "both are kept" not in verdict
