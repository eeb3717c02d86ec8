"""The fleet benchmark's pure parts: core split, which PC runs where, configurations, rows and report."""

from __future__ import annotations

import contextlib
import json
import re
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import RoundCost
from deskfleet.controller.bench import fleet as fleet_module
from deskfleet.controller.bench.fleet import (
    GENAI_GROUP,
    WAN_GROUP,
    FleetBenchOptions,
    _Config,
    _run_config,
    _run_rounds,
    agent_layout,
    bench_configs,
    bench_groups,
    build_report,
    check_inputs,
    fleet_rows,
    render_markdown,
    run_fleet_bench,
    split_cores,
    steady_rate,
)
from deskfleet.controller.cli import main
from deskfleet.controller.engine import EngineTimings

MODEL, TARGET, DRAFT = Path("m"), Path("t"), Path("d")


def options(max_pcs: int = 2, demo: bool = True, controller_cores: int = 0) -> FleetBenchOptions:
    return FleetBenchOptions(MODEL, TARGET if demo else None, DRAFT if demo else None, max_pcs=max_pcs,
                             controller_cores=controller_cores)


def test_split_cores_reserves_the_first_cores_for_the_controller() -> None:
    assert split_cores(range(16), 4, 2) == ([0, 1], list(range(2, 16)))
    assert split_cores([3, 5], 2, 0) == ([], [3, 5])


def test_pcs_of_several_threads_get_a_core_per_thread() -> None:
    assert split_cores(range(10), 4, 2, cores_per_pc=2) == ([0, 1], list(range(2, 10)))
    with pytest.raises(RuntimeError, match="2 simulated PCs of 2 core\\(s\\) need 4 cores"):
        split_cores(range(4), 2, 1, cores_per_pc=2)
    groups = bench_groups(options(3))
    layout = agent_layout(groups, list(range(2, 8)), cores_per_pc=2)
    assert layout["mono"] == (2, 3) and layout["mono-b"] == (4, 5)
    assert [layout[name] for name in groups["trio"][1]] == [(2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize(("cores", "pcs", "controller", "message"), [
    (range(2), 2, 1, "2 simulated PCs of 1 core\\(s\\) need 2 cores"),
    (range(4), 4, 1, "4 simulated PCs of 1 core\\(s\\) need 4 cores"),
    (range(8), 5, 0, "between 2 and 4"),
    (range(8), 2, -1, "0 or more"),
])
def test_split_cores_refuses_what_cannot_be_pinned(cores: range, pcs: int, controller: int, message: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=message):
        split_cores(cores, pcs, controller)


@pytest.mark.parametrize("max_pcs", [2, 3, 4])
def test_every_group_runs_its_pcs_on_distinct_cores(max_pcs: int) -> None:
    groups = bench_groups(options(max_pcs))
    layout = agent_layout(groups, [10, 11, 12, 13])
    for group, (model, names) in groups.items():
        assert model == (TARGET if group.startswith("demo") or group == WAN_GROUP else MODEL)
        assert len({layout[name] for name in names}) == len(names), group
    assert {layout["mono"], layout["mono-b"]} == {(10,), (11,)}  # the two copies run at once
    assert sorted(len(names) for group, (model, names) in groups.items() if model == MODEL) == \
        [1, 1, *range(2, max_pcs + 1)]
    assert groups[WAN_GROUP] == (TARGET, ["wan0", "wan1"])  # the only PCs behind delay proxies


@pytest.mark.parametrize(("max_pcs", "demo"), [(2, False), (2, True), (3, True), (4, True)])
def test_every_config_runs_on_a_deployed_group_with_every_user_served(max_pcs: int, demo: bool) -> None:
    groups = bench_groups(options(max_pcs, demo))
    configs = bench_configs(options(max_pcs, demo))
    assert len({config.key for config in configs}) == len(configs)
    for config in configs:
        if config.group == GENAI_GROUP:
            continue  # GenAI's pipeline, no deployment
        assert config.group in groups, config.key
        pcs = len(groups[config.group][1])
        assert config.one_at_a_time or config.max_rows * config.micro_batches >= config.streams, config.key
        if pcs > 1 and config.streams >= pcs:
            assert config.micro_batches == pcs, config.key  # every stage has a micro-batch to work on


def test_with_four_pcs_the_demo_pair_and_genai_every_row_is_measured() -> None:
    everything = FleetBenchOptions(MODEL, TARGET, DRAFT, max_pcs=4, genai_model=Path("g"))
    configs = {config.key for config in bench_configs(everything)}
    for row in fleet_rows(4):
        assert row.config in configs, row.title
        baselines = (row.baseline,) if isinstance(row.baseline, str) else row.baseline or ()
        assert all(baseline in configs for baseline in baselines), row.title


def test_the_honest_baseline_is_the_faster_one_pc_server() -> None:
    with_genai = FleetBenchOptions(MODEL, genai_model=Path("g"))
    configs = bench_configs(with_genai)
    speed = {"mono_1": 10.0, "mono_8": 40.0, "genai_8": 50.0, "pair_8": 70.0, "mono_2": 18.0, "genai_2": 16.0,
             "pair_2": 19.0}
    for config in configs:
        config.runs.append({"tok_s": speed.get(config.key, 10.0), "mean_accepted": 0.0, "final_k": 0.0})
    rows = {row["row"]: row for row in build_report(with_genai, configs, [], [0, 1])["rows"]}
    faster_8 = rows["2 PCs vs the faster 1 PC (deskfleet batching or GenAI CB), 8 users"]
    assert faster_8["baseline"] == "genai_8" and faster_8["ratio"] == pytest.approx(70 / 50, abs=1e-3)
    faster_2 = rows["2 PCs vs the faster 1 PC (deskfleet batching or GenAI CB), 2 users"]
    assert faster_2["baseline"] == "mono_2" and faster_2["ratio"] == pytest.approx(19 / 18, abs=1e-3)
    plain_configs = bench_configs(options(2, demo=False))
    for config in plain_configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 0.0, "final_k": 0.0})
    without = {row["row"]: row for row in build_report(options(2, demo=False), plain_configs, [], [0, 1])["rows"]}
    assert without["2 PCs vs the faster 1 PC (deskfleet batching or GenAI CB), 8 users"]["note"] == \
        "not run: no --genai-model"


