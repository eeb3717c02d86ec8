"""`deskfleet bench serve`: the API against the service it drives, side by side, with the same texts in f32."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller.bench.serve import run_serve_bench
from deskfleet.controller.cli import main

F32 = CompileSettings(precision=Precision.F32)


def test_the_api_and_the_service_run_side_by_side_and_give_the_same_texts(tiny_export: Path) -> None:
    report = run_serve_bench(tiny_export, users=[1, 3], prompt_tokens=4, new_tokens=6, rounds=2, stages=2,
                             settings=F32, progress=False)
    assert set(report["users"]) == {"1", "3"} and report["stages"] == 2 and report["precision"] == "f32"
    for figures in report["users"].values():
        assert figures["texts_identical"] is True
        for variant in ("api", "direct"):
            assert len(figures[variant]["tok_s"]["samples"]) == 2 and figures[variant]["tok_s"]["median"] > 0
            assert figures[variant]["first_token_ms"]["median"] > 0
        assert figures["api_vs_direct_tok_s"] == pytest.approx(
            figures["api"]["tok_s"]["median"] / figures["direct"]["tok_s"]["median"], rel=1e-2)


def test_bench_serve_refuses_what_does_not_fit_before_anything_compiles(
        tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--model", str(tiny_export), "--new-tokens", "100000"]) == 2
    assert "do not fit the model's context" in capsys.readouterr().err
