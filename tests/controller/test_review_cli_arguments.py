"""`deskfleet`'s argument errors: an unknown argument is reported first, by the command it was given to and
with that command's usage; no option is taken by an abbreviation of its name."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.cli import main as agent_main
from deskfleet.controller.cli import main


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_an_unknown_option_is_reported_before_a_missing_required_one(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(capsys, "generate", "--model", "T", "--promt", "hi")
    assert "deskfleet generate: error: unrecognized arguments: --promt hi" in err
    assert "is required" not in err
    err = parse_error(capsys, "chat", "--modle", "T")
    assert "deskfleet chat: error: unrecognized arguments: --modle T" in err


def test_an_unknown_option_before_the_command_is_reported_before_the_commands_missing_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    # `deskfleet --verb generate` said only "the following arguments are required: --model"
    err = parse_error(capsys, "--verb", "generate")
    assert "deskfleet: error: unrecognized arguments: --verb" in err and "required" not in err
    err = parse_error(capsys, "fleet", "--bogus", "ls")
    assert "deskfleet fleet: error: unrecognized arguments: --bogus" in err
    for verbose in ("-v", "-vv"):  # a known one (and a cluster of them) lets the command say what it lacks
        err = parse_error(capsys, verbose, "generate")
        assert "deskfleet generate: error: the following arguments are required: --model" in err


def test_an_unknown_option_is_reported_with_the_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(capsys, "generate", "--model", "T", "--prompt", "hi", "--max_new_tokens", "5")
    assert err.startswith("usage: deskfleet generate ")
    assert "deskfleet generate: error: unrecognized arguments: --max_new_tokens 5" in err
    err = parse_error(capsys, "bench", "parity", "--model", "T", "--bogus")
    assert err.startswith("usage: deskfleet bench parity ")
    assert "deskfleet bench parity: error: unrecognized arguments: --bogus" in err


def test_other_errors_are_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(capsys, "generate", "--prompt", "hi")
    assert "deskfleet generate: error: the following arguments are required: --model" in err
    err = parse_error(capsys, "generate", "--model", "T")
    assert "one of the arguments --prompt --prompts-file --prompt-ids is required" in err
    err = parse_error(capsys, "generate", "--model", "T", "--prompt", "hi", "--max-new-tokens", "x")
    assert "argument --max-new-tokens/--new-tokens: expected a whole number" in err
    err = parse_error(capsys, "generat")
    assert "invalid choice: 'generat'" in err


@pytest.mark.parametrize("argv", [["bench", "serve", "--model", "T", "--users", "1", "100000"],
                                  ["bench", "streams", "--model", "T", "--users", "257"],
                                  ["bench", "admission", "--model", "T", "--running", "100000"]])
def test_a_bench_of_more_users_than_one_pc_serves_is_refused(capsys: pytest.CaptureFixture[str],
                                                            argv: list[str]) -> None:
    # `bench serve --users 100000` grew its clients' process to 360 MB in 27 s and never ended
    assert "must be at most 256, got" in parse_error(capsys, *argv)


@pytest.mark.parametrize(("argv", "abbreviation"), [
    (["export", "checkpoint", "-o", "out", "--weight", "int4"], "--weight"),
    (["generate", "--model", "T", "--prompt", "hi", "--max-new-token", "5"], "--max-new-token"),
    (["chat", "--model", "T", "--sys", "be brief"], "--sys"),
    (["fleet", "ls", "--data", "d"], "--data"),
])
def test_an_abbreviated_option_is_refused(capsys: pytest.CaptureFixture[str], argv: list[str],
                                          abbreviation: str) -> None:
    err = parse_error(capsys, *argv)
    assert f"unrecognized arguments: {abbreviation}" in err


def test_the_state_a_relaxed_parse_changes_is_restored(capsys: pytest.CaptureFixture[str]) -> None:
    from deskfleet.controller.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model", "T", "--promt", "hi"])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # --model and a prompt are still required
        parser.parse_args(["generate"])
    assert "the following arguments are required: --model" in capsys.readouterr().err


def test_export_to_an_empty_output_is_refused_and_the_current_folder_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # `-o "$OUT"` with OUT unset replaced the export in the current folder with another model (--overwrite).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit) as exited:
        main(["export", "assets-not-read", "-o", "", "--overwrite"])
    assert exited.value.code == 2
    assert "argument -o/--output: is empty (an unset variable?)" in capsys.readouterr().err
    assert (tmp_path / "manifest.json").read_text() == "{}"
    for command in (["generate", "--model", "", "--prompt", "x"], ["chat", "--model", "m", "--draft", ""],
                    ["fleet", "ls", "--data-dir", ""]):
        with pytest.raises(SystemExit):
            main(command)
        assert "is empty (an unset variable?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agent_main(["--data-dir", "", "pause"])
    assert "is empty (an unset variable?)" in capsys.readouterr().err


def test_a_working_directory_that_no_longer_exists_is_named_before_anything_runs(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # after `export -o . --overwrite` the shell sat in the replaced folder: the next export died importing torch
    # ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"), and `generate --model .` called `.` no export
    import os

    from deskfleet.controller.cli import main

    def gone() -> str:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "getcwd", gone)
    assert main(["generate", "--model", ".", "--prompt", "hi"]) == 2
    assert "the working directory no longer exists (an export with --overwrite replaced it, or it was removed): " \
           "cd into it again" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ("generate", "--model", "T", "--prompt", "hi", "--seed", "\u0661"),  # an Arabic-Indic 1: ran with seed 1
    ("generate", "--model", "T", "--prompt", "hi", "--top-p", "1_0"),  # ran with top-p 10.0
    ("generate", "--model", "T", "--prompt", "hi", "--temperature", "\uff10.5"),  # a full-width 0
    ("generate", "--model", "T", "--prompt", "hi", "--top-k", "4_0"),
    ("generate", "--model", "T", "--prompt", "hi", "--max-new-tokens", "1_000"),
    ("fleet", "plan", "--layers", "8_0", "--layer-bytes", "1e9", "--assume-agent", "16e9"),
    ("fleet", "plan", "--layers", "8", "--layer-bytes", "1_000", "--assume-agent", "16e9"),
    ("fleet", "plan", "--layers", "8", "--layer-bytes", "1e9", "--assume-agent", "16e9", "--hop-ms", "\u0661"),
    ("fleet", "token", "--uses", "\u0663"),
    ("fleet", "ls", "--discover-seconds", "1_0"),
])
def test_a_number_not_written_with_the_digits_0_to_9_is_refused(capsys: pytest.CaptureFixture[str],
                                                                 argv: tuple[str, ...]) -> None:
    # Python's int and float take other scripts' digits and underscores between digits: such a value ran as a
    # number nobody typed
    err = parse_error(capsys, *argv)
    (bad,) = [value for value in argv if not value.isascii() or "_" in value]
    assert "error: argument" in err and bad in err


def test_numbers_typed_plainly_still_parse() -> None:
    from deskfleet.common.arguments import real_number, whole_number

    assert whole_number(" 42 ") == 42 and whole_number("-3") == -3  # int's own spaces and signs stay
    assert real_number("1e9") == 1e9 and real_number(".5") == 0.5 and real_number("inf") == float("inf")
    for bad in ("\u0661", "1_0", "\uff11", "\u00b2"):
        with pytest.raises(ValueError, match="is not a number written with the digits 0-9"):
            whole_number(bad)
        with pytest.raises(ValueError, match="is not a number written with the digits 0-9"):
            real_number(bad)