def test_report_ratios_and_the_rows_left_unrun() -> None:
    configs = bench_configs(options(2, demo=False))
    speed = {"mono_1": 10.0, "pair_1": 9.5, "pair_2": 19.0, "copies_2": 20.0, "mono_8": 40.0, "pair_8": 70.0}
    for config in configs:
        for jitter in (0.9, 1.0, 1.1):
            config.runs.append({"tok_s": speed.get(config.key, 10.0) * jitter, "mean_accepted": 0.0, "final_k": 0.0})
    report = build_report(options(2, demo=False), configs, [0], [1, 2])
    rows = {row["row"]: row for row in report["rows"]}
    assert rows["2 PCs, 1 stream"]["ratio"] == pytest.approx(0.95)
    assert rows["2 PCs, 2 streams vs two 1-PC copies"]["ratio"] == pytest.approx(0.95)
    assert rows["2 PCs vs 1 PC serving the same 8 users"]["ratio"] == pytest.approx(1.75)
    assert rows["2 PCs, 8 users (batched micro-batches)"]["tok_s"] == {"median": 70.0, "min": 63.0, "max": 77.0}
    assert rows["3 PCs, 3 streams + speculative (draft model)"]["ratio"] is None
    assert "--demo-target" in rows["3 PCs, 3 streams + speculative (draft model)"]["note"]
    assert report["machine"]["controller_cores"] == [0] and report["machine"]["pc_cores"] == [1, 2]
    assert report["machine"]["event_loop"] in {"uvloop", "asyncio"}
    assert report["host"]["cpu"] and "cpu_extensions" in report["host"]
    table = render_markdown(report)
    assert "| 2 PCs, 1 stream | 0.67x | >= 0.95x | 0.95x | 9.5 (8.6-10.4) |" in table
    assert "| 2.64x | >= 4.0x | not run: no --demo-target | - |" in table  # it said "not run", not why


def test_the_users_rows_report_where_a_free_split_would_land() -> None:
    # Two PCs serving N users can at best match two 1-PC servers of N/2 users each: with one PC's batching
    # at 10 / 18 / 30 / 44 tok/s for 1 / 2 / 4 / 8 users, 8 users on 2 PCs cannot pass 2 x 30 / 44 = 1.36x.
    configs = bench_configs(options(2, demo=False))
    speed = {"mono_1": 10.0, "mono_2": 18.0, "mono_4": 30.0, "mono_8": 44.0, "pair_2": 17.0, "pair_4": 33.0,
             "pair_8": 52.0}
    for config in configs:
        config.runs.append({"tok_s": speed.get(config.key, 10.0), "mean_accepted": 0.0, "final_k": 0.0})
    report = build_report(options(2, demo=False), configs, [], [0, 1])
    rows = {row["row"]: row for row in report["rows"]}
    assert rows["2 PCs vs 1 PC serving the same 8 users"]["ideal_split"] == pytest.approx(2 * 30 / 44, abs=1e-3)
    assert rows["2 PCs vs 1 PC serving the same 4 users"]["ideal_split"] == pytest.approx(2 * 18 / 30, abs=1e-3)
    assert rows["2 PCs vs 1 PC serving the same 2 users"]["ideal_split"] == pytest.approx(2 * 10 / 18, abs=1e-3)
    assert rows["2 PCs, 8 users (batched micro-batches)"]["ideal_split"] == pytest.approx(2 * 30 / 10, abs=1e-3)
    assert "ideal_split" not in rows["2 PCs, 1 stream"]
    assert "| 2 PCs vs 1 PC serving the same 8 users | - | >= 1.6x | 1.18x (ideal split 1.36x) |" \
        in render_markdown(report)


def test_a_row_whose_group_ran_on_fewer_pcs_says_so() -> None:
    configs = bench_configs(options(3))
    for config in configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 0.0, "final_k": 0.0})
    deployments = {"demo_trio": {"pcs": 3, "stages": 2, "layers": [[0, 5], [5, 8]]},
                   "trio": {"pcs": 3, "stages": 3, "layers": [[0, 1], [1, 2], [2, 4]]}}
    report = build_report(options(3), configs, [], [0, 1, 2], deployments)
    rows = {row["row"]: row for row in report["rows"]}
    assert rows["3 PCs, 3 streams + speculative (draft model)"]["note"] == "the plan used 2 of its 3 PCs"
    assert "note" not in rows["3 PCs, 3 streams"]
    assert "1.00x (the plan used 2 of its 3 PCs)" in render_markdown(report)
    assert report["deployments"] == deployments


def test_without_a_draft_model_the_wan_row_runs_undrafted_and_lookup_rows_remain() -> None:
    no_draft = FleetBenchOptions(MODEL, TARGET, None)
    configs = {config.key: config for config in bench_configs(no_draft)}
    assert configs["wan_full"].drafter is None
    assert configs["demo_pair_2_lookup"].drafter == "lookup" and "demo_pair_2_spec" not in configs
    assert "demo_pair_2_first" not in configs  # prompt lookup first needs the draft model for the rest


def test_with_a_draft_model_each_drafting_row_runs_with_each_drafter() -> None:
    configs = {config.key: config for config in bench_configs(options(3))}
    for group, pcs in (("pair", 2), ("trio", 3)):
        for suffix in ("spec", "lookup", "first"):
            assert configs[f"demo_{group}_{pcs}_{suffix}"].drafter == suffix
            assert configs[f"demo_mono_{pcs}_{suffix}"].drafter == suffix
    assert configs["wan_full"].drafter == "spec"


def test_prompt_lookup_first_drafts_with_both_the_model_and_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each drafter opens what its rows are named after: a drafter opened without the model (or without lookup)
    # would still run, and its rows would measure another drafter under this one's name.
    opened: list[tuple[Path | None, bool]] = []

    def fake_open(draft: Path | None, prompt_lookup: bool, **kwargs: object) -> None:
        opened.append((draft, prompt_lookup))
        raise RuntimeError("opened")

    monkeypatch.setattr(fleet_module, "open_drafter", fake_open)
    fleet = SimpleNamespace(store=SimpleNamespace(tls_files=None))
    for drafter in ("spec", "lookup", "first"):
        config = _Config(f"demo_pair_2_{drafter}", "demo_pair", 2, 1, 2, drafter=drafter)
        with pytest.raises(RuntimeError, match="opened"):
            _run_config(fleet, {"demo_pair": ()}, config, options(2), {})  # type: ignore[arg-type]
    assert opened == [(DRAFT, False), (None, True), (DRAFT, True)]


