"""Shared fixtures: small random-weight checkpoints and their exports, made once per test session."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(name, architecture, **config) -> a random checkpoint folder, cached by name."""
    from deskfleet.controller.export.random_checkpoint import make_random_checkpoint

    made: dict[str, Path] = {}

    def make(name: str, architecture: str = "llama", **fields: Any) -> Path:
        if name not in made:
            made[name] = make_random_checkpoint(tmp_path_factory.mktemp(f"ckpt-{name}"), architecture,
                                                seed=zlib.crc32(name.encode()), **fields)
        return made[name]

    return make


@pytest.fixture(scope="session")
def export_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str], Path]:
    """export(checkpoint, weights) -> an export folder, cached per (checkpoint, weights)."""
    from deskfleet.common.model_spec import WeightFormat
    from deskfleet.controller.export.exporter import export_checkpoint

    made: dict[tuple[Path, str], Path] = {}

    def export(checkpoint: Path, weights: str = "f32") -> Path:
        key = (checkpoint, weights)
        if key not in made:
            out = tmp_path_factory.mktemp(f"ir-{checkpoint.name}-{weights}") / "model"
            export_checkpoint(checkpoint, out, WeightFormat(weights))
            made[key] = out
        return made[key]

    return export


@pytest.fixture(scope="session")
def tiny_export(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> Path:
    """A 4-layer GQA llama, exported in f32."""
    return export_factory(checkpoint_factory("tiny", num_hidden_layers=4), "f32")
