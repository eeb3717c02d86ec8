"""`deskfleet generate`/`export`: JSON output and errors that name the problem (exit code 2)."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from deskfleet.controller.cli import main
from tests.signals import signal_main_thread


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_has_the_documented_fields(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "generate", "--model", str(tiny_export), "--stages", "2", "--prompt", "def f(x):",
                       "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert code == 0
    report = json.loads(out)
    assert len(report["tokens"]) == 8 and isinstance(report["text"], str)
    assert report["stages"] == 2 and report["tok_s"] > 0


def test_generate_json_reports_log_probabilities_where_asked(tiny_export: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--logprobs N: each stream's tokens with their log-probabilities and the N most likely tokens', as the engine
    gives them (the API's figures; test_engine_logprobs.py holds them to transformers')."""
    from deskfleet.common.model_spec import load_manifest
    from deskfleet.controller.engine import Engine, StreamRequest
    from deskfleet.controller.pipeline import LocalPipeline

    from .test_engine import F32

    code, out, _ = run(capsys, "generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6", "--prompt-ids",
                       "1,9", "--max-new-tokens", "5", "--ignore-eos", "--precision", "f32", "--json",
                       "--logprobs", "2")
    assert code == 0
    streams = json.loads(out)["streams"]
    manifest = load_manifest(tiny_export)
    for stream, prompt in zip(streams, ([1, 5, 6], [1, 9]), strict=True):
        with LocalPipeline(tiny_export, 1, F32, manifest) as pipeline:
            engine = Engine(pipeline, manifest.spec)
            engine.add(StreamRequest(prompt, max_new_tokens=5, ignore_eos=True, logprobs=2))
            expected = engine.run()[0].logprobs or ()
        assert [entry["token"] for entry in stream["logprobs"]] == stream["tokens"]
        assert [entry["logprob"] for entry in stream["logprobs"]] == \
            pytest.approx([entry.logprob for entry in expected], abs=1e-5)
        assert [[token for token, _ in entry["top"]] for entry in stream["logprobs"]] == \
            [[token for token, _ in entry.top] for entry in expected]
    code, out, _ = run(capsys, "generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6", "--max-new-tokens",
                       "2", "--json")
    assert code == 0 and "logprobs" not in json.loads(out)["streams"][0]


def test_generate_several_prompts(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "generate", "--model", str(tiny_export), "--prompt", "a", "--prompt", "bc",
                       "--max-new-tokens", "4", "--ignore-eos", "--json")
    assert code == 0
    report = json.loads(out)
    assert [len(stream["tokens"]) for stream in report["streams"]] == [4, 4]


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-ids", "1,2,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,,2"], "comma-separated integers, got '1,,2'"),  # was read as 1,2
    (["--prompt-ids", "1,2,"], "comma-separated integers, got '1,2,'"),
    (["--prompt-ids", "\uff11,\uff12"], "comma-separated integers, got"),  # full-width digits: int() took them
    (["--prompt-ids", "1,2", "--max-new-tokens", "100000"], "exceed the model's context"),
    (["--prompt-ids", "1,2", "--stages", "9"], "cannot split 4 layers into 9 stages (--stages must"),
    (["--prompt-ids", "1,2", "--chat"], "--chat wraps text prompts"),
    (["--prompt-ids", "1,2", "--k", "0", "--draft", "d"], "--k 0 drafts no tokens"),
    (["--prompt-ids", "1,2", "--k", "0", "--prompt-lookup"], "--k 0 drafts no tokens"),
    (["--prompt-ids", "1,2", "--k", "3"], "--k needs --draft or --prompt-lookup"),
    (["--prompt-ids", "1,2", "--k-max", "4"], "--k-max needs --draft or --prompt-lookup"),
    (["--prompt-ids", "1,2", "--temperature", "-0.5"], "--temperature must be from 0 (greedy) to 100, got -0.5"),
    (["--prompt-ids", "1,2", "--temperature", "nan"], "--temperature must be from 0 (greedy) to 100, got nan"),
    (["--prompt-ids", "1,2", "--temperature", "inf"], "--temperature must be from 0 (greedy) to 100, got inf"),
    (["--prompt-ids", "1,2", "--top-k", "-1"], "--top-k must be 0 (off) or more, got -1"),
    (["--prompt-ids", "1,2", "--top-p", "0"], "--top-p must be more than 0 and at most 1 (1: off), got 0.0"),
    (["--prompt-ids", "1,2", "--top-p", "1.5"], "--top-p must be more than 0 and at most 1 (1: off), got 1.5"),
    # greedy decoding ignored them without a word: the user thought they were sampling
    (["--prompt-ids", "1,2", "--top-k", "3"], "--top-k acts only with a --temperature above 0"),
    (["--prompt-ids", "1,2", "--top-k", "3", "--top-p", "0.5"], "--top-k and --top-p act only with a --temperature"),
    (["--prompt-ids", "1,2", "--precision", "f32", "--kv-cache", "u8"], "f32 is exact"),
    (["--prompt-ids", "1,2", "--logprobs", "2"], "--logprobs 2 reports the log-probabilities in the JSON: add --json"),
])
def test_generate_errors(tiny_export: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                         message: str) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), *args)
    assert code == 2 and message in err