def test_without_a_throughput_model_only_the_drafting_and_wan_rows_run() -> None:
    drafting_only = FleetBenchOptions(None, TARGET, DRAFT, max_pcs=3)
    configs = bench_configs(drafting_only)
    assert configs and all(config.group.startswith("demo_") or config.group == WAN_GROUP for config in configs)
    assert all(model == TARGET for model, _ in bench_groups(drafting_only).values())
    for config in configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 0.0, "final_k": 0.0})
    rows = {row["row"]: row for row in build_report(drafting_only, configs, [], [0, 1, 2])["rows"]}
    assert rows["2 PCs, 1 stream"]["note"] == "not run: no --model"
    assert rows["3 PCs, 3 streams + speculative (lookup first)"]["ratio"] == 1.0
    assert rows["100 ms per hop, full stack vs naive pipeline (drafting pair)"]["ratio"] == 1.0
    with pytest.raises(ValueError, match=r"give --model .*, --demo-target .*, or both"):
        FleetBenchOptions(None)


def test_genai_rows_without_a_throughput_model_are_refused_before_any_pc_starts() -> None:
    with pytest.raises(ValueError, match="--genai-model needs --model"):
        check_inputs(FleetBenchOptions(None, TARGET, genai_model=Path("g")))
    # and a report without --model says that is what its GenAI rows lacked, not --genai-model
    rows = {row["row"]: row for row in build_report(FleetBenchOptions(None, TARGET), [], [], [0, 1])["rows"]}
    assert rows["1 PC, 2 users, OpenVINO GenAI continuous batching (no network)"]["note"] == "not run: no --model"
    assert rows["2 PCs vs the faster 1 PC (deskfleet batching or GenAI CB), 8 users"]["note"] == "not run: no --model"


def test_a_kv_cache_without_the_drafting_rows_is_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match="--kv-cache needs --demo-target"):
        check_inputs(FleetBenchOptions(MODEL, drafting_kv_cache="f32"))


def test_a_full_stack_row_run_without_a_draft_model_says_so() -> None:
    no_draft = FleetBenchOptions(MODEL, TARGET, None)
    configs = bench_configs(no_draft)
    for config in configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 0.0, "final_k": 0.0})
    report = build_report(no_draft, configs, [], [0, 1])
    rows = {row["row"]: row for row in report["rows"]}
    assert rows["100 ms per hop, full stack vs naive pipeline (drafting pair)"]["note"] == \
        "no --demo-draft: the full stack ran without drafting"
    assert "note" not in rows["100 ms per hop, token ids vs full logits back (drafting target)"]
    assert report["options"]["demo_draft"] is None and report["options"]["demo_target"] == str(TARGET)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("rounds", 0, "--rounds"), ("new_tokens", 0, "--new-tokens"), ("warmup_rounds", -1, "--warmup-rounds"),
    ("threads_per_pc", 0, "--threads-per-pc"),
    # a NaN delay ran the WAN rows with no delay at all, an infinite one hung them after every other row had run
    ("wan_delay_s", float("nan"), "--wan-delay-ms must be from 0 to 10000, not nan"),
    ("wan_delay_s", float("inf"), "--wan-delay-ms must be from 0 to 10000"),
    ("wan_delay_s", 1e9, "--wan-delay-ms must be from 0 to 10000"), ("wan_delay_s", -0.1, "--wan-delay-ms"),
    ("wan_bandwidth_bytes_s", 0.0, "--wan-bandwidth-mbit must be a finite number, at least 0.008"),
    ("wan_bandwidth_bytes_s", -125_000.0, "--wan-bandwidth-mbit must be a finite number, .*, not -1.0"),
    ("wan_bandwidth_bytes_s", 1e-300, "--wan-bandwidth-mbit must be a finite number, at least 0.008"),
    ("wan_bandwidth_bytes_s", float("nan"), "--wan-bandwidth-mbit")])
