"""The speculative benchmark's pure parts and its JSON report on tiny random models."""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import DraftInfo
from deskfleet.controller.batch_track import BatchTrack
from deskfleet.controller.bench.speculative import (
    PROMPT_POOL_FILE,
    TimingChain,
    VariantStats,
    build_report,
    call_kind,
    heldout_code_prompts,
    heldout_prompt_pool,
    predicted_speedup,
    read_prompt_pool,
    run_speculative_bench,
    variant_drafter,
    variant_fixed_k,
    variant_names,
)
from deskfleet.controller.run import read_prompts_file

EVAL_DIR = Path(__file__).resolve().parents[2] / "assets" / "models" / "train"


def test_variant_names() -> None:
    assert variant_names([2, 4], adaptive=True) == ["plain", "k=2", "k=4", "adaptive"]
    assert variant_names([3], adaptive=False) == ["plain", "k=3"]
    assert variant_names([3], adaptive=True, lookup=True) == ["plain", "k=3", "adaptive", "lookup k=3",
                                                               "lookup adaptive", "lookup-first k=3",
                                                               "lookup-first adaptive"]
    assert variant_names([3], adaptive=False, draft_model=False, lookup=True) == ["plain", "lookup k=3"]
    names = ("plain", "k=3", "adaptive", "lookup k=12", "lookup adaptive", "lookup-first k=5", "lookup-first adaptive")
    assert [variant_fixed_k(name) for name in names] == [None, 3, None, 12, None, 5, None]
    assert [variant_drafter(name) for name in names] == [None, "draft model", "draft model", "prompt lookup",
                                                         "prompt lookup", "lookup first", "lookup first"]


def test_read_prompts_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("def f(x):\\n    \"\"\"Double.\"\"\"\n\n  \nclass A:\n", encoding="utf-8")
    assert read_prompts_file(path) == ['def f(x):\n    """Double."""', "class A:"]


def test_call_kind() -> None:
    import numpy as np

    track = BatchTrack(1, 64)
    track.add_row(0)
    assert call_kind(track.step([[1, 2, 3]])) == "prefill"
    assert call_kind(track.step([[4]])) == "plain"
    draft = DraftInfo((2,), np.array([[5, 6]], dtype=np.int64), None)
    assert call_kind(track.step([[4, 5, 6]], draft=draft)) == "verify"


def test_predicted_speedup() -> None:
    # 3 tokens per round for the price of 1.5 plain calls: 2x.
    assert predicted_speedup(2.0, 4, 0.010, 0.011, 0.001) == pytest.approx(2.0)
    assert predicted_speedup(0.0, 0, 0.01, 0.0, 0.0) == 0.0
    # One plain step per verified round (a lookup that found nothing): 4 tokens for 2.5 plain calls.
    assert predicted_speedup(2.0, 4, 0.010, 0.011, 0.001, plain_steps_per_round=1.0) == pytest.approx(1.6)


def test_timing_chain_counts_width_switches_between_decode_calls() -> None:
    import numpy as np

    class Echo:
        def __init__(self) -> None:
            self.sent: list[object] = []

        def submit(self, message: object) -> None:
            self.sent.append(message)

        def collect(self, timeout: float | None = None) -> object:
            return self.sent.pop(0)

    chain = TimingChain(Echo())
    chain.stats = VariantStats()
    track = BatchTrack(1, 64)
    track.add_row(0)
    draft = DraftInfo((2,), np.array([[5, 6]], dtype=np.int64), None)
    feeds = [([1, 2, 3], None), ([4], None), ([4, 5, 6], draft), ([4, 5, 6], draft), ([7], None), ([8], None),
             ([1, 2], None), ([4, 5, 6], draft)]  # the second prefill (T=2) resets: its switch is not counted
    for feed, info in feeds:
        chain.submit(track.step([feed], draft=info))
        chain.collect()
    # plain -> verify, verify -> plain, and after the second prefill nothing to compare with
    assert chain.stats.width_switches == 2
    assert chain.stats.target_calls == Counter({"plain": 3, "verify": 3, "prefill": 2})


def stats(tok_s: float, histogram: dict[int, int] | None = None) -> VariantStats:
    result = VariantStats(decoded_tokens=int(tok_s * 10), decode_s=10.0, generated_tokens=int(tok_s * 10) + 1,
                          wall_s=10.5, histogram=Counter(histogram or {}))
    result.target_calls.update({"plain": 10, "verify": 5})
    result.target_s.update({"plain": 0.1, "verify": 0.06})
    result.draft_tokens, result.draft_s = 10, 0.02
    return result