def test_wrong_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tmp_path), "--prompt", "x")
    assert code == 2 and "not a deskfleet export" in err
    code, _, err = run(capsys, "export", str(tmp_path), "-o", str(tmp_path / "out"))
    assert code == 2 and "config.json" in err
    assert not (tmp_path / "out").exists()


def test_generate_with_prompt_lookup_reports_its_rounds(tiny_export: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6,7,5,6,7,5,6", "--max-new-tokens", "16",
            "--ignore-eos", "--precision", "f32", "--json"]
    code, plain, _ = run(capsys, *argv)
    assert code == 0
    code, drafted, _ = run(capsys, *argv, "--prompt-lookup", "--k", "3")
    assert code == 0
    report = json.loads(drafted)
    assert report["tokens"] == json.loads(plain)["tokens"]
    assert sum(report["accepted_histogram"].values()) > 0 and "mean_accepted" in report
    assert 1.0 <= report["mean_k"] <= 3.0  # lookup proposes up to K (3) tokens a round, never none in a round


def test_a_drafter_with_no_drafted_round_reports_no_means(tiny_export: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # "mean_accepted": 0.0 and "mean accepted 0.00" read as a drafter whose every token was rejected
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6", "--max-new-tokens", "1",
            "--prompt-lookup"]
    code, out, _ = run(capsys, *argv, "--json")
    report = json.loads(out)
    assert code == 0 and report["accepted_histogram"] == {}
    assert report["mean_accepted"] is None and report["mean_k"] is None
    code, _, err = run(capsys, *argv)
    assert code == 0 and err.rstrip().endswith("no drafted round]") and "mean accepted" not in err


def test_a_stream_stopped_before_its_first_token_has_no_first_token_time() -> None:
    from types import SimpleNamespace

    from deskfleet.controller.engine import StreamResult
    from deskfleet.controller.run import _report

    results = {0: StreamResult(0, [5, 6], 3, 0.25, 0.5, False), 1: StreamResult(1, [], 3, 0.0, 0.0, False)}
    tokenizer = SimpleNamespace(decode=lambda tokens: "x" * len(tokens))
    engine = SimpleNamespace(chain=None)
    report = _report(engine, tokenizer, results, 1.0, 1, None, False, ["a", "b"])  # type: ignore[arg-type]
    assert [stream["first_token_s"] for stream in report["streams"]] == [0.25, None]  # type: ignore[index]


def test_draft_and_prompt_lookup_together_copy_first(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The model drafts for itself where the context has no match: every round is accepted in full or
    # copied, and the tokens are the plain ones.
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6,7,5,6,7,5,6", "--max-new-tokens", "16",
            "--ignore-eos", "--precision", "f32", "--json"]
    code, plain, _ = run(capsys, *argv)
    assert code == 0
    code, drafted, _ = run(capsys, *argv, "--draft", str(tiny_export), "--prompt-lookup", "--k", "3")
    assert code == 0
    report = json.loads(drafted)
    assert report["tokens"] == json.loads(plain)["tokens"]
    assert sum(report["accepted_histogram"].values()) > 0


def test_drafting_compiles_the_target_with_an_f32_kv_cache(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import deskfleet.controller.run as run_module

    seen = []
    real = run_module.LocalPipeline

    def recording(model: Path, stages: int, settings: Any, manifest: Any = None) -> Any:
        seen.append(settings.kv_cache)
        return real(model, stages, settings, manifest)

    monkeypatch.setattr(run_module, "LocalPipeline", recording)
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6,5,6", "--max-new-tokens", "4",
            "--ignore-eos", "--json"]
    for extra in ([], ["--prompt-lookup"], ["--prompt-lookup", "--kv-cache", "u8"]):
        assert run(capsys, *argv, *extra)[0] == 0
    assert seen == [None, "f32", "u8"]


def test_generate_and_chat_read_the_same_decoding_options() -> None:
    from deskfleet.controller.cli import build_parser
    from deskfleet.controller.decoding_options import DecodingOptions, compile_settings, decoding_arguments

    decoding = ["--draft", "d", "--prompt-lookup", "--k", "3", "--temperature", "0.7",
                "--top-k", "5", "--top-p", "0.9", "--seed", "11"]
    parser = build_parser()
    generate = parser.parse_args(["generate", "--model", "m", "--prompt", "p", *decoding])
    chat = parser.parse_args(["chat", "--model", "m", *decoding])
    options = [DecodingOptions(**decoding_arguments(args, compile_settings(args))) for args in (generate, chat)]
    assert options[0] == options[1]
    assert options[0] == DecodingOptions(draft=Path("d"), prompt_lookup=True, k=3, temperature=0.7,
                                         top_k=5, top_p=0.9, seed=11, settings=compile_settings(generate))
    assert options[0].target_settings().kv_cache == "f32"  # a fast CPU target that drafts keeps an f32 cache
    assert options[0].engine_options(2).fixed_k == 3