def test_options_refuse_what_would_measure_nothing(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetBenchOptions(MODEL, **{field: value})


def test_a_zero_bandwidth_on_the_command_line_is_refused_not_read_as_no_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    from deskfleet.controller import cli

    assert cli.main(["bench", "fleet", "--model", str(MODEL), "--wan-bandwidth-mbit", "0"]) == 2
    assert "--wan-bandwidth-mbit must be a finite number, at least 0.008" in capsys.readouterr().err


# Arguments checked before the bench runs

FAKE_REPORT: dict[str, Any] = {"rows": [], "configs": {"mono_1": {"median": 1.0}}}


def never_run(*args: object, **kwargs: object) -> dict[str, Any]:
    raise AssertionError("the bench ran although its arguments are wrong")


@pytest.mark.parametrize(("option", "target", "message"), [
    ("--json-out", "missing/x.json", "--json-out .*x.json: the folder .*missing does not exist"),
    ("--markdown-out", "missing/x.md", "--markdown-out .*x.md: the folder .*missing does not exist"),
    ("--json-out", ".", "--json-out .* is a folder: give a file name"),
])
def test_output_paths_are_checked_before_the_bench_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], option: str,
                                                        target: str, message: str) -> None:
    monkeypatch.setattr(fleet_module, "run_fleet_bench", never_run)
    assert main(["bench", "fleet", "--model", "m", option, str(tmp_path / target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith("deskfleet: error: ")
    assert re.search(message, captured.err), captured.err


def test_an_output_no_file_can_be_made_at_or_two_outputs_at_one_file_are_refused_before_the_bench_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # os.access said yes to root for /proc (the bench ran 80 s, then could not write); a FIFO or /dev/full was
    # replaced by a regular file; --json-out and --markdown-out at one file kept only the Markdown
    import errno
    import os

    from deskfleet.common import atomic_file

    monkeypatch.setattr(fleet_module, "run_fleet_bench", never_run)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    report = tmp_path / "r.json"
    link = tmp_path / "link.json"
    link.symlink_to(report.name)
    for argv, message in [(["--json-out", str(fifo)], "is a named pipe (FIFO), not a regular file"),
                          (["--json-out", str(report), "--markdown-out", str(link)],
                           "--json-out and --markdown-out name one file")]:
        assert main(["bench", "fleet", "--model", "m", *argv]) == 2
        assert message in capsys.readouterr().err

    def no_file_here(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(atomic_file.tempfile, "NamedTemporaryFile", no_file_here)
    assert main(["bench", "fleet", "--model", "m", "--json-out", str(report)]) == 2
    assert "no file can be made in the folder" in capsys.readouterr().err


@pytest.mark.parametrize(("descriptor", "stream"), [(1, "standard output"), (2, "standard error")])
def test_an_output_at_the_file_the_commands_own_output_goes_to_is_refused_before_the_bench_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], descriptor: int,
        stream: str) -> None:
    """`bench fleet > r.json --markdown-out /proc/self/fd/1`: the table was renamed over the file the JSON had gone
    to, and the JSON was lost. The descriptor is pointed at a file of the test's own (capsys reads what main says)."""
    import os

    monkeypatch.setattr(fleet_module, "run_fleet_bench", never_run)
    redirected = tmp_path / "out.txt"
    saved = os.dup(descriptor)
    try:
        with redirected.open("wb") as file:
            os.dup2(file.fileno(), descriptor)
        statuses = [main(["bench", "fleet", "--model", "m", "--markdown-out", target])
                    for target in (f"/proc/self/fd/{descriptor}", str(redirected))]
    finally:
        os.dup2(saved, descriptor)
        os.close(saved)
    said = capsys.readouterr().err
    assert statuses == [2, 2]
    assert f"--markdown-out /proc/self/fd/{descriptor} is this command's {stream}" in said
    assert f"--markdown-out {redirected} is this command's {stream}" in said
    assert redirected.read_bytes() == b""  # nothing replaced it


def test_the_report_is_printed_first_and_a_failed_write_leaves_the_old_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(fleet_module, "run_fleet_bench", lambda options, progress: FAKE_REPORT)
    old = tmp_path / "report.json"
    old.write_text("the previous run\n")

    def disk_full(descriptor: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("deskfleet.common.atomic_file.os.fsync", disk_full)
    assert main(["bench", "fleet", "--model", "m", "--json-out", str(old)]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == FAKE_REPORT  # the run is not lost
    assert "cannot write --json-out" in captured.err and "No space left" in captured.err
    assert old.read_text() == "the previous run\n"  # not truncated
    assert [path.name for path in tmp_path.iterdir()] == ["report.json"]  # no temporary left behind
    monkeypatch.undo()
    monkeypatch.setattr(fleet_module, "run_fleet_bench", lambda options, progress: FAKE_REPORT)
    markdown = tmp_path / "table.md"
    assert main(["bench", "fleet", "--model", "m", "--json-out", str(old), "--markdown-out", str(markdown)]) == 0
    assert json.loads(old.read_text()) == FAKE_REPORT and markdown.read_text().startswith("| row |")


def test_a_signal_after_the_json_says_the_report_is_whole_and_which_files_were_not_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(fleet_module, "run_fleet_bench", lambda options, progress: FAKE_REPORT)

    def sigterm_while_rendering(report: dict[str, Any]) -> str:
        signal.raise_signal(signal.SIGTERM)  # raised here: the JSON is out, the files are not written
        return "| row |"

    monkeypatch.setattr(fleet_module, "render_markdown", sigterm_while_rendering)
    report = tmp_path / "report.json"
    assert main(["bench", "fleet", "--model", "m", "--json-out", str(report)]) == 143
    captured = capsys.readouterr()
    assert json.loads(captured.out) == FAKE_REPORT
    assert captured.err.endswith("deskfleet: bench fleet stopped by SIGTERM after its report was printed whole, "
                                 f"before the markdown table and --json-out {report}\n")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setattr(fleet_module, "run_fleet_bench", lambda options, progress: FAKE_REPORT)
    write_outputs = fleet_module.write_outputs

    def sigterm_while_writing_the_table(report: dict[str, Any], json_path: Path | None, markdown_path: Path | None
                                        ) -> None:
        if markdown_path is not None:
            signal.raise_signal(signal.SIGTERM)
        write_outputs(report, json_path, markdown_path)

    monkeypatch.setattr(fleet_module, "write_outputs", sigterm_while_writing_the_table)
    table = tmp_path / "table.md"
    assert main(["bench", "fleet", "--model", "m", "--json-out", str(report), "--markdown-out", str(table)]) == 143
    assert capsys.readouterr().err.endswith(f"report was printed whole, before --markdown-out {table}\n")
    assert [path.name for path in tmp_path.iterdir()] == ["report.json"]  # written before the signal, and said so

    def ctrl_c(options: object, progress: object) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(fleet_module, "run_fleet_bench", ctrl_c)
    assert main(["bench", "fleet", "--model", "m"]) == 130
    assert capsys.readouterr().err.endswith("deskfleet: bench fleet stopped by SIGINT (Ctrl-C): no report; its "
                                            "simulated PCs are stopped and its temporary folder removed\n")


def fake_export(folder: Path, source: Path, **spec: int) -> Path:
    """An export folder holding only the manifest of `source`, its spec changed (enough for the checks)."""
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["spec"].update(spec)
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize(("draft_spec", "message"), [
    ({"vocab_size": 1000}, r"--demo-draft .* cannot draft for --demo-target .*: the draft.s vocabulary \(1000\)"),
    ({"max_context": 64}, r"--demo-draft .* the draft's context \(64 positions\) is shorter"),
])
def test_a_draft_that_cannot_draft_for_the_target_is_refused_before_any_pc_starts(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, draft_spec: dict[str, int],
        message: str) -> None:
    monkeypatch.setattr(fleet_module, "_Fleet", never_run)
    draft = fake_export(tmp_path / "draft", tiny_export, **draft_spec)
    with pytest.raises(ValueError, match=message):
        run_fleet_bench(FleetBenchOptions(tiny_export, tiny_export, draft))
    check_inputs(FleetBenchOptions(tiny_export, tiny_export, fake_export(tmp_path / "same", tiny_export)))


def test_the_other_inputs_are_checked_before_any_pc_starts(tiny_export: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "_Fleet", never_run)
    with pytest.raises(ValueError, match="--demo-draft needs --demo-target"):
        run_fleet_bench(FleetBenchOptions(tiny_export, None, tiny_export))
    with pytest.raises(FileNotFoundError, match="--genai-python /nonexistent/python"):
        run_fleet_bench(FleetBenchOptions(tiny_export, genai_model=tmp_path, genai_python=Path("/nonexistent/python")))
    with pytest.raises(FileNotFoundError, match="--genai-model"):
        run_fleet_bench(FleetBenchOptions(tiny_export, genai_model=tmp_path / "missing"))
    context = load_manifest(tiny_export).spec.max_context
    with pytest.raises(ValueError, match=f"--prompt-tokens {context} \\+ --new-tokens 32 exceed the context"):
        run_fleet_bench(FleetBenchOptions(tiny_export, prompt_tokens=context))
    with pytest.raises(ValueError, match=f"--new-tokens {context} \\+ the longest demo prompt \\(\\d+ tokens\\) exceed "
                                         f"the context of --demo-target"):
        run_fleet_bench(FleetBenchOptions(None, tiny_export, new_tokens=context))
    check_inputs(FleetBenchOptions(None, tiny_export, new_tokens=32))


def test_a_failed_copy_is_named_not_the_copy_it_released_from_the_start_barrier(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def second_copy_fails(placements: tuple[float, ...], *args: object, **kwargs: object) -> _FakeChain:
        if placements == (1.0,):
            raise ConnectionError("agent b refused the TLS handshake")
        return _FakeChain(placements)

    monkeypatch.setattr(fleet_module, "FleetPipeline", second_copy_fails)
    monkeypatch.setattr(fleet_module, "model_id_of", lambda model: "m@0")
    monkeypatch.setattr(fleet_module, "load_manifest", lambda model: SimpleNamespace(spec=None))
    monkeypatch.setattr(fleet_module, "_prompts", lambda *args: [[1, 2]])
    monkeypatch.setattr(fleet_module, "Engine", lambda *args: SimpleNamespace(add=lambda request: None))
    fleet = SimpleNamespace(store=SimpleNamespace(tls_files=None))
    config = _Config("copies_2", "mono", 1, 1, 1, copies=2)
    with pytest.raises(RuntimeError, match="ConnectionError: agent b refused the TLS handshake"):
        _run_config(fleet, {"mono": (0.0,), "mono-b": (1.0,)}, config, FleetBenchOptions(MODEL), {})  # type: ignore[arg-type]


def test_a_failed_configuration_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_chain(*args: object, **kwargs: object) -> None:
        raise ConnectionError("stage 1 went away")

    monkeypatch.setattr(fleet_module, "FleetPipeline", broken_chain)
    monkeypatch.setattr(fleet_module, "model_id_of", lambda model: "m@0")  # no model folder here
    fleet = SimpleNamespace(store=SimpleNamespace(tls_files=None))
    config = _Config("copies_2", "mono", 1, 1, 1, copies=2)
    with pytest.raises(RuntimeError, match="configuration copies_2 failed: ConnectionError: stage 1 went away"):
        _run_config(fleet, {"mono": (), "mono-b": ()}, config, FleetBenchOptions(MODEL), {})  # type: ignore[arg-type]


@pytest.mark.parametrize("max_pcs", [2, 3, 4])
def test_each_drafting_row_is_compared_with_one_pc_serving_the_same_prompts(max_pcs: int) -> None:
    # Tok/s depends on the prompt: the baseline serves the row's prompts (the first N held-out prompts,
    # as the row's N streams get them) one after another, not one prompt of its own.
    configs = {config.key: config for config in bench_configs(options(max_pcs))}
    drafting = [row for row in fleet_rows(max_pcs) if row.config.startswith("demo_") and row.baseline
                and row.config in configs and configs[row.config].drafter and "vs 1 PC" not in row.title]
    assert len(drafting) == 2 * 3 * (max_pcs - 1)  # k PCs and 1 PC batched, each drafter, 2..max_pcs streams
    for row in drafting:
        baseline = configs[str(row.baseline)]
        assert baseline.one_at_a_time and baseline.streams == configs[row.config].streams, row.title
        assert baseline.max_rows == baseline.micro_batches == 1 and baseline.drafter is None


@pytest.mark.parametrize("max_pcs", [2, 3, 4])
def test_each_drafting_row_has_one_pc_batching_the_same_streams_beside_it(max_pcs: int) -> None:
    # The honest baseline for k PCs drafting k streams: the same k streams as rows of one micro-batch on 1 PC,
    # drafted the same way; the pipeline is compared with it in a row of its own.
    configs = {config.key: config for config in bench_configs(options(max_pcs))}
    compared = [row for row in fleet_rows(max_pcs) if "vs 1 PC" in row.title and row.config.startswith("demo_")
                and row.config in configs]
    assert len(compared) == 3 * (max_pcs - 1)
    for row in compared:
        pipeline, one_pc = configs[row.config], configs[str(row.baseline)]
        assert one_pc.group == "demo_mono" and not one_pc.one_at_a_time, row.title
        assert one_pc.max_rows == one_pc.streams == pipeline.streams and one_pc.micro_batches == 1, row.title
        assert one_pc.drafter == pipeline.drafter is not None, row.title
        assert pipeline.micro_batches == pipeline.streams, row.title  # each PC has a micro-batch to work on


@pytest.mark.parametrize("max_pcs", [2, 3])
def test_a_row_left_unrun_names_the_pcs_it_needs(max_pcs: int) -> None:
    # The 1-PC baselines beside the 3- and 4-stream drafting rows need the PCs of the row they stand beside.
    configs = bench_configs(options(max_pcs))
    for config in configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 0.0, "final_k": 0.0})
    rows = {row["row"]: row for row in build_report(options(max_pcs), configs, [], [0, 1, 2])["rows"]}
    needs = {title: row["note"] for title, row in rows.items()
             if row["ratio"] is None and "--pcs" in row.get("note", "")}
    assert needs, "some rows need more PCs"
    for title, note in needs.items():
        pcs = 4 if title.startswith(("4 PCs", "1 PC, 4 streams")) or "4 streams' prompts" in title else 3
        assert pcs > max_pcs and note == f"not run: needs --pcs {pcs} (one core per simulated PC)", title


def test_only_the_paper_s_drafting_rows_carry_its_figures_and_the_goals() -> None:
    labelled = {row.title: (row.paper, row.goal) for row in fleet_rows(4)
                if "speculative" in row.title and "100 ms" not in row.title and (row.paper, row.goal) != ("-", "-")}
    assert labelled == {"2 PCs, 2 streams + speculative (draft model)": ("1.79x", ">= 3.0x"),
                        "3 PCs, 3 streams + speculative (draft model)": ("2.64x", ">= 4.0x")}


class _FakeChain:
    """Opens in `open_s` (a copy's TLS handshakes), then serves steps (none: the fake engine needs none)."""

    def __init__(self, placements: tuple[float, ...], *args: object, **kwargs: object) -> None:
        self.open_s = placements[0]

    def __enter__(self) -> _FakeChain:
        import time

        time.sleep(self.open_s)
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def _fake_fleet(monkeypatch: pytest.MonkeyPatch, engine: type) -> SimpleNamespace:
    """_run_config's world faked: chains that open after the seconds their placements name, `engine` for the engine,
    one two-token prompt a stream;
    returns the fleet to pass it."""
    monkeypatch.setattr(fleet_module, "FleetPipeline", _FakeChain)
    monkeypatch.setattr(fleet_module, "Engine", engine)
    monkeypatch.setattr(fleet_module, "model_id_of", lambda model: "m@0")
    monkeypatch.setattr(fleet_module, "load_manifest", lambda model: SimpleNamespace(spec=None))
    monkeypatch.setattr(fleet_module, "_prompts", lambda *args: [[1, 2]])
    return SimpleNamespace(store=SimpleNamespace(tls_files=None))


class _OneTokenEngine:
    """An engine for _fake_fleet whose run gives one stream one token; subclasses set k_policy and timings."""

    def add(self, request: object) -> None:
        pass

    def run(self, on_token: Any = None) -> dict[int, Any]:
        on_token(0, 1)
        return {0: SimpleNamespace(tokens=[1])}

def test_copies_start_together_and_their_wall_spans_first_start_to_last_end(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    runs: list[tuple[float, float]] = []

    class FakeEngine:
        def __init__(self, *args: object) -> None:
            self.k_policy = SimpleNamespace(k=0)
            self.timings = EngineTimings()

        def add(self, request: object) -> None:
            pass

        def run(self, on_token: Any = None) -> dict[int, Any]:
            started = time.perf_counter()
            for _ in range(10):  # one stream, a token every 20 ms: steady at 50 tok/s
                time.sleep(0.02)
                on_token(0, 1)
            runs.append((started, time.perf_counter()))
            # half of its run's wall, as measured: 10 sleeps of 20 ms took 0.28 s on a loaded machine
            self.timings = EngineTimings(wait_seconds=(runs[-1][1] - started) / 2)
            return {0: SimpleNamespace(tokens=[1] * 10)}

    fleet = _fake_fleet(monkeypatch, FakeEngine)
    config = _Config("copies_2", "mono", 1, 1, 1, copies=2)
    # the second copy's chain takes 0.3 s longer to open: it must not start generating late
    result = _run_config(fleet, {"mono": (0.0,), "mono-b": (0.3,)}, config, FleetBenchOptions(MODEL), {})  # type: ignore[arg-type]
    (first_start, first_end), (second_start, second_end) = sorted(runs)
    assert second_start - first_start < 0.1
    wall = max(first_end, second_end) - min(first_start, second_start)
    assert result["wall_s"] == pytest.approx(wall, abs=0.01) and result["tok_s"] == pytest.approx(20 / wall, rel=0.05)
    # where the driver spent it: the first copy's engine, against its own run's wall
    assert result["wait_share"] == pytest.approx(0.5, rel=0.2) and result["round_trip_ms"] == 0.0
    assert result["steady_tok_s"] == pytest.approx(2 * 50.0, rel=0.2)  # the two copies' rates add up


def test_a_row_of_n_pcs_plans_its_model_over_those_pcs_whatever_a_hop_costs() -> None:
    # The planner prices a hop per stage under all_by_speed (1 ms by default): the demo target, whose token
    # computes in less than that, would stay on one PC, and every "2 / 3 / 4 PCs" drafting row would run on one
    from deskfleet.common.agent_state import AgentState
    from deskfleet.common.planner import AgentCandidate, ModelFootprint, PlanOptions, PlanPolicy, plan
    from deskfleet.controller.bench.fleet import PLAN_OPTIONS

    demo_target = ModelFootprint.uniform("demo target", 8, 1_200_000, 800_000, 2_400_000, 0, 1024)
    pcs = [AgentCandidate(f"pc{index}", AgentState.AVAILABLE, 8 << 30, 10.0) for index in range(4)]
    assert len(plan(demo_target, pcs[:2], PlanOptions(policy=PlanPolicy.ALL_BY_SPEED)).stages) == 1
    for count in (2, 3, 4):
        assert len(plan(demo_target, pcs[:count], PLAN_OPTIONS).stages) >= min(count, 3)  # its head weighs 2 layers


def test_kv_cache_is_the_drafting_and_wan_pcs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # `--kv-cache f32` is what README tells a user drafting for a real target on CPUs; the throughput rows keep
    # the precision's own cache, so that they stay comparable with the runs before the option.
    deployed: dict[str, str | None] = {}

    class FakeFleet:
        def __init__(self, *args: object) -> None:
            self.names: list[str] = []

        def __enter__(self) -> FakeFleet:
            return self

        def __exit__(self, *exc_info: object) -> None:
            pass

        @contextlib.contextmanager
        def naming_ended_pcs(self) -> Iterator[None]:
            yield

        def deploy(self, model: Path, names: list[str], kv_cache: str | None = None) -> tuple[()]:
            deployed[names[0]] = kv_cache
            return ()

    class Deployed(Exception):
        pass

    def stop(*args: object) -> None:
        raise Deployed

    monkeypatch.setattr(fleet_module, "_Fleet", FakeFleet)
    monkeypatch.setattr(fleet_module, "check_inputs", lambda options: None)
    monkeypatch.setattr(fleet_module, "_run_rounds", stop)
    with pytest.raises(Deployed):
        run_fleet_bench(replace(options(2), drafting_kv_cache="f32"))
    assert deployed == {"mono": None, "mono-b": None, "pair0": None, "demo_mono": "f32", "demo_pair0": "f32",
                        "wan0": "f32"}
    with pytest.raises(ValueError, match=r"--kv-cache must be one of .*, not f64"):
        replace(options(2), drafting_kv_cache="f64")


def test_a_simulated_pc_deploys_with_the_kv_cache_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    # _Fleet.deploy is what carries `--kv-cache` to `fleet deploy`: the row above stops at its caller
    deployed: list[tuple[Path, object, str | None]] = []

    class Found:
        async def close(self) -> None:
            pass

    async def fake_survey(store: object, survey_options: Any) -> Found:
        assert survey_options.peers == ("127.0.0.1:7001",)
        return Found()

    async def fake_deploy(store: object, model: Path, found: Found, plan_options: object, precision: object,
                          kv_cache: str | None = None) -> tuple[None, SimpleNamespace]:
        deployed.append((model, precision, kv_cache))
        return None, SimpleNamespace(stages=("stage",))

    monkeypatch.setattr(fleet_module, "survey", fake_survey)
    monkeypatch.setattr(fleet_module, "deploy", fake_deploy)
    fleet = object.__new__(fleet_module._Fleet)
    fleet.store = None  # type: ignore[assignment]
    fleet.address_of = {"demo_pair0": "127.0.0.1:7001"}  # type: ignore[attr-defined]
    assert fleet.deploy(TARGET, ["demo_pair0"], "f32") == ("stage",)
    assert fleet.deploy(TARGET, ["demo_pair0"]) == ("stage",)
    assert [kv_cache for _, _, kv_cache in deployed] == ["f32", None]


def test_each_configuration_reports_the_median_of_where_its_driver_spent_the_runs() -> None:
    configs = bench_configs(options(2))
    for config in configs:
        for share in (0.1, 0.3, 0.2):
            config.runs.append({"tok_s": 10.0, "mean_accepted": 2.0, "mean_k": 30.0 * share, "final_k": 4.0,
                                "draft_share": share, "wait_share": 1.0 - share, "round_trip_ms": 100.0 * share,
                                "verify_ms": 10.0 * share, "changed_share": share})
    summary = build_report(options(2), configs, [], [0, 1])["configs"]
    assert summary["demo_pair_2_spec"]["draft_share"] == pytest.approx(0.2)
    assert summary["demo_pair_2_spec"]["wait_share"] == pytest.approx(0.8)
    assert summary["demo_pair_2_spec"]["round_trip_ms"] == pytest.approx(20.0)
    assert summary["demo_pair_2_spec"]["mean_k"] == pytest.approx(6.0)  # the K its rounds ran at, a median
    assert summary["demo_pair_2_spec"]["verify_ms"] == pytest.approx(2.0)
    assert summary["demo_pair_2_spec"]["changed_share"] == pytest.approx(0.2)


def test_the_steady_rate_counts_the_tokens_while_every_stream_runs() -> None:
    # stream 0 runs from 0 to 10 s, stream 1 from 2 to 8 s: the window is (2, 8]
    clock = {0: [float(moment) for moment in range(11)], 1: [2.0, 4.0, 6.0, 8.0]}
    # stream 0's tokens at 3-8 s (6) and stream 1's at 4, 6 and 8 s (3), over 6 s
    assert steady_rate([clock]) == pytest.approx(9 / 6)
    # engines one after another (a 1-PC baseline): their windows' tokens over their windows' seconds
    solo_a, solo_b = {0: [0.0, 1.0, 2.0]}, {0: [10.0, 10.5, 11.0, 11.5, 12.0]}
    assert steady_rate([solo_a, solo_b]) == pytest.approx((2 + 4) / (2.0 + 2.0))


def test_a_run_without_a_moment_when_every_stream_ran_has_no_steady_rate() -> None:
    assert steady_rate([{0: [0.0, 1.0], 1: [2.0, 3.0]}]) == 0.0  # one ended before the other began
    assert steady_rate([{0: [5.0]}]) == 0.0  # a single token: no interval
    assert steady_rate([{}, {0: []}]) == 0.0


def test_rows_report_the_ratio_of_steady_rates_beside_the_ratio_of_walls() -> None:
    configs = bench_configs(options(3))
    steady = {"demo_trio_3_spec": 300.0, "demo_mono_seq3": 60.0}
    for config in configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 0.0, "final_k": 0.0,
                            "steady_tok_s": steady.get(config.key, 0.0)})
    rows = {row["row"]: row for row in build_report(options(3), configs, [], [0, 1, 2])["rows"]}
    assert rows["3 PCs, 3 streams + speculative (draft model)"]["steady_ratio"] == pytest.approx(5.0)
    assert rows["3 PCs, 3 streams + speculative (draft model)"]["ratio"] == pytest.approx(1.0)
    # a configuration without a steady rate (here 1 PC batched) gives its rows none
    assert "steady_ratio" not in rows["3 PCs vs 1 PC, 3 streams batched + speculative (draft model)"]


def test_fixed_k_rows_run_the_draft_model_with_that_k_beside_adaptive_k(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = replace(options(3), fixed_ks=(2, 5))
    configs = {config.key: config for config in bench_configs(fixed)}
    for pcs, group in ((2, "pair"), (3, "trio")):
        assert configs[f"demo_{group}_{pcs}_spec"].fixed_k is None  # adaptive, as without --fixed-k
        for k in (2, 5):
            config = configs[f"demo_{group}_{pcs}_spec_k{k}"]
            assert (config.drafter, config.fixed_k, config.micro_batches, config.streams) == ("spec", k, pcs, pcs)
    assert not any(config.fixed_k for config in bench_configs(options(3)))
    rows = {row.title: row for row in fleet_rows(3, (2, 5))}
    row = rows["3 PCs, 3 streams + speculative (draft model, K fixed at 5)"]
    assert (row.config, row.baseline, row.goal) == ("demo_trio_3_spec_k5", "demo_mono_seq3", "-")
    assert not any("K fixed" in row.title for row in fleet_rows(4))
    # the configuration's K reaches the engine that runs it
    seen: list[Any] = []

    class FakeEngine(_OneTokenEngine):
        def __init__(self, chain: object, spec: object, draft: object, engine_options: Any,
                     learned_k: object = None) -> None:
            seen.append(engine_options)
            self.k_policy = SimpleNamespace(k=engine_options.fixed_k)
            self.timings = EngineTimings()

    fleet = _fake_fleet(monkeypatch, FakeEngine)
    config = configs["demo_pair_2_spec_k5"]
    _run_config(fleet, {"demo_pair": (0.0,)}, config, fixed, {config.key: None})  # type: ignore[arg-type]
    assert [engine_options.fixed_k for engine_options in seen] == [5]


@pytest.mark.parametrize(("ks", "message"), [((0,), "from 1 to 64, not 0"), ((65,), "from 1 to 64, not 65"),
                                             ((3, 3), "names a K twice: 3 3")])
def test_fixed_k_out_of_range_is_refused(ks: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=f"--fixed-k .*{message}"):
        replace(options(2), fixed_ks=ks)


def test_fixed_k_without_the_draft_model_is_refused_before_any_pc_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "fleet", "--model", str(MODEL), "--fixed-k", "3"]) == 2
    assert "--fixed-k needs --demo-draft" in capsys.readouterr().err


def test_drafters_that_need_the_draft_model_without_it_are_refused_before_any_pc_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    # every row they asked for was skipped ("not run: no --demo-draft") and the bench exited 0
    for drafters in (["spec"], ["lookup", "first"]):
        assert main(["bench", "fleet", "--model", str(MODEL), "--drafters", *drafters]) == 2
        assert f"--drafters {drafters[-1]} needs --demo-draft" in capsys.readouterr().err
    assert replace(options(2), drafters=("lookup",)).drafters == ("lookup",)  # lookup needs no draft model


def test_drafters_limits_the_drafting_rows_and_says_so_of_those_left_out() -> None:
    only_model = replace(options(2), drafters=("spec",), fixed_ks=(4,))
    configs = bench_configs(only_model)
    keys = {config.key for config in configs}
    assert {"demo_pair_2_spec", "demo_mono_2_spec", "demo_pair_2_spec_k4"} <= keys
    assert not any(key.endswith(("_lookup", "_first")) for key in keys)
    for config in configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 1.0, "final_k": 4.0})
    report = build_report(only_model, configs, [0], [1, 2])
    rows = {row["row"]: row for row in report["rows"]}
    assert rows["2 PCs, 2 streams + speculative (draft model)"]["ratio"] == 1.0
    assert rows["2 PCs, 2 streams + speculative (prompt lookup)"]["note"] == "not run: --drafters leaves out lookup"
    assert rows["1 PC, 2 streams batched + speculative (lookup first)"]["note"] == \
        "not run: --drafters leaves out first"
    assert report["options"]["drafters"] == ["spec"] and report["options"]["carry_k"] is False
    assert any(key.endswith("_lookup") for key in (config.key for config in bench_configs(options(2))))


