"""The last stage's in-graph argmax: first maximum per row, as torch and numpy pick it, with no sort."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage, build_stage_model, first_max_index
from deskfleet.common.model_spec import load_manifest


def _compiled_argmax(vocab_size: int) -> ov.CompiledModel:
    logits = ops.parameter(ov.PartialShape([-1, -1, vocab_size]), ov.Type.f32, name="logits")
    model = ov.Model([ops.result(first_max_index(logits.output(0), vocab_size))], [logits], "argmax")
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def test_first_max_index_matches_numpy_on_random_and_tied_rows() -> None:
    rng = np.random.default_rng(7)
    vocab = 50
    logits = rng.standard_normal((3, 4, vocab)).astype(np.float32)
    logits[0, 0, [5, 9, 40]] = 10.0  # a three-way tie: the first wins
    logits[1, 2, :] = -1.0  # every entry ties
    logits[2, 3, [0, vocab - 1]] = 7.0  # the ends of the row
    logits[2, 1, :] = -np.inf
    logits[2, 1, 33] = -3.0e38
    got = _compiled_argmax(vocab)(logits)[0]
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got[0, 0] == 5 and got[1, 2] == 0 and got[2, 3] == 0 and got[2, 1] == 33


def test_last_stage_has_no_sort_and_its_tokens_are_the_argmax_of_its_logits(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    model = build_stage_model(tiny_export, manifest, LayerRange(0, layers, layers))
    assert not [op for op in model.get_ops() if op.get_type_name() == "TopK"]

    stage = Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))
    session = stage.open_session()
    ids = np.random.default_rng(3).integers(3, manifest.spec.vocab_size, (2, 6))
    positions = np.tile(np.arange(6), (2, 1))
    out = session.forward(ids, np.ones((2, 6), np.int64), positions, np.arange(2, dtype=np.int32), want_logits=True,
                          logits_positions=positions)
    assert out.next_tokens is not None and out.logits is not None
    np.testing.assert_array_equal(out.next_tokens, np.argmax(out.logits, axis=-1))
