"""The parity benchmark's pure parts (statistics, interleaving, report shape) and a tiny run without GenAI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller.bench.parity import (
    DESKFLEET_RUNNER,
    IsolatedVariant,
    RunRecord,
    _genai_properties,
    bench_prompt,
    build_report,
    compare,
    first_divergence,
    genai_variant_name,
    interleaved_order,
    run_parity_bench,
    run_rounds,
    summarize,
)


class FakeVariant:
    def __init__(self, name: str, speeds: list[float], log: list[str], tokens: tuple[int, ...] = (5, 6, 7)) -> None:
        self.name = name
        self.speeds = list(speeds)
        self.log = log
        self.tokens = tokens
        self.closed = False

    def run(self) -> RunRecord:
        self.log.append(self.name)
        return RunRecord(self.speeds.pop(0), self.tokens, 0.1)

    def close(self) -> None:
        self.closed = True


def test_summarize_reports_median_and_spread() -> None:
    stats = summarize([10.0, 12.0, 11.0, 9.0, 30.0])
    assert stats["median"] == 11.0
    assert stats["min"] == 9.0 and stats["max"] == 30.0
    assert stats["spread_pct"] == pytest.approx(100 * 21 / 11, abs=0.01)
    assert stats["samples"] == [10.0, 12.0, 11.0, 9.0, 30.0]
    with pytest.raises(ValueError):
        summarize([])


def test_compare_gives_ratio_of_medians_and_paired_ratios() -> None:
    result = compare([10.0, 20.0, 12.0], [10.0, 10.0, 12.0])
    assert result["ratio_of_medians"] == pytest.approx(12.0 / 10.0)
    assert result["paired_median"] == 1.0
    assert result["paired_min"] == 1.0 and result["paired_max"] == 2.0
    with pytest.raises(ValueError):
        compare([1.0], [1.0, 2.0])


def test_interleaved_order_starts_each_round_one_variant_further_along() -> None:
    assert interleaved_order(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert [name for _, name in interleaved_order(["a", "b", "c"], 3)] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [name for _, name in interleaved_order(["a", "b"], 2, after=1)] == ["b", "a", "a", "b"]
    with pytest.raises(ValueError):
        interleaved_order(["a", "a"], 1)
    with pytest.raises(ValueError):
        interleaved_order(["a"], 0)


def test_run_rounds_warms_up_then_interleaves() -> None:
    log: list[str] = []
    variants = [FakeVariant("deskfleet-1", [0.0, 10.0, 11.0], log), FakeVariant("genai", [0.0, 9.0, 10.0], log)]
    records = run_rounds(variants, rounds=2, warmup=1)
    assert log == ["deskfleet-1", "genai", "genai", "deskfleet-1", "deskfleet-1", "genai"]  # warm-up A B: B A, A B
    assert [record.decode_tok_s for record in records["deskfleet-1"]] == [10.0, 11.0]  # warm-up dropped
    assert [record.decode_tok_s for record in records["genai"]] == [9.0, 10.0]


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_bench_prompt_is_fixed_and_in_range() -> None:
    prompt = bench_prompt(512, 32, bos_token_id=1)
    assert prompt == bench_prompt(512, 32, bos_token_id=1)
    assert len(prompt) == 32 and prompt[0] == 1
    assert all(3 <= token < 512 for token in prompt[1:])
    with pytest.raises(ValueError):
        bench_prompt(512, 0, None)


def test_genai_properties_carry_deskfleet_settings_and_backend() -> None:
    compiled = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": "2",
                "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}
    assert _genai_properties(compiled, "default") == {
        "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": "2",
        "PERFORMANCE_HINT": "LATENCY"}
    assert _genai_properties(compiled, "SDPA")["ATTENTION_BACKEND"] == "SDPA"
    assert genai_variant_name("default") == "genai"
    assert genai_variant_name("SDPA") == "genai-sdpa"


def test_build_report_shape() -> None:
    log: list[str] = []
    variants = [FakeVariant("deskfleet-1", [10.0, 10.0, 12.0], log),
                FakeVariant("genai", [10.0, 8.0, 10.0], log, tokens=(5, 6, 8)),
                FakeVariant("genai-sdpa", [11.0, 11.0, 11.0], log),
                FakeVariant("fused-direct", [10.0, 10.0, 10.0], log),
                FakeVariant("whole-direct", [10.0, 10.0, 10.0], log),
                FakeVariant("deskfleet-2", [9.0, 9.0, 9.0], log)]
    records = run_rounds(variants, rounds=2)
    report = build_report(records, [2], {"model": "m"})
    json.dumps(report)  # JSON-able
    assert report["model"] == "m"
    assert set(report["decode_tok_s"]) == {variant.name for variant in variants}
    assert report["deskfleet_vs_genai"]["genai"]["ratio_of_medians"] == pytest.approx(11.0 / 9.0, abs=1e-4)
    fastest = report["deskfleet_vs_fastest_genai"]
    assert fastest["genai"] == "genai-sdpa" and fastest["ratio_of_medians"] == pytest.approx(1.0)
    assert report["stages_vs_1"]["2"]["ratio_of_medians"] == pytest.approx(9.0 / 11.0, abs=1e-4)
    assert report["stages_vs_1"]["2"]["cost_pct"] == pytest.approx(100 * (1 - 9.0 / 11.0), abs=0.01)
    assert set(report["breakdown"]) == {"pipeline_vs_direct (deskfleet-1 / fused-direct)",
                                        "fused_vs_whole (fused-direct / whole-direct)",
                                        "python_loop_vs_genai_sdpa (whole-direct / genai-sdpa)"}
    assert report["tokens_match_deskfleet_1"]["genai"] is False
    assert report["first_divergence_from_deskfleet_1"] == {"genai": 2}


def test_parity_bench_on_a_tiny_model_without_genai(tiny_export: Path) -> None:
    settings = CompileSettings(precision=Precision.F32, num_threads=1)
    report = run_parity_bench(tiny_export, prompt_tokens=5, new_tokens=6, rounds=2, stage_counts=[1, 2],
                              settings=settings, isolation="shared", progress=False)
    json.dumps(report)
    assert report["order"] == ["deskfleet-1", "fused-direct", "deskfleet-2"]
    assert report["compiled_properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert report["compiled_properties"]["INFERENCE_NUM_THREADS"] == "1"
    assert all(len(stats["samples"]) == 2 and stats["median"] > 0 for stats in report["decode_tok_s"].values())
    assert "deskfleet_vs_genai" not in report
    assert set(report["stages_vs_1"]) == {"2"}
    # f32: the fused stage run directly and the 2-stage pipeline compute the same tokens as 1 stage.
    assert report["tokens_match_deskfleet_1"] == {"fused-direct": True, "deskfleet-2": True}


@pytest.mark.slow
def test_parity_bench_in_fresh_processes_on_a_tiny_model(tiny_export: Path) -> None:
    settings = CompileSettings(precision=Precision.F32, num_threads=1)
    report = run_parity_bench(tiny_export, prompt_tokens=5, new_tokens=6, rounds=2, stage_counts=[2],
                              settings=settings, huge_pages_ablation=True, progress=False)
    json.dumps(report)
    assert report["isolation"] == "process"
    assert report["order"] == ["deskfleet-1", "deskfleet-1-4k-pages", "fused-direct", "deskfleet-2"]
    # deskfleet-1's settings come from its own process, loaded once before the rounds
    assert report["compiled_properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert report["compiled_properties"]["INFERENCE_NUM_THREADS"] == "1"
    assert all(len(stats["samples"]) == 2 and stats["median"] > 0 for stats in report["decode_tok_s"].values())
    assert "huge_pages (deskfleet-1 / deskfleet-1-4k-pages)" in report["breakdown"]
    assert report["tokens_match_deskfleet_1"] == {"deskfleet-1-4k-pages": True, "fused-direct": True,
                                                  "deskfleet-2": True}


def test_isolated_variant_reports_a_runner_that_fails_to_load(tiny_export: Path, tmp_path: Path) -> None:
    variant = IsolatedVariant("deskfleet-1", DESKFLEET_RUNNER, None,
                              {"variant": "deskfleet", "model": str(tmp_path / "missing"), "prompt_ids": [1, 2],
                               "new_tokens": 2})
    with pytest.raises(RuntimeError, match=r"parity_runner\.py.*missing"):
        variant.run()


def test_parity_bench_rejects_an_unknown_isolation_and_a_shared_ablation(tiny_export: Path) -> None:
    with pytest.raises(ValueError, match="isolation"):
        run_parity_bench(tiny_export, isolation="thread", progress=False)
    with pytest.raises(ValueError, match="process isolation"):
        run_parity_bench(tiny_export, isolation="shared", huge_pages_ablation=True, progress=False)


def never_start(*args: object, **kwargs: object) -> None:
    raise AssertionError("a runner started although the arguments are wrong")


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"stage_counts": [2, 0]}, ValueError, "--stages 0: a stage count must be between 1 and the model's 4 layers"),
    ({"stage_counts": [100]}, ValueError, "--stages 100: .* the model's 4 layers"),
    ({"new_tokens": 0}, ValueError, "--new-tokens must be 2 or more, got 0"),
    ({"new_tokens": 1}, ValueError, "--new-tokens must be 2 or more, got 1"),  # the runner failed, after the parse
    ({"prompt_tokens": 0}, ValueError, "--prompt-tokens must be 1 or more, got 0"),
    ({"rounds": 0}, ValueError, "--rounds must be 1 or more, got 0"),
    ({"genai_python": Path("/nonexistent/python")}, FileNotFoundError, "--genai-python /nonexistent/python"),
    ({"genai_model": Path("/nonexistent")}, FileNotFoundError, "--genai-model /nonexistent"),
])
@pytest.mark.parametrize("isolation", ["process", "shared"])
def test_parity_bench_checks_its_arguments_before_any_variant(tiny_export: Path, monkeypatch: pytest.MonkeyPatch,
                                                              arguments: dict[str, object], error: type[Exception],
                                                              message: str, isolation: str) -> None:
    from deskfleet.controller.bench import parity

    monkeypatch.setattr(parity, "RunnerProcess", never_start)
    monkeypatch.setattr(parity, "LocalPipeline", never_start)
    monkeypatch.setattr(parity, "FusedDirectVariant", never_start)
    with pytest.raises(error, match=message):
        run_parity_bench(tiny_export, isolation=isolation, progress=False, **arguments)  # type: ignore[arg-type]


def test_genai_backends_without_a_genai_model_is_refused(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the bench ran ~30 s without any GenAI variant and said nothing of the option
    from deskfleet.controller.cli import main

    assert main(["bench", "parity", "--model", str(tiny_export), "--genai-backends", "PA"]) == 2
    assert "--genai-backends needs --genai-model" in capsys.readouterr().err