@pytest.mark.parametrize(("fields", "message"), [
    (dict(drafters=("spec", "medusa")), "--drafters: unknown medusa; choose from spec, lookup, first"),
    (dict(drafters=("lookup",), fixed_ks=(3,)), "--fixed-k runs the draft model's rows: --drafters must keep spec")])
def test_drafters_that_cannot_run_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        replace(options(2), **fields)


def test_no_wan_leaves_out_the_wan_rows_and_their_pcs() -> None:
    no_wan = replace(options(2), wan=False)
    assert not any(config.group == "wan" for config in bench_configs(no_wan))
    assert "wan" not in bench_groups(no_wan) and "wan" in bench_groups(options(2))
    configs = bench_configs(no_wan)
    for config in configs:
        config.runs.append({"tok_s": 10.0, "mean_accepted": 1.0, "final_k": 4.0})
    rows = {row["row"]: row for row in build_report(no_wan, configs, [0], [1, 2])["rows"]}
    assert rows["100 ms per hop, full stack vs naive pipeline (drafting pair)"]["note"] == "not run: --no-wan"
    assert rows["2 PCs, 2 streams + speculative (draft model)"]["ratio"] == 1.0


def test_the_command_line_passes_the_row_choices_on(monkeypatch: pytest.MonkeyPatch, tiny_export: Path) -> None:
    seen: list[FleetBenchOptions] = []

    def recorded(options: FleetBenchOptions, progress: Any = None) -> dict[str, Any]:
        seen.append(options)
        return FAKE_REPORT

    monkeypatch.setattr(fleet_module, "run_fleet_bench", recorded)
    monkeypatch.setattr(fleet_module, "render_markdown", lambda report: "")
    argv = ["bench", "fleet", "--demo-target", str(tiny_export), "--demo-draft", str(tiny_export)]
    assert main([*argv, "--no-wan", "--drafters", "spec", "lookup", "--fixed-k", "2", "5", "--carry-k"]) == 0
    assert main(argv) == 0
    assert [(o.wan, o.drafters, o.fixed_ks, o.carry_k) for o in seen] == [
        (False, ("spec", "lookup"), (2, 5), True), (True, (), (), False)]


