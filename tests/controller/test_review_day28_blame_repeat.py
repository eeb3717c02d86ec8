"""An accused PC is kept once per run, however it is kept. A PC that answers its status and still lists its stage
but cannot serve it (its stage's computations fail, or its links from other agents do) was kept at every blame:
each failover left out the honest stage that reported it as its next hop instead, one per failover until
--max-failovers; a relayed blame of it left no one out, and the same chain was re-planned until then."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller.fleet_deploy import StagePlacement
from deskfleet.controller.fleet_pipeline import ChainError
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_review_blame import CHAIN, A, B, C, relayed, scripted_failover

# a later chain in which C reports B as its next hop (B keeps its range [1:2))
CHAIN_C_THEN_B = (StagePlacement(C, "10.0.0.2:7431", 0, 1), StagePlacement(B, "10.0.0.1:7431", 1, 2))


def test_a_next_hop_blamed_again_after_it_was_kept_is_left_out(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    failover(relayed(B, A))  # A cannot reach B, B answers: the link A -> B is broken, both are kept (a firewall)
    assert failover.lost == set() and failover.broken_links == {(A, B)}
    failover(ChainError("internal from the chain: next hop unreachable", B, C, CHAIN_C_THEN_B))
    # B was blamed by a second neighbour: it goes, not the honest C (before: {A, C})
    assert failover.lost == {B} and excluded[-1] == frozenset({B})
    assert failover.replans[-1]["lost_agent"] == B
    assert "kept once already" in str(failover.replans[-1]["blame_check"])


def test_a_relayed_blame_repeated_leaves_the_accused_out_the_second_time(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    failover(relayed(A, C))
    assert excluded == [frozenset()]
    failover(relayed(A, C))
    assert excluded[-1] == frozenset({A}) and failover.replans[-1]["lost_agent"] == A


def test_a_new_run_keeps_an_accused_once_again(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failover, excluded = scripted_failover(store, tiny_export, monkeypatch, {A: True, B: True, C: True})
    failover(relayed(A, C))
    failover.start_run()
    failover(relayed(A, C))
    assert excluded == [frozenset(), frozenset()]
    assert CHAIN[0].agent_id == A
