"""The last stage's in-graph argmax: first maximum per row, as torch and numpy pick it, with no sort."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from deskfleet.agent.openvino_core import openvino_core
from deskfleet.agent.stage import (
    CompileSettings,
    LayerRange,
    Precision,
    Stage,
    StageSession,
    build_stage_model,
    first_max_index,
)
from deskfleet.common.model_spec import load_manifest


def _compiled_argmax(vocab_size: int) -> ov.CompiledModel:
    logits = ops.parameter(ov.PartialShape([-1, -1, vocab_size]), ov.Type.f32, name="logits")
    model = ov.Model([ops.result(first_max_index(logits.output(0), vocab_size))], [logits], "argmax")
    return openvino_core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


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
    # a first call: every row is new and gathers row 0 of the (empty) state, as a stage's mirror says
    out = session.forward(ids, np.ones((2, 6), np.int64), positions, np.zeros(2, dtype=np.int32), want_logits=True,
                          logits_positions=positions)
    assert out.next_tokens is not None and out.logits is not None
    np.testing.assert_array_equal(out.next_tokens, np.argmax(out.logits, axis=-1))


def test_sessions_with_own_buffers_interleave_grow_and_shrink_exactly(tiny_export: Path) -> None:
    """Each session hands its request numpy buffers of its own, grown past their capacity here (8 rows,
    then 1) while other sessions of the same compiled stage run and one is dropped: every session's
    tokens equal a fresh session's run of the same calls, and next_tokens comes back as [B, N] copies."""
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    stage = Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))
    rng = np.random.default_rng(5)
    calls = [rng.integers(3, manifest.spec.vocab_size, (rows, tokens)) for rows, tokens in ((1, 3), (8, 9), (1, 1))]

    def run(session: StageSession, ids: np.ndarray) -> np.ndarray:
        session.reset()
        rows, tokens = ids.shape
        positions = np.tile(np.arange(tokens), (rows, 1))
        out = session.forward(ids, np.ones((rows, tokens), np.int64), positions, np.zeros(rows, np.int32),
                              logits_positions=positions)
        assert out.next_tokens is not None and out.next_tokens.shape == (rows, tokens)
        return out.next_tokens

    alone = [run(stage.open_session(), ids) for ids in calls]
    first, second = stage.open_session(), stage.open_session()
    dropped = stage.open_session()
    run(dropped, calls[1])
    del dropped
    for index, ids in enumerate(calls):
        got_first = run(first, ids)
        got_second = run(second, calls[-1 - index])
        np.testing.assert_array_equal(got_first, alone[index])
        np.testing.assert_array_equal(got_second, alone[-1 - index])
    kept = run(first, calls[0])
    run(second, calls[1])
    np.testing.assert_array_equal(kept, alone[0])  # a copy: the next call of another session left it alone