def test_a_drafted_configuration_reports_the_k_its_rounds_ran_at_beside_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # adaptive K ends at 8 after rounds at 3 and 5: its final K alone would hide the rounds it spent learning
    class FakeEngine(_OneTokenEngine):
        def __init__(self, *args: object) -> None:
            self.k_policy = SimpleNamespace(k=8, cost=RoundCost(0.02, 0.001, verify_seconds_per_token=0.0015),
                                            changed_width_share=lambda: 0.25)
            self.timings = EngineTimings()

        def mean_accepted(self) -> float:
            return 2.5

        def mean_k(self) -> float:
            return 16 / 3

    fleet = _fake_fleet(monkeypatch, FakeEngine)
    config = bench_configs(options(2))
    spec = next(c for c in config if c.key == "demo_pair_2_spec")
    result = _run_config(fleet, {"demo_pair": (0.0,)}, spec, options(2), {spec.key: object()})  # type: ignore[arg-type,dict-item]
    assert (result["mean_k"], result["final_k"], result["mean_accepted"]) == (pytest.approx(16 / 3), 8.0, 2.5)
    assert result["verify_ms"] == pytest.approx(1.5)  # what it learned a verified position costs
    assert result["changed_share"] == pytest.approx(0.25)  # its rounds that re-prepared a new width