@pytest.mark.parametrize(("command", "args", "message"), [
    ("generate", ["--micro-batches", "0"], "argument --micro-batches: must be 1 or more, got 0"),
    ("generate", ["--micro-batches", "-1"], "argument --micro-batches: must be 1 or more, got -1"),
    ("generate", ["--max-rows", "0"], "argument --max-rows: must be 1 or more"),
    ("generate", ["--stages", "0"], "argument --stages: must be 1 or more"),
    ("generate", ["--threads", "0"], "argument --threads: must be 1 or more"),
    ("generate", ["--threads", "2147483648"], "argument --threads: must be at most 1024, got 2147483648"),
    ("generate", ["--max-new-tokens", "x"], "argument --max-new-tokens/--new-tokens: expected a whole number, got 'x'"),
    ("generate", ["--seed", "-1"], "argument --seed: must be 0 or more, got -1"),
    ("generate", ["--k-max", "0"], "argument --k-max: must be 1 or more, got 0"),
    ("generate", ["--k", "-1"], "argument --k: must be 0 or more"),
    ("generate", ["--k", "2", "--k-max", "4"], "argument --k-max: not allowed with argument --k"),
    ("generate", ["--k-max", "1000000000"], "argument --k-max: must be at most 64, got 1000000000"),
    ("generate", ["--k", "65"], "argument --k: must be at most 64, got 65"),
    ("generate", ["--logprobs", "21"], "argument --logprobs: must be from 0 to 20, got 21"),
    ("generate", ["--logprobs", "x"], "argument --logprobs: expected a whole number, got 'x'"),
    ("chat", ["--k-max", "65"], "argument --k-max: must be at most 64, got 65"),
    ("bench speculative", ["--k-max", "10000000000"], "argument --k-max: must be at most 64"),
    ("bench speculative", ["--k", "2", "65"], "argument --k: must be at most 64, got 65"),
    ("chat", ["--stages", "0"], "argument --stages: must be 1 or more"),
    ("chat", ["--seed", "-3"], "argument --seed: must be 0 or more"),
    ("chat", ["--k-max", "-2"], "argument --k-max: must be 1 or more"),
    ("chat", ["--k", "1", "--k-max", "4"], "argument --k-max: not allowed with argument --k"),
])
def test_counts_and_conflicting_options_are_refused_when_parsed(capsys: pytest.CaptureFixture[str], command: str,
                                                                args: list[str], message: str) -> None:
    from deskfleet.controller.cli import build_parser

    prompt = ["--prompt", "p"] if command == "generate" else []
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command.split(), "--model", "m", *prompt, *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_decoding_options_refuse_what_the_cli_refuses() -> None:
    from deskfleet.controller.decoding_options import DecodingOptions

    for fields, message in [({"k_max": 0}, "--k-max must be from 1 to 64, got 0"),
                            ({"k_max": 65, "prompt_lookup": True}, "--k-max must be from 1 to 64, got 65"),
                            ({"k": 65, "prompt_lookup": True}, "--k must be from 0 to 64, got 65"),
                            ({"seed": -1}, "--seed must be 0 or more"),
                            ({"k": 0, "draft": Path("d")}, "--k 0 drafts no tokens"),
                            ({"k": 2}, "--k needs --draft or --prompt-lookup"),
                            ({"k_max": 4}, "--k-max needs --draft or --prompt-lookup"),
                            ({"k": 2, "k_max": 4, "prompt_lookup": True}, "--k and --k-max together"),
                            ({"top_p": 0.0}, "--top-p must be more than 0"),
                            ({"seed": 3}, "--seed acts only with a --temperature above 0")]:
        with pytest.raises(ValueError, match=message):
            DecodingOptions(**fields)  # type: ignore[arg-type]
    assert DecodingOptions(k=0).engine_options(1).fixed_k == 0  # no drafter: K is moot, not an error
    assert DecodingOptions().engine_options(1).k_max == 8
    assert DecodingOptions(draft=Path("d"), k_max=3).engine_options(1).k_max == 3


