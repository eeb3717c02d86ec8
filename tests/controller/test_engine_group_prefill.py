"""Streams that arrive together while nothing runs are prefilled together as rows of one micro-batch:
their greedy tokens still equal their solo runs (f32), and no admission is needed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline

F32 = CompileSettings(precision=Precision.F32)
PROMPTS = [[1, 17, 99, 230, 5, 42, 7, 300, 11], [1, 8, 8, 3], [1, 77, 78, 79, 80, 81, 82, 83, 84], [1, 2],
           [1, 300, 301, 302, 400, 401]]


class CountingChain:
    def __init__(self, pipeline: LocalPipeline) -> None:
        self.pipeline = pipeline
        self.deltas: Counter[str] = Counter()
        self.prefill_rows: list[int] = []

    def submit(self, message: Forward) -> None:
        self.deltas.update(type(delta).__name__ for delta in message.slot_deltas)
        if message.step_id == 0:
            self.prefill_rows.append(len(message.stream_ids))
        self.pipeline.submit(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        return self.pipeline.collect(timeout)

    def release(self, batch_id: int) -> None:
        self.pipeline.release(batch_id)


def run(model: Path, requests: list[StreamRequest], options: EngineOptions, stages: int = 1
        ) -> tuple[list[list[int]], CountingChain]:
    manifest = load_manifest(model)
    with LocalPipeline(model, stages, F32, manifest) as pipeline:
        chain = CountingChain(pipeline)
        engine = Engine(chain, manifest.spec, None, options)
        for request in requests:
            engine.add(request)
        results = engine.run()
    return [results[index].tokens for index in range(len(requests))], chain


LENGTHS = [12, 5, 9, 1, 7]


@pytest.fixture(scope="module")
def solo(target: Path) -> list[list[int]]:
    return [run(target, [StreamRequest(prompt, max_new_tokens=length, ignore_eos=True)], EngineOptions())[0][0]
            for prompt, length in zip(PROMPTS, LENGTHS, strict=True)]


@pytest.mark.parametrize(("stages", "micro_batches", "max_rows", "groups"),
                         [(1, 1, 8, [5]), (2, 2, 8, [3, 2]), (1, 1, 3, [3, 1, 1])])
def test_streams_arriving_together_are_prefilled_together(target: Path, solo: list[list[int]], stages: int,
                                                          micro_batches: int, max_rows: int,
                                                          groups: list[int]) -> None:
    lengths = LENGTHS
    requests = [StreamRequest(prompt, max_new_tokens=length, ignore_eos=True)
                for prompt, length in zip(PROMPTS, lengths, strict=True)]
    tokens, chain = run(target, requests, EngineOptions(max_rows=max_rows, micro_batches=micro_batches), stages)
    assert tokens == solo
    assert sorted(chain.prefill_rows, reverse=True) == sorted(groups, reverse=True)
    # Streams past the groups' rows are prefilled alone and admitted once a row frees up.
    assert (chain.deltas["AdmitRow"] > 0) == (len(groups) > micro_batches)


def test_a_group_member_that_finishes_at_prefill_leaves_the_others_exact(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    prompts = [[1, 17, 99, 230], [1, 8, 8, 3], [1, 77, 78]]
    solo = []
    for prompt in prompts:
        with LocalPipeline(tiny_export, 1, F32, manifest) as pipeline:
            engine = Engine(pipeline, manifest.spec)
            engine.add(StreamRequest(prompt, max_new_tokens=12, ignore_eos=True))
            solo.append(engine.run()[0].tokens)
    with LocalPipeline(tiny_export, 2, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, options=EngineOptions(max_rows=2, micro_batches=2))
        for prompt, limit in zip(prompts, (1, 12, 12), strict=True):  # the first ends with its prefill
            engine.add(StreamRequest(prompt, max_new_tokens=limit, ignore_eos=True))
        results = engine.run()
    assert results[0].tokens == solo[0][:1]
    assert results[1].tokens == solo[1] and results[2].tokens == solo[2]