@pytest.mark.parametrize("carry", [True, False])
def test_carry_k_hands_each_round_the_adaptive_k_its_configuration_learned_the_round_before(
        monkeypatch: pytest.MonkeyPatch, carry: bool) -> None:
    handed: list[tuple[object, Any]] = []  # (the configuration's drafter, the adaptive K the engine was handed)

    class FakeEngine(_OneTokenEngine):
        def __init__(self, chain: object, spec: object, draft: object, engine_options: Any,
                     learned_k: object = None) -> None:
            handed.append((draft, learned_k))
            # what this run learned: tagged with its configuration's drafter
            self.k_policy = SimpleNamespace(k=4, drafter=draft, cost=RoundCost(0.02, 0.001),
                                            changed_width_share=lambda: 0.0)
            self.timings = EngineTimings()

        def mean_accepted(self) -> float:
            return 1.0

        def mean_k(self) -> float:
            return 4.0

    fleet = _fake_fleet(monkeypatch, FakeEngine)
    bench = replace(options(2), carry_k=carry, rounds=1, warmup_rounds=1)
    configs = [config for config in bench_configs(bench) if config.key in ("demo_pair_2_spec", "demo_pair_2_lookup")]
    monkeypatch.setattr(fleet_module, "open_drafter", lambda *args, **kwargs: object())  # one per configuration
    _run_rounds(fleet, {"demo_pair": (0.0,)}, configs, bench, None, lambda line: None)  # type: ignore[arg-type]
    assert len(handed) == 4 and len({id(draft) for draft, _ in handed}) == 2
    assert [learned for _, learned in handed[:2]] == [None, None]  # the warm-up round learns from the prior
    if carry:  # each configuration's second round goes on from what its own first learned
        assert all(learned is not None and learned.drafter is draft for draft, learned in handed[2:])
    else:
        assert [learned for _, learned in handed[2:]] == [None, None]
