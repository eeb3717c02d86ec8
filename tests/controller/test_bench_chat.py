"""`bench chat` on a tiny model: its JSON report (the resumed turns feed less and reply as the whole ones in f32),
the inputs it refuses, and its command line."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import ManifestError
from deskfleet.controller import cli
from deskfleet.controller.bench.chat_turns import run_chat_bench
from deskfleet.controller.export.random_checkpoint import CHAT_TEMPLATE
from deskfleet.controller.tokenizer import ChatTemplateError
from tests.controller.test_chat import strip_chat_template

F32 = CompileSettings(precision=Precision.F32)


def _chat_model(tmp_path: Path, tiny_export: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return model


def test_the_report_gives_each_turn_resumed_and_whole(tmp_path: Path, tiny_export: Path) -> None:
    model = _chat_model(tmp_path, tiny_export)
    report = run_chat_bench(model, turns=3, reply_tokens=5, rounds=1, settings=F32, progress=False,
                            messages=["def f(x):\n    return x " + "# the function returns x unchanged " * 4, "again",
                                      "once more, please", "unused"])
    json.dumps(report)
    assert report["replies_identical"] is True and report["precision"] == "f32"
    turns = report["per_turn"]
    assert [turn["turn"] for turn in turns] == [1, 2, 3]
    assert turns[0]["fed_tokens"] == turns[0]["prompt_tokens"]  # nothing to resume yet
    for before, turn in itertools.pairwise(turns):
        # the resumed turn feeds less than the conversation so far: the last reply's last token, the new message
        assert 0 < turn["fed_tokens"] < turn["prompt_tokens"] - before["prompt_tokens"] + 5
        assert set(turn["first_token_s"]) == {"resumed", "whole"} and turn["render_s"] > 0
    summary = report["summary"]
    assert summary["fed_tokens_turns_2_on"] == {"resumed": sum(t["fed_tokens"] for t in turns[1:]),
                                                "whole": sum(t["prompt_tokens"] for t in turns[1:])}


def test_bad_inputs_are_refused_before_anything_compiles(tmp_path: Path, tiny_export: Path) -> None:
    model = _chat_model(tmp_path, tiny_export)
    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    strip_chat_template(bare)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        run_chat_bench(bare, turns=2)
    with pytest.raises(ValueError, match=r"^--turns 3 needs 3 non-empty messages, got 2$"):
        run_chat_bench(model, turns=3, messages=["a", "b"])
    with pytest.raises(ValueError, match=r"^--turns 2 needs 2 non-empty messages: message 2 is empty$"):
        run_chat_bench(model, turns=2, messages=["a", "  \n "])
    with pytest.raises(ValueError, match="--turns must be 1 or more, got 0"):
        run_chat_bench(model, turns=0)
    with pytest.raises(ManifestError, match="nowhere does not exist"):
        run_chat_bench(tmp_path / "nowhere", turns=2)


def test_replies_too_long_for_the_context_are_refused_naming_reply_tokens(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # it said "--max-new-tokens", an option bench chat does not have, after compiling the model
    from deskfleet.controller.bench import chat_turns
    from deskfleet.controller.generation import GenerationError

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled before the check")

    monkeypatch.setattr(chat_turns, "LocalPipeline", no_compiling)
    with pytest.raises(GenerationError, match=r"^--reply-tokens 100000 and the chat template's \d+ tokens leave no "
                                              r"room .*\(give --reply-tokens \d+ or less\)"):
        run_chat_bench(_chat_model(tmp_path, tiny_export), turns=2, reply_tokens=100_000)
    # room for an empty message, none for the second message given: it ran, then "answered 1 of 2 messages"
    model = _chat_model(tmp_path / "2", tiny_export)
    from deskfleet.common.model_spec import load_manifest
    from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

    context = load_manifest(model).spec.max_context
    tokenizer = ModelTokenizer(model)
    long_message = "def f(x): return x " * 20
    prompt = len(tokenizer.encode_chat([ChatMessage("user", " ".join(long_message.split()))]))
    room = context - prompt
    with pytest.raises(ValueError, match=rf"^--reply-tokens {room + 1}: message 2 alone takes {prompt} tokens with "
                                         rf"the chat template, .* \(give --reply-tokens {room} or less\)"):
        run_chat_bench(model, turns=2, reply_tokens=room + 1, messages=["x", long_message])


def test_the_command_line(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["bench", "chat", "--model", "m", "--turns", "4", "--reply-tokens", "16",
                                          "--messages-file", str(tmp_path / "messages.txt")])
    assert (args.turns, args.reply_tokens, args.rounds, args.stages) == (4, 16, 3, 1)
    assert args.messages_file == tmp_path / "messages.txt"
    assert cli.build_parser().parse_args(["chat", "--model", "m", "--no-reuse-kv"]).reuse_kv is False
    assert cli.build_parser().parse_args(["chat", "--model", "m"]).reuse_kv is True


def test_the_messages_file_is_read_as_a_prompts_file_and_named_in_its_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller.bench import chat_turns

    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes(b"hello\ncaf\xe9\n")
    for path, error in ((tmp_path, f"--messages-file {tmp_path}: Is a directory"),
                        (tmp_path / "missing.txt", "No such file or directory"),
                        (not_utf8, f"line 2 of --messages-file {not_utf8}: not UTF-8 text")):
        assert cli.main(["bench", "chat", "--model", str(tmp_path / "no-model"), "--messages-file", str(path)]) == 2
        assert error in capsys.readouterr().err
    given: list[list[str]] = []
    monkeypatch.setattr(chat_turns, "run_chat_bench", lambda model, messages, **options: given.append(messages) or {})
    messages = tmp_path / "messages.txt"
    messages.write_bytes("\ufeffdef f():\\n    return 1\n\n  \nsecond".encode())
    assert cli.main(["bench", "chat", "--model", str(tmp_path), "--messages-file", str(messages)]) == 0
    assert given == [["def f():\n    return 1", "second"]]  # no BOM, escapes read, blank lines skipped


def test_a_ctrl_c_stops_the_bench_instead_of_one_reply(tmp_path: Path, tiny_export: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # run_chat stops a reply on Ctrl-C and goes on (a person at the terminal); the bench timed the cut reply
    # as a whole one, finished its rounds and exited 0 with the report
    from deskfleet.controller import chat

    model = _chat_model(tmp_path, tiny_export)
    real_run, calls = chat.Engine.run, itertools.count()

    def interrupted_third_reply(engine: chat.Engine, *args: object, **kwargs: object) -> object:
        if next(calls) == 2:
            raise KeyboardInterrupt
        return real_run(engine, *args, **kwargs)

    monkeypatch.setattr(chat.Engine, "run", interrupted_third_reply)
    with pytest.raises(KeyboardInterrupt):
        run_chat_bench(model, turns=2, reply_tokens=3, rounds=2, settings=F32, progress=False,
                       messages=["a", "b"])
    assert next(calls) == 3  # nothing ran after it
