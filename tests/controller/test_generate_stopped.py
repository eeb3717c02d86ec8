"""A `generate` run whose chain breaks past what failover can mend (a fleet run that gave up re-planning) keeps
what the streams had made: run_generate raises GenerationStopped carrying the report of tokens so far, and the
CLI exits 1 (not a usage error's 2) with them on standard output under --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller import chat as chat_module
from deskfleet.controller.cli import main
from deskfleet.controller.engine import ChainBroken
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.run import GenerateOptions, GenerationStopped, run_generate
from tests.controller.test_engine_failover import BreakingChain

F32 = CompileSettings(precision=Precision.F32)
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 40, 41, 42, 43]]


def give_up(error: ChainBroken) -> BreakingChain:
    raise RuntimeError(f"{error} (gave up: 0 re-plan(s) already in this run, --max-failovers 0)")


def test_a_run_that_gives_up_keeps_each_streams_tokens_so_far(tiny_export: Path) -> None:
    lengths = {0: 3, 1: 40, 2: 40}  # the first stream finishes before the chain breaks
    options = GenerateOptions(model=tiny_export, prompt_ids=PROMPTS, max_new_tokens=40, ignore_eos=True, settings=F32)
    whole = run_generate(options)["streams"]
    assert isinstance(whole, list)
    manifest = load_manifest(tiny_export)
    with LocalPipeline(tiny_export, 2, F32, manifest) as pipeline:
        chain = BreakingChain(pipeline, break_at=20)
        short = GenerateOptions(model=tiny_export, prompt_ids=PROMPTS[:1], max_new_tokens=lengths[0],
                                ignore_eos=True, settings=F32)
        assert run_generate(short, chain=BreakingChain(pipeline, None), chain_stages=2)["tokens"] == \
            whole[0]["tokens"][:3]
        with pytest.raises(GenerationStopped, match="gave up") as stopped:
            run_generate(options, chain=chain, chain_stages=2, recover=give_up)
    report = stopped.value.report
    assert report["stopped"] == str(stopped.value) and "stage 1 stopped answering after 20 steps" in report["stopped"]
    streams = report["streams"]
    assert isinstance(streams, list) and len(streams) == 3
    made = [len(stream["tokens"]) for stream in streams]
    assert 0 < sum(made) < 120 and report["generated_tokens"] == sum(made)
    for stream, reference in zip(streams, whole, strict=True):  # a prefix of the run that did not break
        assert stream["tokens"] == reference["tokens"][:len(stream["tokens"])]
    assert report["failovers"] == []


def test_the_cli_exits_1_and_prints_what_was_made(monkeypatch: pytest.MonkeyPatch, tiny_export: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    report = {"stages": 2, "generated_tokens": 7, "wall_s": 0.5, "tok_s": 14.0, "fleet": True,
              "streams": [{"tokens": [5] * 4, "text": "done", "stopped_by_eos": False},
                          {"tokens": [6] * 3, "text": "cut", "stopped_by_eos": False}],
              "stopped": "agent 3f2a stopped answering (gave up: --max-failovers 0)"}

    def stopped_run(*args: object, **kwargs: object) -> dict[str, object]:
        raise GenerationStopped(str(report["stopped"]), report)

    monkeypatch.setattr(chat_module, "generate_on_fleet", stopped_run)
    argv = ["generate", "--fleet", "--model", str(tiny_export), "--prompt-ids", "1,2", "--prompt-ids", "1,3",
            "--max-new-tokens", "4", "--ignore-eos"]
    assert main([*argv, "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == report
    assert err == ("deskfleet: error: agent 3f2a stopped answering (gave up: --max-failovers 0) (1 of 2 stream(s) "
                   "had finished; 7 tokens in all, in the JSON on standard output)\n")
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and "(1 of 2 stream(s) had finished; 7 tokens in all, above)" in err
