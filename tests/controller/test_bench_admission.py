"""`bench admission` on a tiny model: its JSON report, the same tokens at every chunk size in f32, and the inputs
it refuses; and `--prefill-chunk` as generate and chat parse it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller import cli
from deskfleet.controller.bench.admission import run_admission_bench
from deskfleet.controller.decoding_options import DecodingOptions
from deskfleet.controller.engine import DEFAULT_PREFILL_CHUNK

F32 = CompileSettings(precision=Precision.F32)


def test_the_report_compares_each_chunk_size_with_the_whole_prompt(tiny_export: Path) -> None:
    report = run_admission_bench(tiny_export, prompt_tokens=60, chunks=[0, 8, 8, 16], running=2,
                                 running_prompt_tokens=6, new_tokens=30, arrival_step=3, rounds=1, settings=F32,
                                 progress=False)
    json.dumps(report)
    assert list(report["chunks"]) == ["0", "8", "16"]  # a size given twice runs once
    assert report["streams_differing"] == {"8": [], "16": []}
    assert set(report["longest_gap_vs_whole_prompt"]) == {"8", "16"}
    for measures in report["chunks"].values():
        assert set(measures) == {"running_longest_gap_ms", "newcomer_first_token_ms", "running_decode_tok_s",
                                 "wall_s"}
        assert all(summary["median"] > 0 for summary in measures.values())
    assert report["newcomer_prompt_tokens"] == 60 and report["running_streams"] == 2


def test_bad_inputs_are_refused_before_anything_compiles(tiny_export: Path) -> None:
    with pytest.raises(ValueError, match="chunk sizes must be 0"):
        run_admission_bench(tiny_export, chunks=[0, -8])
    with pytest.raises(ValueError, match=r"--chunks 100 256 would feed .* prompt of 100 tokens in one call"):
        run_admission_bench(tiny_export, prompt_tokens=100, chunks=[0, 64, 100, 256])
    with pytest.raises(ValueError, match=r"do not fit the model's context of .*--prompt-tokens"):
        run_admission_bench(tiny_export, prompt_tokens=10**6)
    with pytest.raises(ValueError, match=r"do not fit the model's context of .*--new-tokens"):
        run_admission_bench(tiny_export, prompt_tokens=100, new_tokens=10**6)
    with pytest.raises(ValueError, match="at least 1"):
        run_admission_bench(tiny_export, running=0)


def test_prefill_chunk_is_parsed_and_a_negative_one_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "x", "--prefill-chunk", "32"])
    assert args.prefill_chunk == 32
    assert parser.parse_args(["chat", "--model", "m"]).prefill_chunk == DEFAULT_PREFILL_CHUNK == 256
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model", "m", "--prompt", "x", "--prefill-chunk", "-1"])
    assert "--prefill-chunk" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--prefill-chunk must be 0"):
        DecodingOptions(prefill_chunk=-1)
    assert DecodingOptions(prefill_chunk=32).engine_options(1).prefill_chunk == 32