def test_build_report_shape() -> None:
    rounds = {"plain": [stats(10), stats(10)], "k=2": [stats(21, {2: 4, 0: 1}), stats(19, {1: 5})]}
    rounds["lookup k=2"] = [stats(14, {1: 3}), stats(16, {2: 2})]
    rounds["lookup-first k=2"] = [stats(17, {2: 3}), stats(18, {2: 2})]
    rounds["lookup-first k=2"][0].copied_rows, rounds["lookup-first k=2"][0].drafted_rows = 1, 3
    report = build_report(rounds, {"target": "t"})
    json.dumps(report)
    entry = report["speculative"]["k=2"]
    assert entry["speedup"]["ratio_of_medians"] == pytest.approx(2.0)
    assert entry["accepted_histogram"] == {"0": 1, "1": 5, "2": 4}
    assert entry["mean_accepted"] == pytest.approx(1.3)
    assert entry["profile"]["target_plain_ms_per_call"] == pytest.approx(10.0)
    assert entry["profile"]["target_verify_ms_per_call"] == pytest.approx(12.0)
    assert entry["profile"]["draft_over_target_cost"] == pytest.approx(0.2)
    assert report["best"] == {"variant": "k=2", "speedup": 2.0, "goal": ">= 2.0x", "goal_met": True}
    assert report["best_by_drafter"]["prompt lookup"] == {"variant": "lookup k=2", "speedup": 1.5,
                                                          "goal": ">= 2.0x", "goal_met": False}
    assert report["best_by_drafter"]["draft model"]["variant"] == "k=2"
    assert report["best_by_drafter"]["lookup first"]["speedup"] == pytest.approx(1.75)
    assert report["speculative"]["lookup-first k=2"]["copied_share_of_proposals"] == 0.25
    assert "copied_share_of_proposals" not in entry
    assert "switch_share_of_decode_calls" not in entry["profile"]  # no call costs measured


def test_build_report_prices_width_switches() -> None:
    rounds = {"plain": [stats(10)], "lookup k=2": [stats(14, {1: 3})]}
    rounds["lookup k=2"][0].width_switches = 4
    report = build_report(rounds, {"target_call_costs": {"switch_penalty_ms": 10.0}})
    entry = report["speculative"]["lookup k=2"]
    assert entry["width_switches"] == 4
    # 4 switches x 10 ms of the 0.16 s the decode calls took
    assert entry["profile"]["switch_share_of_decode_calls"] == pytest.approx(0.25)


@pytest.mark.skipif(not (EVAL_DIR / "evaluate.py").is_file(), reason="the demo model's evaluation is not here")
def test_heldout_code_prompts_are_function_heads() -> None:
    prompts = heldout_code_prompts(EVAL_DIR, 5)
    assert len(prompts) == 5 and all(p.lstrip().startswith(("def ", "async def ")) for p in prompts)
    assert prompts == heldout_code_prompts(EVAL_DIR, 5)  # the same pick every time


@pytest.mark.skipif(not (EVAL_DIR / "evaluate.py").is_file(), reason="the demo model's evaluation is not here")
def test_the_shipped_prompt_pool_is_what_evaluate_builds_from_the_corpus_python() -> None:
    pool, same = heldout_prompt_pool(EVAL_DIR, Path(sysconfig.get_paths()["stdlib"]))
    if not same:
        pytest.skip("this Python's held-out modules are not the corpus's (3.11.7): another pool")
    assert read_prompt_pool(EVAL_DIR / PROMPT_POOL_FILE) == pool, (
        "regenerate it: python -c 'import json, sysconfig; from pathlib import Path; from deskfleet.controller.bench"
        ".speculative import *; p = DEFAULT_EVAL_DIR / PROMPT_POOL_FILE; p.write_text(json.dumps(heldout_prompt_pool("
        "DEFAULT_EVAL_DIR, Path(sysconfig.get_paths()[\"stdlib\"]))[0], indent=1, ensure_ascii=False) + \"\\n\")'")


def test_the_prompt_pool_file_decides_the_prompts_on_any_python(tmp_path: Path) -> None:
    pool = [f"def f{index}():\n    \"\"\"Number {index}.\"\"\"\n" for index in range(10)]
    (tmp_path / PROMPT_POOL_FILE).write_text(json.dumps(pool))
    picked = heldout_code_prompts(tmp_path, 4)  # no evaluate.py here: the file alone
    assert len(picked) == 4 and set(picked) <= set(pool)
    with pytest.raises(ValueError, match=f"--prompts 11: the held-out set of {tmp_path} holds 10 prompts"):
        heldout_code_prompts(tmp_path, 11)  # it took all 10, unsaid
    (tmp_path / PROMPT_POOL_FILE).write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="not a JSON list of prompt strings"):
        heldout_code_prompts(tmp_path, 4)
    (tmp_path / PROMPT_POOL_FILE).write_text("[")
    with pytest.raises(ValueError, match=f"cannot read the prompt pool .*{PROMPT_POOL_FILE}"):
        heldout_code_prompts(tmp_path, 4)


