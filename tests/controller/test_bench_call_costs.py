"""A stage's call cost by width, back to back and alternating (controller/bench/call_costs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.bench import call_costs
from deskfleet.controller.bench.call_costs import context_needed, measure_call_costs


def stage_of(model: Path, start: int = 0, stop: int | None = None) -> Stage:
    manifest = load_manifest(model)
    layers = manifest.spec.num_layers
    return Stage(model, manifest, LayerRange(start, layers if stop is None else stop, layers),
                 CompileSettings(precision=Precision.F32))


def context_of(model: Path) -> int:
    return load_manifest(model).spec.max_context


def test_steady_and_alternating_costs_of_each_width(tiny_export: Path) -> None:
    stage = stage_of(tiny_export)
    costs = measure_call_costs(stage, [5, 1, 5], context_of(tiny_export), calls=3, blocks=2, prefill_tokens=4)
    assert set(costs["steady_ms"]) == set(costs["alternating_ms"]) == {"1", "5"}
    assert all(value > 0 for value in [*costs["steady_ms"].values(), *costs["alternating_ms"].values()])
    expected = ((costs["alternating_ms"]["1"] - costs["steady_ms"]["1"])
                + (costs["alternating_ms"]["5"] - costs["steady_ms"]["5"])) / 2
    assert costs["switch_penalty_ms"] == pytest.approx(expected, abs=1e-3)
    assert costs["calls_per_width"] == 6 and costs["prefill_tokens"] == 4


def test_steady_calls_are_timed_at_the_alternating_calls_context() -> None:
    # Attention's cost grows with the context: a steady block must not run at a shorter one than the
    # alternating block it is compared with (with equal prefills the penalty came out 36-56% too high).
    from deskfleet.controller.bench.call_costs import steady_filler_calls

    for widths, calls in (([1, 3, 5, 7, 9], 8), ([1, 9], 8), ([1, 5], 3)):
        slots = 32 + sum(widths)
        alternating = []
        for _ in range(calls):
            for width in widths:
                slots += width
                alternating.append(slots)
        for width in widths:
            slots = 32 + width * steady_filler_calls(32, widths, width, calls) + width
            steady = [slots := slots + width for _ in range(calls)]
            assert abs(sum(steady) / calls - sum(alternating) / len(alternating)) <= width / 2 + 0.5


def test_the_report_shows_the_contexts_it_compared(tiny_export: Path) -> None:
    costs = measure_call_costs(stage_of(tiny_export), [1, 5], context_of(tiny_export), calls=3, blocks=1,
                               prefill_tokens=4)
    contexts = costs["mean_context_slots"]
    assert set(contexts) == {"alternating", "1", "5"}
    assert abs(contexts["1"] - contexts["alternating"]) <= 1 and abs(contexts["5"] - contexts["alternating"]) <= 3


def test_one_width_has_no_switch_to_price(tiny_export: Path) -> None:
    costs = measure_call_costs(stage_of(tiny_export), [1], context_of(tiny_export), calls=2, blocks=1)
    assert set(costs["steady_ms"]) == {"1"}
    assert "alternating_ms" not in costs and "switch_penalty_ms" not in costs


def test_bad_requests_are_refused(tiny_export: Path) -> None:
    stage, context = stage_of(tiny_export), context_of(tiny_export)
    with pytest.raises(ValueError, match="widths"):
        measure_call_costs(stage, [0, 1], context)
    with pytest.raises(ValueError, match="widths"):
        measure_call_costs(stage, [], context)
    with pytest.raises(ValueError, match="at least 1"):
        measure_call_costs(stage, [1, 2], context, calls=0)
    first_half = stage_of(tiny_export, 0, 1)
    with pytest.raises(ValueError, match="whole-model stage"):
        measure_call_costs(first_half, [1, 2], context)
    with pytest.raises(ValueError, match=f"more than the model's context {context}"):
        measure_call_costs(stage, [1, context], context)


def test_context_needed_is_the_most_slots_a_block_fills(tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    filled: list[int] = []
    original = call_costs._Feeder.call

    def call(self: call_costs._Feeder, width: int) -> None:
        original(self, width)
        filled.append(self.slots)

    monkeypatch.setattr(call_costs._Feeder, "call", call)
    for widths in ([1, 5], [1], [2, 3, 9]):
        filled.clear()
        measure_call_costs(stage_of(tiny_export), widths, context_of(tiny_export), calls=2, blocks=1, prefill_tokens=4)
        assert max(filled) == context_needed(widths, calls=2, prefill_tokens=4)
