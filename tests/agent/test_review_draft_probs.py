"""A sampled verification step whose draft probabilities cannot be read is refused before the call: the
micro-batch, its mirror and KV state stay as they were, so the driver's correct resend of the same step
runs and computes what it would have computed without the bad one."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.kv_ledger import LedgerError
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import DraftInfo, ForwardResult, SamplingInfo
from deskfleet.controller.batch_track import BatchTrack

PROMPT = [5, 6, 7, 8]
DRAFT_IDS = np.array([[3, 4]], dtype=np.int64)
SAMPLED = SamplingInfo((0.8,), (0,), (1.0,), (7,))


@pytest.fixture(scope="module")
def whole(tiny_export: Path) -> Stage:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    return Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))


def _probs(stage: Stage, fill: float) -> np.ndarray:
    return np.full((1, 2, stage.vocab_size), fill, dtype=np.float32)


def _draft(stage: Stage, case: str) -> DraftInfo:
    if case == "no probabilities":
        return DraftInfo((2,), DRAFT_IDS)
    if case == "NaN":
        return DraftInfo((2,), DRAFT_IDS, _probs(stage, np.nan))
    if case == "negative":
        return DraftInfo((2,), DRAFT_IDS, _probs(stage, -0.5))
    probs = _probs(stage, 1.0 / stage.vocab_size)
    probs[0, 1, 4] = 0.0  # the second draft token could not have been drawn
    return DraftInfo((2,), DRAFT_IDS, probs)


@pytest.mark.parametrize(("case", "refusal"), [
    ("no probabilities", "samples with draft tokens but no draft probabilities"),
    ("NaN", "NaN, infinite or negative"),
    ("negative", "NaN, infinite or negative"),
    ("zero at a draft token", "draft token 4 at position 1 has draft probability 0"),
])
def test_unusable_draft_probabilities_are_refused_before_the_call(whole: Stage, case: str, refusal: str) -> None:
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    executor.run(track.step([PROMPT]))
    resend = copy.deepcopy(track)
    with pytest.raises(LedgerError, match=refusal):
        executor.run(track.step([[9, 3, 4]], draft=_draft(whole, case), sampling=SAMPLED))
    good = resend.step([[9, 3, 4]], draft=DraftInfo((2,), DRAFT_IDS, one_hot=True), sampling=SAMPLED)
    output = executor.run(good)  # the same step id: it was never taken
    assert isinstance(output, ForwardResult) and output.accepted_counts is not None


def test_greedy_rows_do_not_need_draft_probabilities(whole: Stage) -> None:
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    executor.run(track.step([PROMPT]))
    greedy = SamplingInfo((0.0,), (0,), (1.0,), (7,))
    output = executor.run(track.step([[9, 3, 4]], draft=DraftInfo((2,), DRAFT_IDS), sampling=greedy))
    assert isinstance(output, ForwardResult) and output.accepted_counts is not None