def test_speculative_bench_on_tiny_models(checkpoint_factory: Callable[..., Path],
                                          export_factory: Callable[[Path, str], Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    target = export_factory(checkpoint_factory("spec-bench-target", num_hidden_layers=2), "f32")
    draft = export_factory(checkpoint_factory("spec-bench-draft", num_hidden_layers=1), "f32")
    report = run_speculative_bench(target, draft, ks=[2], adaptive=True, lookup=True, k_max=3,
                                   prompt_ids=[[1, 5, 9, 13], [1, 40, 41]], new_tokens=6, rounds=2,
                                   settings=CompileSettings(precision=Precision.F32), progress=True)
    json.dumps(report)
    names = ["plain", "k=2", "adaptive", "lookup k=2", "lookup adaptive", "lookup-first k=2", "lookup-first adaptive"]
    assert report["order"] == names
    progress = [line.split(" tok/s")[0].split(" ", 2) for line in capsys.readouterr().err.splitlines()
                if line.startswith("round ")]
    for index in (1, 2):  # each timed round starts one variant further along (round 0 warmed up)
        ran = [name.rsplit(":", 1)[0] for label, number, name in progress if number == f"{index}/2"]
        assert ran == names[index:] + names[:index]
    assert report["greedy_identical_to_plain"] == {name: True for name in report["order"][1:]}
    assert set(report["speculative"]) == set(report["order"][1:])
    entry = report["speculative"]["k=2"]
    assert entry["mean_k"] == pytest.approx(2.0, abs=1.0)
    assert sum(entry["accepted_histogram"].values()) == entry["verifications"] > 0
    assert report["best"]["goal_met"] in (True, False)
    costs = report["target_call_costs"]
    assert set(costs["steady_ms"]) == set(costs["alternating_ms"]) == {"1", "3", "4"}  # 1, k+1, k_max+1
    assert all(value > 0 for value in costs["steady_ms"].values())
    assert isinstance(costs["switch_penalty_ms"], float)


def test_widths_whose_timing_outgrows_the_context_are_refused_before_any_run(
        checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> None:
    target = export_factory(checkpoint_factory("spec-bench-target", num_hidden_layers=2), "f32")
    context = load_manifest(target).spec.max_context
    k = 64  # 8 timed calls of 65 tokens, after the prefill: more than the test model's 512 slots
    assert 8 * (k + 1) > context
    with pytest.raises(ValueError, match=f"more than the model's context {context}: give smaller --k"):
        run_speculative_bench(target, None, ks=[k], adaptive=False, prompt_ids=[[1, 2]], new_tokens=2)


def test_more_prompts_than_given_are_refused_naming_how_many_there_are(
        checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> None:
    # `--prompts 999` took every prompt there was (161 held out; a file's 5), unsaid
    target = export_factory(checkpoint_factory("spec-bench-target", num_hidden_layers=2), "f32")
    with pytest.raises(ValueError, match=r"--prompts 3: there are only 2 \(prompts file\)"):
        run_speculative_bench(target, None, prompts=["def f():", "def g():"], num_prompts=3, new_tokens=2)
    with pytest.raises(ValueError, match=r"--prompts 3: there are only 2 \(prompt_ids\)"):
        run_speculative_bench(target, None, prompt_ids=[[1, 2], [1, 3]], num_prompts=3, new_tokens=2)


def test_a_bench_with_nothing_to_compare_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to compare"):
        run_speculative_bench(tmp_path, None, lookup=False)
    with pytest.raises(ValueError, match="no speculative variant"):
        run_speculative_bench(tmp_path, tmp_path, ks=[], adaptive=False)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"ks": [0], "adaptive": False}, r"--k values must be 1 or more, got \[0\]"),
    ({"ks": [2, -1]}, r"--k values must be 1 or more"),
    ({"k_max": -1}, "--k-max must be 1 or more, got -1"),
    ({"k_max": 0}, "--k-max must be 1 or more, got 0"),
    ({"rounds": 0}, "--rounds must be 1 or more, got 0"),
    ({"new_tokens": 0}, "--new-tokens must be 2 or more"),
    ({"new_tokens": 1}, "--new-tokens must be 2 or more, got 1"),  # a ZeroDivisionError once every round had run
    ({"num_prompts": 0}, "--prompts must be 1 or more"),
    ({"ks": [2, 65]}, r"--k values must be at most 64, got \[2, 65\]"),
    ({"k_max": 10**9}, "--k-max must be at most 64, got 1000000000"),
])
def test_counts_that_would_time_nothing_or_mislabel_a_variant_are_refused(tmp_path: Path,
                                                                        arguments: dict[str, object],
                                                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):  # before the target (here no export) is opened
        run_speculative_bench(tmp_path, tmp_path, **arguments)  # type: ignore[arg-type]


def test_the_default_prompts_are_found_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller.bench.speculative import DEFAULT_EVAL_DIR

    monkeypatch.chdir(tmp_path)  # `bench speculative` run outside the repo root failed: "pass --prompts-file"
    assert DEFAULT_EVAL_DIR == EVAL_DIR and heldout_code_prompts(DEFAULT_EVAL_DIR, 3)
