"""The benches' interleaving order: each round starts one place further along."""

from __future__ import annotations

from deskfleet.controller.bench.rounds import round_order


def test_each_round_starts_one_place_further() -> None:
    items = ["a", "b", "c"]
    assert [round_order(items, index) for index in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_over_as_many_rounds_as_items_each_item_takes_every_position_once() -> None:
    items = list(range(5))
    orders = [round_order(items, index) for index in range(len(items))]
    for position in range(len(items)):
        assert sorted(order[position] for order in orders) == items
    assert all(sorted(order) == items for order in orders)  # nothing dropped or repeated


def test_warm_up_rounds_below_zero_and_a_pair_that_takes_turns() -> None:
    assert round_order(["x", "y", "z"], -1) == ["z", "x", "y"]
    assert [round_order(("first", "second"), index)[0] for index in range(4)] == ["first", "second"] * 2


def test_nothing_to_order() -> None:
    assert round_order([], 3) == []
