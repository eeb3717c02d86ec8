"""generate's report after a failover names the chain the run finished on (it gave the first chain's stages)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller.engine import ChainBroken
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.run import GenerateOptions, run_generate
from tests.controller.test_engine_failover import BreakingChain

F32 = CompileSettings(precision=Precision.F32)


class StagedChain(BreakingChain):
    def __init__(self, pipeline: LocalPipeline, break_at: int | None, num_stages: int) -> None:
        super().__init__(pipeline, break_at)
        self.num_stages = num_stages


def test_after_a_failover_the_report_names_the_chain_the_run_finished_on(tiny_export: Path) -> None:
    options = GenerateOptions(model=tiny_export, prompt_ids=[[1, 5, 9]], max_new_tokens=8, ignore_eos=True,
                              settings=F32)
    with LocalPipeline(tiny_export, 2, F32) as first, LocalPipeline(tiny_export, 1, F32) as second:
        def recover(error: ChainBroken) -> StagedChain:
            return StagedChain(second, None, 1)

        report = run_generate(options, chain=StagedChain(first, 3, 2), chain_stages=2, recover=recover)
    with LocalPipeline(tiny_export, 2, F32) as whole:
        unbroken = run_generate(options, chain=StagedChain(whole, None, 2), chain_stages=2, recover=recover)
    assert report["stages"] == 1 and isinstance(report["failovers"], list) and len(report["failovers"]) == 1
    assert unbroken["stages"] == 2 and unbroken["failovers"] == []
    assert report["tokens"] == unbroken["tokens"]


def test_a_run_on_a_chain_of_pcs_drafts_as_over_the_fleet(tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller import decoding_options

    seen: list[bool] = []
    real = decoding_options.open_drafter

    def recording(*args: object, over_fleet: bool = False, **kwargs: object) -> object:
        seen.append(over_fleet)
        return real(*args, over_fleet=over_fleet, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(decoding_options, "open_drafter", recording)
    options = GenerateOptions(model=tiny_export, prompt_ids=[[1, 5, 9, 1, 5]], max_new_tokens=4, ignore_eos=True,
                              prompt_lookup=True, settings=F32)
    run_generate(options)
    with LocalPipeline(tiny_export, 2, F32) as chain:
        run_generate(options, chain=StagedChain(chain, None, 2), chain_stages=2)
    assert seen == [False, True]
