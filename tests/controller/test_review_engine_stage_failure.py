"""A stage that fails mid-run: the run ends with one error naming the stage by its layers, and nothing else on
stderr (the stage's traceback was logged as an error first, and the stage was named by LayerRange's repr)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline, PipelineError

F32 = CompileSettings(precision=Precision.F32)


@pytest.mark.parametrize(("stages", "failing", "named"), [(1, 0, "stage 0 (layers [0:4] of 4)"),
                                                            (2, 1, "stage 1 (layers [2:4] of 4)"),
                                                            (4, 2, "stage 2 (layers [2:3] of 4)")])
def test_a_stage_failing_mid_run_is_one_error_naming_its_layers(tiny_export: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture, stages: int,
                                                               failing: int, named: str) -> None:
    manifest = load_manifest(tiny_export)
    run = StageExecutor.run
    calls = {"count": 0}

    def fail_on_the_fourth_step(self: StageExecutor, message: Forward,
                                return_logits: bool = False) -> Forward | ForwardResult:
        if self.stage.layers.start == pipeline.ranges[failing].start:
            calls["count"] += 1
            if calls["count"] == 4:
                raise RuntimeError("out of memory")
        return run(self, message, return_logits)

    monkeypatch.setattr(StageExecutor, "run", fail_on_the_fourth_step)
    caplog.set_level(logging.WARNING)
    with LocalPipeline(tiny_export, stages, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, None, EngineOptions(micro_batches=stages))
        engine.add(StreamRequest([1, 5, 9], max_new_tokens=10, ignore_eos=True))
        with pytest.raises(PipelineError) as raised:
            engine.run()
    assert str(raised.value) == f"{named} failed on micro-batch 1: out of memory"
    assert isinstance(raised.value.__cause__, RuntimeError)  # --verbose shows the stage's traceback through it
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    assert pipeline.micro_batches == (0,) * stages
