"""The streams benchmark's pure parts and its JSON report on a tiny model (no GenAI)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.bench.streams import (
    UsersRun,
    build_report,
    kv_bytes_per_token,
    per_extra_stream,
    pick_core,
    run_streams_bench,
    user_prompts,
)


def test_user_prompts_are_fixed_per_user() -> None:
    two = user_prompts(512, 2, 8, bos_token_id=1)
    four = user_prompts(512, 4, 8, bos_token_id=1)
    assert four[:2] == two and len({tuple(p) for p in four}) == 4
    assert all(len(p) == 8 and p[0] == 1 for p in four)


def test_per_extra_stream_and_kv_bytes(tiny_export: Path) -> None:
    assert per_extra_stream({1: 100, 2: 150, 4: 250, 8: 450}) == pytest.approx(50.0)
    assert per_extra_stream({1: 100}) is None
    spec = load_manifest(tiny_export).spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
    assert kv_bytes_per_token(load_manifest(tiny_export), "f32") == 4 * per_token
    assert kv_bytes_per_token(load_manifest(tiny_export), "u8") == per_token


def test_pick_core() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert pick_core(None) == allowed[-1]
    assert pick_core(allowed[0]) == allowed[0]
    with pytest.raises(ValueError, match=rf"^--core 10000 is not a core this process may run on \(it may run on "
                                         rf"{', '.join(map(str, allowed))}\)$"):
        pick_core(10_000)


def run(tok_s: float, users: int, rss: int = 0) -> UsersRun:
    return UsersRun([[1] * 10] * users, users * 10 / tok_s, [0.1] * users, rss)


def test_build_report_shape_and_goal() -> None:
    timed = {"deskfleet": {1: [run(10, 1), run(12, 1)], 2: [run(20, 2), run(18, 2)]},
             "genai": {1: [run(11, 1), run(11, 1)], 2: [run(15, 2), run(15, 2)]}}
    memory = {"deskfleet": {1: 100 * 2**20, 2: 110 * 2**20}, "genai": {1: 200 * 2**20, 2: 230 * 2**20}}
    report = build_report(timed, memory, {"model": "m"})
    json.dumps(report)
    assert report["users"]["1"]["deskfleet_vs_genai"]["ratio_of_medians"] == pytest.approx(1.0)
    assert report["users"]["1"]["goal_met"] is True
    assert report["users"]["2"]["deskfleet_vs_genai"]["ratio_of_medians"] == pytest.approx(19 / 15, abs=1e-3)
    assert report["goal_met"] is True
    assert report["deskfleet_scaling_vs_1_user"]["2"] == pytest.approx(19 / 11, abs=1e-3)
    assert report["memory"]["rss_per_extra_stream_mb"] == {"deskfleet": 10.0, "genai": 30.0}
    timed["genai"][1] = [run(13, 1), run(13, 1)]
    assert build_report(timed, memory, {})["goal_met"] is False


def test_streams_bench_on_a_tiny_model_without_genai(tiny_export: Path) -> None:
    before = os.sched_getaffinity(0)
    report = run_streams_bench(tiny_export, users=[1, 2, 3], prompt_tokens=5, new_tokens=4, rounds=2,
                               settings=CompileSettings(precision=Precision.F32), progress=False)
    assert os.sched_getaffinity(0) == before  # the pin is undone
    json.dumps(report)
    assert report["compiled_properties"]["INFERENCE_NUM_THREADS"] == "1"
    assert set(report["users"]) == {"1", "2", "3"}
    for entry in report["users"].values():
        assert len(entry["tok_s"]["deskfleet"]["samples"]) == 2 and "genai" not in entry["tok_s"]
    assert report["goal_met"] is None
    assert set(report["memory"]["peak_rss_mb"]["deskfleet"]) == {"1", "2", "3"}
    assert report["kv_bytes_per_stream"]["kv_cache_precision"] == "f32"


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"genai_model": Path("/nonexistent")}, FileNotFoundError, "--genai-model /nonexistent: no such folder"),
    ({"genai_model": Path(__file__)}, FileNotFoundError, "--genai-model .*: not a folder"),
    ({"genai_model": Path("."), "genai_python": Path("/nonexistent/python")}, FileNotFoundError,
     "--genai-python /nonexistent/python"),
    ({"rounds": 0}, ValueError, "--rounds must be 1 or more, got 0"),
    ({"new_tokens": 0}, ValueError, "--new-tokens must be 1 or more"),
    ({"prompt_tokens": 0}, ValueError, "--prompt-tokens must be 1 or more"),
    ({"users": [1, 0]}, ValueError, "--users values must be 1 or more"),
    ({"settings": CompileSettings(num_threads=4)}, ValueError, "--threads 4: this bench runs one inference thread"),
])
def test_streams_bench_checks_its_arguments_before_the_memory_pass(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch, arguments: dict[str, object], error: type[Exception],
        message: str) -> None:
    from deskfleet.controller.bench import streams

    def never_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("deskfleet's users ran although the arguments are wrong")

    monkeypatch.setattr(streams, "DeskfleetUsers", never_run)
    before = os.sched_getaffinity(0)
    with pytest.raises(error, match=message):
        run_streams_bench(tiny_export, progress=False, **arguments)  # type: ignore[arg-type]
    assert os.sched_getaffinity(0) == before
