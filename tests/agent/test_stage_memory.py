"""A released stage has the plugin free its call buffers (Stage.release_memory): the CPU plugin kept them past the
compiled model's end, 40 MB a release of a stage that had run a 900-token prompt on the demo target."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.common.model_spec import load_manifest


def test_a_stage_frees_its_call_buffers_and_its_idle_sessions(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    stage = Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))
    session = stage.open_session()
    tokens = 64
    session.forward(np.arange(1, tokens + 1, dtype=np.int64)[None], np.ones((1, tokens), dtype=np.int64),
                    np.arange(tokens, dtype=np.int64)[None], np.zeros(1, dtype=np.int32))
    stage.recycle(session)
    stage.release_memory()  # the plugin's own call: no request runs
    assert stage.open_session() is not session  # the idle sessions went with it
