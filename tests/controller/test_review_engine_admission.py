"""Queued streams beyond twice the micro-batches' rows wait unprefilled: a prefill holds its KV state on every
stage until its stream runs, so prefilling every queued prompt at once held one cache (and one session) per
prompt on every stage, and every stream's first token waited for the last prompt's prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft

F32 = CompileSettings(precision=Precision.F32)
PROMPTS = [[1, 17 + index, 99, 230 + index, 5][: 2 + index % 4] for index in range(14)]


class HeldCounter:
    """A one-stage LocalPipeline (its stage runs at submit) that records the most micro-batches it held."""

    def __init__(self, pipeline: LocalPipeline) -> None:
        self.pipeline = pipeline
        self.most_held = 0

    def submit(self, message: Forward) -> None:
        self.pipeline.submit(message)
        self.most_held = max(self.most_held, self.pipeline.micro_batches[0])

    def collect(self, timeout: float | None = None) -> ForwardResult:
        return self.pipeline.collect(timeout)

    def release(self, batch_id: int) -> None:
        self.pipeline.release(batch_id)


def run(model: Path, options: EngineOptions, lookup: bool = False) -> tuple[list[list[int]], int]:
    manifest = load_manifest(model)
    with LocalPipeline(model, 1, F32, manifest) as pipeline:
        chain = HeldCounter(pipeline)
        engine = Engine(chain, manifest.spec, PromptLookupDraft() if lookup else None, options)
        for prompt in PROMPTS:
            engine.add(StreamRequest(prompt, max_new_tokens=6, ignore_eos=True))
        results = engine.run()
        assert pipeline.micro_batches == (0,)
    return [results[index].tokens for index in range(len(PROMPTS))], chain.most_held


@pytest.mark.parametrize("lookup", [False, True])
def test_streams_beyond_the_rows_wait_unprefilled(tiny_export: Path, lookup: bool) -> None:
    alone, _ = run(tiny_export, EngineOptions(max_rows=1))
    tokens, most_held = run(tiny_export, EngineOptions(max_rows=2, micro_batches=1), lookup)
    assert tokens == alone
    # at most 4 streams started (2 rows running, 2 newcomers prefilled, ready to merge), each holding at most
    # one micro-batch: never 14 caches
    assert most_held <= 4, f"{most_held} micro-batches held at once"

