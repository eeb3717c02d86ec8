"""A CPU stage maps its weight files where the plugin repacks the weights (it held them twice when it read
them into memory) and reads them where the plugin runs them in place (huge pages then back them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent import stage as stage_module
from deskfleet.agent.stage import (
    WEIGHTS_ENV_VAR,
    CompileSettings,
    LayerRange,
    Precision,
    Stage,
    resident_anonymous_bytes,
    stage_weight_bytes,
    stage_weights_choice,
    weights_were_repacked,
)
from deskfleet.common.model_spec import load_manifest

MB = 1 << 20


def test_the_weights_count_as_repacked_when_anonymous_memory_grew_by_half_their_bytes_or_more() -> None:
    assert weights_were_repacked(100 * MB, 200 * MB, 100 * MB)  # grown by all of them: a copy of its own
    assert weights_were_repacked(100 * MB, 150 * MB, 100 * MB)
    assert not weights_were_repacked(100 * MB, 140 * MB, 100 * MB)  # mostly run in place
    assert weights_were_repacked(None, None, 100 * MB)  # not Linux: no huge pages to gain by reading
    assert weights_were_repacked(100 * MB, None, 100 * MB) and weights_were_repacked(1, 1, 0)


def test_this_process_anonymous_memory_is_read_on_linux() -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc here")
    before = resident_anonymous_bytes()
    block = np.ones(64 * MB, dtype=np.uint8)  # touched: resident
    after = resident_anonymous_bytes()
    assert before is not None and after is not None and after - before >= 60 * MB
    del block


def greedy_tokens(stage: Stage, steps: int = 8) -> list[int]:
    session = stage.open_session()
    tokens, slots, feed = [], 0, [1, 5, 9, 2]
    for _ in range(steps):
        slots += len(feed)
        output = session.forward(np.array([feed], dtype=np.int64), np.ones((1, slots), dtype=np.int64),
                                 np.arange(slots - len(feed), slots, dtype=np.int64)[None, :],
                                 np.zeros(1, dtype=np.int32))
        assert output.next_tokens is not None
        feed = [int(output.next_tokens[0, -1])]
        tokens += feed
    stage.recycle(session)
    return tokens


def test_a_stage_maps_or_reads_its_weights_as_the_plugin_uses_them_with_the_same_tokens(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = load_manifest(tiny_export)
    layers = LayerRange(0, manifest.spec.num_layers, manifest.spec.num_layers)
    settings = CompileSettings(precision=Precision.F32)
    seen: list[int] = []

    def repacked(before: int | None, after: int | None, weight_bytes: int) -> bool:
        seen.append(weight_bytes)
        return True

    monkeypatch.setattr(stage_module, "weights_were_repacked", repacked)
    mapped = Stage(tiny_export, manifest, layers, settings)
    assert mapped.weights_mapped and seen == [stage_weight_bytes(manifest, layers)] and seen[0] > 0
    monkeypatch.setattr(stage_module, "weights_were_repacked", lambda *measured: False)
    read = Stage(tiny_export, manifest, layers, settings)
    assert not read.weights_mapped
    assert greedy_tokens(mapped) == greedy_tokens(read)


def test_the_choice_of_how_a_stage_holds_its_weights_is_read_from_the_environment() -> None:
    assert stage_weights_choice({}) == "auto"
    assert stage_weights_choice({WEIGHTS_ENV_VAR: " Read "}) == "read"
    assert stage_weights_choice({WEIGHTS_ENV_VAR: "mapped"}) == "mapped"
    with pytest.raises(ValueError, match=f"{WEIGHTS_ENV_VAR}='mmap': choose auto, read or mapped"):
        stage_weights_choice({WEIGHTS_ENV_VAR: "mmap"})


@pytest.mark.parametrize(("choice", "mapped"), [("read", False), ("mapped", True)])
def test_a_stage_told_how_to_hold_its_weights_does_so_whatever_the_warm_up_shows(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, choice: str, mapped: bool) -> None:
    decided: list[bool] = []
    monkeypatch.setenv(WEIGHTS_ENV_VAR, choice)
    monkeypatch.setattr(stage_module, "weights_were_repacked", lambda *measured: decided.append(True) or not mapped)
    manifest = load_manifest(tiny_export)
    stage = Stage(tiny_export, manifest, LayerRange(0, manifest.spec.num_layers, manifest.spec.num_layers),
                  CompileSettings(precision=Precision.F32))
    assert stage.weights_mapped is mapped and decided == []


def test_on_windows_a_stage_reads_its_weights(tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Windows keeps a mapped file from being deleted, and the shard cache deletes a released stage's files
    monkeypatch.setattr(stage_module.sys, "platform", "win32")
    monkeypatch.setattr(stage_module, "weights_were_repacked", lambda *measured: True)
    manifest = load_manifest(tiny_export)
    layers = LayerRange(0, manifest.spec.num_layers, manifest.spec.num_layers)
    assert not Stage(tiny_export, manifest, layers, CompileSettings(precision=Precision.F32)).weights_mapped


def test_on_windows_a_stage_reads_its_weights_even_when_asked_to_map_them(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # DESKFLEET_STAGE_WEIGHTS=mapped mapped them on Windows too, where a mapped file cannot be deleted: a released
    # stage's view stayed in the shard cache and the next build of that stage under its name failed
    manifest = load_manifest(tiny_export)
    layers = LayerRange(0, manifest.spec.num_layers, manifest.spec.num_layers)
    monkeypatch.setenv(WEIGHTS_ENV_VAR, "mapped")
    monkeypatch.setattr(stage_module.sys, "platform", "win32")
    with caplog.at_level("WARNING", logger=stage_module.log.name):
        stage = Stage(tiny_export, manifest, layers, CompileSettings(precision=Precision.F32))
    assert not stage.weights_mapped
    assert any("is not used on Windows" in record.getMessage() for record in caplog.records)