def test_chat_refuses_k_without_a_drafter_before_reading(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    lines = io.StringIO("hello\n")
    monkeypatch.setattr(sys, "stdin", lines)
    for args in (["--k", "2"], ["--k-max", "3"]):
        code, _, err = run(capsys, "chat", "--model", str(tiny_export), *args)
        assert code == 2 and f"deskfleet: error: {args[0]} needs --draft or --prompt-lookup" in err
    assert lines.tell() == 0


def test_prompts_file_skips_a_bom_and_has_complete_escapes(tmp_path: Path) -> None:
    from deskfleet.controller.run import read_prompts_file

    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffdef f():\\n\\treturn 1\n\n".encode() + rb"C:\\new\\x \d \\\n \ " + b"\r\n")
    assert read_prompts_file(path) == ["def f():\n\treturn 1", "C:\\new\\x \\d \\\n \\ "]
    # two such files joined (`cat a b`): the second's BOM starts a line, and a line of a BOM alone is blank
    path.write_bytes("\ufeffone\n\ufefftwo\n\ufeff\nthree \ufeff four\n".encode())
    assert read_prompts_file(path) == ["one", "two", "three \ufeff four"]


def test_a_prompts_file_line_ends_only_at_a_newline(tmp_path: Path) -> None:
    # Form feeds, other ASCII separators and Unicode line breaks belong to the prompt they stand in.
    from deskfleet.controller.run import read_prompts_file

    inside = "x = 1\fy = 2\v\x1c\x1d\x1e\x85 first\u2028second\u2029third"
    path = tmp_path / "prompts.txt"
    path.write_bytes(f"{inside}\nnext\rlast\r\n".encode())
    assert read_prompts_file(path) == [inside, "next", "last"]


def test_a_prompts_file_past_its_limit_is_refused_without_reading_on(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # /dev/zero as a prompts file filled the memory at 200 MB/s, deaf to SIGTERM
    from deskfleet.controller import run

    monkeypatch.setattr(run, "MAX_PROMPTS_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"--prompts-file /dev/zero holds more than 0 MiB: no list of prompts is "
                                         r"that long"):
        run.read_prompts_file(Path("/dev/zero"))
    path = tmp_path / "prompts.txt"
    path.write_text("x\n" * 500)  # exactly the limit: read
    assert len(run.read_prompts_file(path)) == 500


def test_a_short_utf8_line_with_a_nul_is_not_called_utf16(tmp_path: Path) -> None:
    from deskfleet.controller.run import read_prompts_file

    path = tmp_path / "prompts.txt"
    path.write_bytes(b"def\x00 f(\n")  # one NUL in ten bytes: it was told "is UTF-16 text, not UTF-8"
    with pytest.raises(ValueError, match="holds NUL bytes at byte 3: it is not a text file"):
        read_prompts_file(path)


@pytest.mark.parametrize("content", [None, b"ok\n\xff\xfe\n"])
def test_an_unreadable_prompts_file_is_named(tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             content: bytes | None) -> None:
    path = tmp_path / "prompts.txt"
    if content is None:
        path.mkdir()  # a directory: OSError
    else:
        path.write_bytes(content)
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", str(path))
    assert code == 2 and f"--prompts-file {path}: " in err and "Traceback" not in err
    assert ("Is a directory" if content is None else "not UTF-8 text (it holds the byte 0xff)") in err


@pytest.fixture
def no_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that compiles its stages fails the test: its prompts are to be checked before."""
    import deskfleet.controller.run as run_module

    def refuse(*args: Any) -> None:
        raise AssertionError("the stages compiled before the prompts were checked")

    monkeypatch.setattr(run_module, "LocalPipeline", refuse)


@pytest.mark.usefixtures("no_compile")
def test_a_request_error_names_its_prompt_before_the_stages_compile(
        tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Among several prompts, the one too long for the context (512 tokens) or holding an id outside the
    # vocabulary is named as the user gave it: its --prompt number, or its line in the file.
    path = tmp_path / "prompts.txt"
    path.write_text(f"ok\n\n  \nfine\n{'x' * 600}\n")
    model = ["generate", "--model", str(tiny_export)]
    for args, message in [
        (["--prompt", "ok", "--prompt", "x" * 600], "--prompt #2: 601 prompt tokens + 64 new tokens"),
        (["--prompts-file", str(path)], f"line 5 of --prompts-file {path}: 601 prompt tokens + 64 new tokens"),
        (["--prompt-ids", "1,2", "--prompt-ids", "1,99999"], "--prompt-ids #2: prompt id 99999 at position 1 is "
                                                             "outside the vocabulary"),
        (["--prompt-ids", ""], "--prompt-ids: the prompt is empty"),  # was "--prompt-ids 1:", read as the value 1
    ]:
        code, _, err = run(capsys, *model, *args)
        assert code == 2 and f"deskfleet: error: {message}" in err


@pytest.mark.parametrize("content", ["", "\n  \n\t\n"])
def test_a_prompts_file_without_a_prompt_is_named(tiny_export: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str], content: str) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text(content)
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", str(path))
    assert code == 2 and f"--prompts-file {path} holds no prompt: every line is empty or blank" in err


def test_a_prompt_that_is_not_utf8_is_named(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A byte that is not UTF-8 on the command line reaches Python as a lone surrogate (surrogateescape).
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompt", "ok", "--prompt", "def f\udcff():")
    assert code == 2 and "--prompt #2 is not valid UTF-8 text (byte 0xff at character 5)" in err


def test_a_closed_output_pipe_ends_the_run_quietly(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from deskfleet.controller.cli import BROKEN_PIPE_EXIT

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    code = main(["generate", "--model", str(tiny_export), "--prompt", "def f(x):", "--max-new-tokens", "4",
                 "--ignore-eos"])
    assert code == BROKEN_PIPE_EXIT and capsys.readouterr().err == ""


@pytest.mark.parametrize(("bench", "args", "message"), [
    ("speculative", ["--rounds", "0"], "argument --rounds: must be 1 or more, got 0"),
    ("speculative", ["--k", "2", "0"], "argument --k: must be 1 or more, got 0"),
    ("speculative", ["--k-max", "-1"], "argument --k-max: must be 1 or more, got -1"),
    ("speculative", ["--new-tokens", "0"], "argument --new-tokens/--max-new-tokens: must be 1 or more"),
    ("streams", ["--rounds", "0"], "argument --rounds: must be 1 or more, got 0"),
    ("streams", ["--users", "0"], "argument --users: must be 1 or more"),
    ("streams", ["--core", "-1"], "argument --core: must be 0 or more"),
    ("parity", ["--stages", "0"], "argument --stages: must be 1 or more, got 0"),
    ("parity", ["--new-tokens", "0"], "argument --new-tokens/--max-new-tokens: must be 1 or more"),
    ("rollback", ["--contexts", "0"], "argument --contexts: must be 1 or more, got 0"),
    ("rollback", ["--dead-slots", "-3"], "argument --dead-slots: must be 1 or more, got -3"),
    ("rollback", ["--dead-slots", "0"], "argument --dead-slots: must be 1 or more, got 0"),
    ("rollback", ["--rejected", "0"], "argument --rejected: must be 1 or more"),
    ("fleet", ["--rounds", "0"], "argument --rounds: must be 1 or more, got 0"),
    ("fleet", ["--warmup-rounds", "-1"], "argument --warmup-rounds: must be 0 or more"),
])
def test_bench_counts_are_refused_when_parsed(capsys: pytest.CaptureFixture[str], bench: str, args: list[str],
                                              message: str) -> None:
    from deskfleet.controller.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", bench, "--model", "m", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def ctrl_c_at_the_fifth_printed_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the one stream's text is printed as it comes, at its fifth token."""
    from deskfleet.controller.text_printer import TextPrinter

    push = TextPrinter.push

    def ctrl_c_at_the_fifth_token(self: TextPrinter, stream_id: int, token: int) -> None:
        push(self, stream_id, token)
        if len(self.tokens) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(TextPrinter, "push", ctrl_c_at_the_fifth_token)


def test_ctrl_c_while_text_streams_ends_its_line(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl_c_at_the_fifth_printed_token(monkeypatch)
    code, out, err = run(capsys, "generate", "--model", str(tiny_export), "--prompt", "def f(x):",
                         "--max-new-tokens", "20", "--ignore-eos")
    assert code == 130 and out.endswith("\n") and out.strip() and err == ""


def test_ctrl_c_under_json_keeps_stdout_empty(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import deskfleet.controller.run as run_module

    def ctrl_c_while_compiling(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "LocalPipeline", ctrl_c_while_compiling)
    code, out, err = run(capsys, "generate", "--model", str(tiny_export), "--prompt", "x", "--json")
    assert (code, out, err) == (130, "", "")  # no terminal echoed ^C: no line to end


def test_ctrl_c_before_any_text_writes_no_stray_line_where_no_terminal_shows_it(
        tiny_export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # stdout to a file held a lone "\n" after a Ctrl-C before the first token; on a terminal it ends the ^C line
    import deskfleet.controller.run as run_module
    from deskfleet.controller import text_printer

    def ctrl_c_while_compiling(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "LocalPipeline", ctrl_c_while_compiling)
    assert run(capsys, "generate", "--model", str(tiny_export), "--prompt", "x") == (130, "", "")
    monkeypatch.setattr(text_printer, "is_terminal", lambda out: out is sys.stdout)
    assert run(capsys, "generate", "--model", str(tiny_export), "--prompt", "x") == (130, "\n", "")
    monkeypatch.setattr(text_printer, "is_terminal", lambda out: out is sys.stderr)
    assert run(capsys, "generate", "--model", str(tiny_export), "--prompt", "x", "--json") == (130, "", "\n")


def test_ctrl_c_while_the_commands_load_exits_130_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["export", "x", "-o", "y"]) == 130


@pytest.mark.parametrize("context", ["0", "1", "16777217"])
def test_export_refuses_a_context_out_of_range_as_one_range(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            context: str) -> None:
    # 0 was "must be 1 or more", and 1 then "must be from 2" from the export
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path), "-o", str(tmp_path / "out"), "--max-context", context])
    assert f"argument --max-context: must be from 2 (a prompt token and a new one) to 16,777,216, got {context}" \
        in capsys.readouterr().err


def test_bench_speculative_names_an_empty_prompts_file(tiny_export: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("\n  \n")
    code, _, err = run(capsys, "bench", "speculative", "--model", str(tiny_export), "--draft", str(tiny_export),
                       "--prompts-file", str(path))
    assert code == 2 and f"--prompts-file {path} holds no prompt: every line is empty or blank" in err


@pytest.mark.usefixtures("no_compile")
def test_a_text_prompt_past_an_edited_vocabulary_blames_the_export_not_the_prompt(
        tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A manifest.json whose vocab_size was edited down: the tokenizer's ids for an ordinary prompt fall past it.
    # The user's prompt is not at fault; before, the error read "prompt id 101 at position 1 is outside the
    # vocabulary", as it does (rightly) for --prompt-ids.
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(tiny_export, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["spec"]["vocab_size"] = 100
    (edited / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run(capsys, "generate", "--model", str(edited), "--prompt", "caf\u00e9")
    assert code == 2 and "deskfleet: error: --prompt: the tokenizer encodes this text with token id " in err
    assert "past the model's vocabulary of 100 (manifest.json's vocab_size)" in err and "export the model again" in err
    code, _, err = run(capsys, "generate", "--model", str(edited), "--prompt-ids", "1,150")
    assert code == 2 and "--prompt-ids: prompt id 150 at position 1 is outside the vocabulary (size 100)" in err


def test_several_streams_print_under_the_names_errors_give_their_prompts(
        tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Errors call a prompt "--prompt #2" or "line 3 of --prompts-file F" (1-based, as the user counts them);
    # the texts were headed "stream 0", "stream 1", ..., which matched neither.
    path = tmp_path / "prompts.txt"
    path.write_text("first\n\nsecond\n")
    code, out, _ = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", str(path),
                       "--max-new-tokens", "3", "--ignore-eos")
    assert code == 0
    headers = [line for line in out.splitlines() if line.startswith("--- ")]
    assert headers == [f"--- line 1 of --prompts-file {path}", f"--- line 3 of --prompts-file {path}"]
    code, out, _ = run(capsys, "generate", "--model", str(tiny_export), "--prompt", "a", "--prompt", "b",
                       "--max-new-tokens", "3", "--ignore-eos")
    assert code == 0 and [line for line in out.splitlines() if line.startswith("--- ")] == [
        "--- --prompt #1", "--- --prompt #2"]


def ctrl_c_at_result(count: int) -> type:
    """A LocalPipeline whose `count`-th collect() raises KeyboardInterrupt (Ctrl-C) while the streams run."""
    from deskfleet.controller.pipeline import LocalPipeline

    class CtrlCAtResult(LocalPipeline):
        calls = 0

        def collect(self, timeout: float | None = None) -> Any:
            CtrlCAtResult.calls += 1
            if CtrlCAtResult.calls == count:
                raise KeyboardInterrupt
            return super().collect(timeout)

    return CtrlCAtResult


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_with_several_prompts_keeps_what_the_streams_made(
        tiny_export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, as_json: bool) -> None:
    # Several prompts print when all are done: Ctrl-C threw every stream's text away, finished ones too (a long
    # --prompts-file stopped near its end left nothing). Now each stream's text so far is printed under its
    # label (or, with --json, the report with "stopped": "interrupted"), and the run still exits 130.
    import deskfleet.controller.run as run_module

    argv = ["generate", "--model", str(tiny_export), "--prompt", "def f(x):", "--prompt", "import", "--max-new-tokens",
            "12", "--ignore-eos", "--json"]
    code, out, _ = run(capsys, *argv)
    whole = [stream["tokens"] for stream in json.loads(out)["streams"]]

    monkeypatch.setattr(run_module, "LocalPipeline", ctrl_c_at_result(10))
    code, out, err = run(capsys, *(argv if as_json else argv[:-1]))
    assert code == 130
    if as_json:
        report = json.loads(out)
        assert report["stopped"] == "interrupted" and [stream["label"] for stream in report["streams"]] == [
            "--prompt #1", "--prompt #2"]
        made = [stream["tokens"] for stream in report["streams"]]
        for tokens, full in zip(made, whole, strict=True):
            assert 0 < len(tokens) < 12 and tokens == full[:len(tokens)]
        assert err.startswith("deskfleet: interrupted (0 of 2 stream(s) had finished; ")
        assert err.endswith(" tokens in all, in the JSON on standard output)\n")
    else:
        assert out.startswith("--- --prompt #1\n")  # not after a blank line
        assert [line for line in out.splitlines() if line.startswith("--- ")] == ["--- --prompt #1", "--- --prompt #2"]
        assert err.startswith("deskfleet: interrupted (0 of 2 stream(s) had finished; ") and err.endswith("above)\n")


def test_sampling_without_a_seed_draws_one_and_reports_it(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The seed was 0 unless given: every sampled run of a prompt, every restarted chat, gave the same text.
    from deskfleet.controller import decoding_options

    argv = ["generate", "--model", str(tiny_export), "--prompt", "def f(x):", "--temperature", "1.5",
            "--max-new-tokens", "16", "--ignore-eos", "--json"]
    drawn = [json.loads(run(capsys, *argv)[1])["seed"] for _ in range(2)]
    assert drawn[0] != drawn[1]  # two of 2**31
    monkeypatch.setattr(decoding_options, "random_seed", lambda: 11)
    code, _, err = run(capsys, *argv[:-1])
    assert code == 0 and err.rstrip().endswith(", seed 11]")
    unseeded = json.loads(run(capsys, *argv)[1])
    seeded = json.loads(run(capsys, *argv, "--seed", "11")[1])
    assert unseeded["seed"] == seeded["seed"] == 11 and unseeded["tokens"] == seeded["tokens"]
    greedy = json.loads(run(capsys, *argv[:5], "--max-new-tokens", "4", "--json")[1])
    assert "seed" not in greedy  # nothing drawn where nothing samples
    code, _, err = run(capsys, *argv[:5], "--seed", "4")
    assert code == 2 and "--seed acts only with a --temperature above 0" in err


def test_prompts_files_add_up_and_a_dash_reads_standard_input(
        tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # A second --prompts-file replaced the first without a word (argparse keeps the last); "-" was looked for as
    # a file of that name.
    import io
    import sys

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one\n")
    second.write_text("two\n\nthree\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufefffour\\tand\n".encode())))
    code, out, _ = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", str(first), "--prompts-file",
                       str(second), "--prompts-file", "-", "--max-new-tokens", "2", "--ignore-eos", "--json")
    assert code == 0
    solo = json.loads(run(capsys, "generate", "--model", str(tiny_export), "--prompt", "four\tand",
                          "--max-new-tokens", "2", "--ignore-eos", "--json")[1])
    streams = json.loads(out)["streams"]
    assert len(streams) == 4 and streams[3]["tokens"] == solo["tokens"]
    assert streams[3]["prompt_tokens"] == solo["streams"][0]["prompt_tokens"]
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", str(first),
                       "--prompts-file", str(tmp_path / "missing.txt"))
    assert code == 2 and f"--prompts-file {tmp_path / 'missing.txt'}: No such file or directory" in err


def test_a_prompts_file_given_twice_or_standard_input_closed_is_refused(
        tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    path = tmp_path / "a.txt"
    path.write_text("one\n")
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", "-", "--prompts-file", "-")
    assert code == 2 and "--prompts-file - is given twice: give each file once" in err  # stdin read empty again
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", str(path), "--prompts-file",
                       str(path))
    assert code == 2 and f"--prompts-file {path} is given twice" in err
    link = tmp_path / "link.txt"
    link.symlink_to(path)
    for other in (tmp_path / "x" / ".." / "a.txt", link):  # one file by two names ran every prompt twice
        code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", str(path),
                           "--prompts-file", str(other))
        assert code == 2 and f"--prompts-file {path} and {other} are given twice: give each file once" in err
    monkeypatch.setattr(sys, "stdin", None)  # started with `<&-`: an AttributeError's traceback
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompts-file", "-")
    assert code == 2 and "--prompts-file -: standard input is closed" in err and "Traceback" not in err


def test_a_sampled_run_that_is_interrupted_still_reports_its_seed(
        tiny_export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the seed drawn for the run the user stopped is the one to run it again with: it was in the finished report only
    from deskfleet.controller import decoding_options

    monkeypatch.setattr(decoding_options, "random_seed", lambda: 23)
    ctrl_c_at_the_fifth_printed_token(monkeypatch)
    argv = ["generate", "--model", str(tiny_export), "--prompt", "def f(x):", "--temperature", "1.5",
            "--max-new-tokens", "20", "--ignore-eos"]
    code, _, err = run(capsys, *argv)
    assert code == 130 and err == "deskfleet: interrupted (seed 23)\n"
    import deskfleet.controller.run as run_module

    monkeypatch.setattr(run_module, "LocalPipeline", ctrl_c_at_result(10))
    code, out, err = run(capsys, *argv, "--prompt", "import", "--json")
    assert code == 130 and json.loads(out)["seed"] == 23 and err.rstrip().endswith("; seed 23)")


def test_the_closing_line_of_a_one_token_run_shows_no_speed(tiny_export: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # a stream's speed is its decoding's, after the first token: "[1 tokens, 0.0 tok/s, ...]" read as a stalled run
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompt", "x", "--max-new-tokens", "1")
    assert code == 0 and err.splitlines()[-1] == "[1 token, 1 stage(s)]"
    code, _, err = run(capsys, "generate", "--model", str(tiny_export), "--prompt", "x", "--max-new-tokens", "3",
                       "--ignore-eos")
    assert code == 0 and re.fullmatch(r"\[3 tokens, [0-9.]+ tok/s, 1 stage\(s\)\]", err.splitlines()[-1])


def test_ctrl_c_while_the_stages_close_after_a_finished_run_keeps_its_report(
        tiny_export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the report was made after the chain closed (over the fleet, a release round trip to each stage): a Ctrl-C
    # there lost a run whose every stream had finished
    import deskfleet.controller.run as run_module
    from deskfleet.controller.pipeline import LocalPipeline

    argv = ["generate", "--model", str(tiny_export), "--prompt", "def f(x):", "--prompt", "import", "--max-new-tokens",
            "6", "--ignore-eos", "--json"]
    whole = json.loads(run(capsys, *argv)[1])

    class CtrlCWhileClosing(LocalPipeline):
        def __exit__(self, *exc_info: Any) -> None:
            super().__exit__(*exc_info)
            raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "LocalPipeline", CtrlCWhileClosing)
    code, out, err = run(capsys, *argv)
    report = json.loads(out)
    assert code == 130 and "stopped" not in report
    assert [stream["tokens"] for stream in report["streams"]] == [stream["tokens"] for stream in whole["streams"]]
    assert "deskfleet: interrupted (2 of 2 stream(s) had finished; 12 tokens in all, in the JSON" in err
    code, out, err = run(capsys, *argv[:-1])  # the texts were printed before the chain closed, and only then
    assert code == 130 and [line for line in out.splitlines() if line.startswith("--- ")] == [
        "--- --prompt #1", "--- --prompt #2"]


class CtrlCWhileTheJsonIsWritten(io.StringIO):
    """Standard output that gets a Ctrl-C (a real SIGINT) the first time a JSON object is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    def write(self, text: str) -> int:
        if not self.sent and text.startswith("{"):
            self.sent = True
            signal_main_thread()
            for _ in range(1000):  # Python runs the handler between bytecodes: here, before the text is kept
                pass
        return super().write(text)


def test_a_ctrl_c_while_the_report_is_written_leaves_it_whole(
        tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the report came out cut where the Ctrl-C landed, and a script reading it got half a JSON object
    import sys

    import deskfleet.controller.run as run_module

    argv = ["generate", "--model", str(tiny_export), "--prompt", "def f(x):", "--prompt", "import",
            "--max-new-tokens", "6", "--ignore-eos", "--json"]
    for ctrl_c_first in (False, True):  # a finished run's report; the one a first Ctrl-C made, cut by a second
        if ctrl_c_first:
            monkeypatch.setattr(run_module, "LocalPipeline", ctrl_c_at_result(6))
        out = CtrlCWhileTheJsonIsWritten()
        monkeypatch.setattr(sys, "stdout", out)
        assert main(argv) == 130 and out.sent
        report = json.loads(out.getvalue())
        assert len(report["streams"]) == 2 and ("stopped" in report) == ctrl_c_first


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_every_option_of_generate_and_chat_says_what_it_does(command: str) -> None:
    # --max-new-tokens, --top-k and --top-p had no help, so `--help` hid their defaults (64, 0 and 1)
    import argparse

    from deskfleet.controller.cli import build_parser

    subcommands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    silent = [action.option_strings[0] for action in subcommands.choices[command]._actions
              if action.option_strings and action.help in (None, "")]
    assert silent == []


def test_generate_takes_the_apis_penalties(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--presence-penalty / --frequency-penalty give the engine's tokens with the same penalties (not the plain ones);
    a value out of range is refused naming the option."""
    from deskfleet.controller.engine import StreamRequest

    from .test_engine import run_streams

    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6", "--max-new-tokens", "12", "--ignore-eos",
            "--precision", "f32", "--json"]
    code, out, _ = run(capsys, *argv, "--presence-penalty", "0.5", "--frequency-penalty", "1.5")
    assert code == 0
    tokens = json.loads(out)["streams"][0]["tokens"]
    request = StreamRequest([1, 5, 6], max_new_tokens=12, ignore_eos=True)
    assert tokens == run_streams(tiny_export, [StreamRequest([1, 5, 6], max_new_tokens=12, ignore_eos=True,
                                                             presence_penalty=0.5, frequency_penalty=1.5)])[0]
    assert tokens != run_streams(tiny_export, [request])[0]
    code, _, err = run(capsys, *argv, "--frequency-penalty", "3")
    assert code == 2 and "--frequency-penalty must be from -2 to 2, got 3.0" in err


def test_generate_takes_a_logit_bias(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--logit-bias TOKEN=BIAS, as the API's logit_bias: 100 all but forces a token, -100 bans one, and the tokens equal
    the engine's with the same bias; malformed entries, a repeated token and one past the vocabulary are refused by
    name."""
    from deskfleet.controller.engine import StreamRequest

    from .test_engine import run_streams

    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,5,6", "--max-new-tokens", "12", "--ignore-eos",
            "--precision", "f32", "--json"]
    code, out, _ = run(capsys, *argv, "--logit-bias", "7=100")
    assert code == 0 and json.loads(out)["streams"][0]["tokens"] == [7] * 12
    plain = run_streams(tiny_export, [StreamRequest([1, 5, 6], max_new_tokens=12, ignore_eos=True)])[0]
    banned = plain[0]
    code, out, _ = run(capsys, *argv, "--logit-bias", f"{banned}=-100", "--logit-bias", "9=2.5")
    tokens = json.loads(out)["streams"][0]["tokens"]
    assert code == 0 and banned not in tokens
    assert tokens == run_streams(tiny_export, [StreamRequest([1, 5, 6], max_new_tokens=12, ignore_eos=True,
                                                             logit_bias=((banned, -100.0), (9, 2.5)))])[0]
    for bad, says in ((["7"], "expected TOKEN=BIAS"), (["x=1"], "a whole token id and a number"),
                      (["7=101"], "a bias must be from -100 to 100, got 101"), (["-1=5"], "a token id is 0 or more"),
                      (["7=1", "7=2"], "--logit-bias gives token 7 more than once"),
                      (["1000000=1"], "--logit-bias token 1000000 is outside the model's vocabulary")):
        try:
            code, _, err = run(capsys, *argv, *[f"--logit-bias={entry}" for entry in bad])
        except SystemExit as exited:  # argparse's type errors exit 2 themselves
            code, err = int(exited.code or 0), capsys.readouterr().err
        assert code == 2 and says in err, (bad, err)


def _wrapped_ctrl_c(*args: object) -> Any:
    """What OpenVINO's package raises when a Ctrl-C lands in its import."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as error:
        raise ImportError("initialization failed") from error


def test_a_ctrl_c_that_an_import_wraps_ends_the_command_with_130(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # it ended with a 30-line traceback and exit 1, whether it landed as the commands' modules loaded or as a
    # command imported OpenVINO
    from deskfleet.controller import cli

    monkeypatch.setattr(cli, "check_extras", _wrapped_ctrl_c)
    assert main(["generate", "--model", "m", "--prompt", "x"]) == 130
    monkeypatch.setattr(cli, "build_parser", _wrapped_ctrl_c)
    assert main(["generate", "--model", "m", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == ""

    def broken(*args: object) -> Any:
        raise ImportError("libopenvino.so: cannot open shared object file")

    monkeypatch.setattr(cli, "build_parser", broken)
    with pytest.raises(ImportError, match="cannot open shared object file"):  # any other stays what it is
        main(["generate", "--model", "m", "--prompt", "x"])


@pytest.mark.parametrize("command", [["generate", "--model", "m", "--prompt", "p"], ["chat", "--model", "m"],
                                     ["fleet", "generate", "--model", "m", "--prompt-ids", "1"]])
def test_new_tokens_is_a_name_of_max_new_tokens_as_in_the_benches(command: list[str]) -> None:
    # `generate --new-tokens 5` was refused as unrecognized, though every bench takes it
    from deskfleet.controller.cli import build_parser

    assert build_parser().parse_args([*command, "--new-tokens", "5"]).max_new_tokens == 5
    assert build_parser().parse_args([*command, "--max-new-tokens", "6"]).max_new_tokens == 6
