"""Models shared by the engine tests (built once per session by the checkpoint and export factories)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def target(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> Path:
    """A 4-layer random llama in f32: the engine's target."""
    return export_factory(checkpoint_factory("engine-target", num_hidden_layers=4), "f32")


@pytest.fixture(scope="module")
def other_draft(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> Path:
    """An unrelated one-layer model: it proposes mostly wrong tokens, so most rounds roll back."""
    return export_factory(checkpoint_factory("engine-draft", num_hidden_layers=1), "f32")
