"""A stage refuses an export whose manifest no longer fits its IR."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deskfleet.agent.stage import LayerRange, build_stage_model
from deskfleet.common.model_spec import ManifestError, load_manifest


def test_a_context_past_the_rope_tables_is_refused(tiny_export: Path, tmp_path: Path) -> None:
    # The manifest's max_context raised past the exported RoPE table: prompts past the table's rows were
    # accepted and computed garbage (gathered outside the table), silently.
    folder = tmp_path / "model"
    shutil.copytree(tiny_export, folder)
    body = json.loads((folder / "manifest.json").read_text())
    body["spec"]["max_context"] *= 4
    (folder / "manifest.json").write_text(json.dumps(body))
    manifest = load_manifest(folder)
    layers = manifest.spec.num_layers
    with pytest.raises(ManifestError, match=r"the context is \d+ positions, but the RoPE tables \(rope\.xml\) hold"):
        build_stage_model(folder, manifest, LayerRange(0, layers, layers))
    build_stage_model(tiny_export, load_manifest(tiny_export), LayerRange(0, layers, layers))  # the real one fits
