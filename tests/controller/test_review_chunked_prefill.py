"""Review of chunked prefill: `bench admission` refuses, before anything compiles, a run whose streams stop
decoding before the newcomer's prompt is fed (its report would name a chunk size the run never used, or fail
after the whole bench had run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller.bench.admission import run_admission_bench

F32 = CompileSettings(precision=Precision.F32)


@pytest.mark.parametrize("new_tokens", [1, 10])
def test_running_streams_that_end_before_the_prompt_is_fed_are_refused(tiny_export: Path, new_tokens: int) -> None:
    """A 60-token prompt in chunks of 8 takes 8 calls after the running streams' 3rd step: they need 11 new
    tokens. With 10, its last chunk's stall went unmeasured; with 1 (no gap at all) the report failed on an
    empty max() once every round had run."""
    with pytest.raises(ValueError, match=rf"^--new-tokens {new_tokens} ends the running streams before the newcomer's "
                                         r"prompt is fed.*at least 11"):
        run_admission_bench(tiny_export, prompt_tokens=60, chunks=[0, 8], running=2, running_prompt_tokens=6,
                            new_tokens=new_tokens, arrival_step=3, rounds=1, settings=F32, progress=False)


def test_a_newcomer_arriving_with_the_running_streams_is_refused(tiny_export: Path) -> None:
    """At step 0 it arrives while nothing runs and is prefilled whole with them, whatever the chunk size."""
    with pytest.raises(ValueError, match="arrival_step and rounds must be at least 1"):
        run_admission_bench(tiny_export, prompt_tokens=60, chunks=[0, 8], running=2, running_prompt_tokens=6,
                            new_tokens=30, arrival_step=0, rounds=1, settings=F32, progress=False)
