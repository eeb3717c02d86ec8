"""A stage worker whose release of a micro-batch fails goes on serving the others: it died, and with it the
chain, so the driver's collect() waited forever for steps that worker would never pass on."""

from __future__ import annotations

from pathlib import Path

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward
from deskfleet.controller.batch_track import BatchTrack
from deskfleet.controller.pipeline import LocalPipeline

F32 = CompileSettings(precision=Precision.F32)


def _prefill(batch_id: int, prompt: list[int], max_positions: int) -> Forward:
    track = BatchTrack(batch_id, max_positions)
    track.add_row(stream_id=batch_id)
    return track.step([prompt])


def test_a_failing_release_leaves_the_stage_worker_serving(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    context = manifest.spec.max_context
    with LocalPipeline(tiny_export, 2, F32, manifest) as pipeline:
        last = pipeline._executors[-1]
        release = last.release

        def failing(batch_id: int) -> None:
            release(batch_id)  # the state is gone: only the plugin's reset of the request failed
            raise RuntimeError("the plugin could not reset the request")

        last.release = failing  # type: ignore[method-assign]
        pipeline.submit(_prefill(1, [1, 5, 9], context))
        expected = pipeline.collect(timeout=60).next_token_ids
        pipeline.release(1)
        pipeline.submit(_prefill(2, [1, 5, 9], context))
        assert pipeline.collect(timeout=60).next_token_ids == expected
    assert pipeline.micro_batches == (1, 1)
