"""`deskfleet chat`: turns through the chat template, streamed replies equal to a plain engine run."""

from __future__ import annotations

import io
import json
import math
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller import chat, decoding_options
from deskfleet.controller.chat import ChatOptions, run_chat
from deskfleet.controller.cli import main
from deskfleet.controller.engine import ChainBroken, Engine, StreamRequest
from deskfleet.controller.export.random_checkpoint import CHAT_TEMPLATE
from deskfleet.controller.fleet_failover import FailoverError
from deskfleet.controller.fleet_pipeline import ChainError
from deskfleet.controller.generation import GenerationError
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import LOOKUP_PRIOR_ACCEPTANCE
from deskfleet.controller.run import GenerateOptions, run_generate
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer
from tests.controller.test_engine_failover import BreakingChain


def test_chat_streams_replies_from_the_template(tmp_path: Path, tiny_export: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    settings = CompileSettings(precision=Precision.F32)
    out = io.StringIO()
    replies = run_chat(ChatOptions(model=model, max_new_tokens=6, settings=settings),
                       io.StringIO("hello there\n\n/reset\nagain\n/quit\nnever read\n"), out)
    assert replies == 2
    tokenizer = ModelTokenizer(model)
    prompt = tokenizer.encode_chat([ChatMessage("user", "hello there")])
    expected = run_generate(GenerateOptions(model=model, prompt_ids=[prompt], max_new_tokens=6, settings=settings))
    assert out.getvalue().startswith(str(expected["text"]))


def test_chat_with_prompt_lookup_gives_the_plain_reply(tmp_path: Path, tiny_export: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    settings = CompileSettings(precision=Precision.F32)
    replies = {}
    for lookup in (False, True):
        out = io.StringIO()
        run_chat(ChatOptions(model=model, max_new_tokens=12, prompt_lookup=lookup, settings=settings),
                 io.StringIO("say it again and again\n/quit\n"), out)
        replies[lookup] = out.getvalue()
    assert replies[True] == replies[False] and replies[True].strip()


def test_a_drafting_chat_compiles_its_stages_with_an_f32_kv_cache(tiny_export: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import deskfleet.controller.pipeline as pipeline_module

    seen = []

    def recording(model: Path, stages: int, settings: CompileSettings) -> LocalPipeline:
        seen.append(settings.kv_cache)
        return LocalPipeline(model, stages, settings)

    monkeypatch.setattr(pipeline_module, "LocalPipeline", recording)
    for lookup in (False, True):
        run_chat(ChatOptions(model=tiny_export, max_new_tokens=2, prompt_lookup=lookup), io.StringIO("hi\n"),
                 io.StringIO())
    assert seen == [None, "f32"]


def test_a_chat_whose_chain_breaks_resumes_and_keeps_the_new_chain(tmp_path: Path, tiny_export: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet's failover, played by local pipelines: the first chain breaks in the middle of the first
    # reply; the reply resumes on the chain `recover` makes, and the next turn runs on that chain too.
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    settings = CompileSettings(precision=Precision.F32)
    turns = "hello there\nagain, please\n/quit\n"
    plain = io.StringIO()
    run_chat(ChatOptions(model=model, max_new_tokens=10, settings=settings), io.StringIO(turns), plain)

    failover = _chain_that_fails_over(monkeypatch, model, settings)
    out = io.StringIO()
    assert run_chat(ChatOptions(model=model, max_new_tokens=10, settings=settings), io.StringIO(turns), out) == 2
    assert out.getvalue() == plain.getvalue()
    assert len(failover.recovered) == 1  # the second turn ran on the new chain, not the broken one
    assert failover.runs_started == 2


class _Failover:
    """The fleet's failover, played by a local pipeline: a broken chain is replaced by `second`."""

    def __init__(self) -> None:
        self.second: LocalPipeline | None = None
        self.recovered: list[ChainBroken] = []
        self.runs_started = 0

    def __call__(self, error: ChainBroken) -> BreakingChain:
        assert self.second is not None
        self.recovered.append(error)
        return BreakingChain(self.second, None)

    def start_run(self) -> None:  # each reply gets the whole --max-failovers budget
        self.runs_started += 1


class _NoReplans:
    """A fleet chain's failover that made no re-plan and took no PC back."""
    replans: ClassVar[list[dict[str, object]]] = []
    rejoined: ClassVar[list[dict[str, object]]] = []

    def start_run(self) -> None:
        pass


def _chain_that_fails_over(monkeypatch: pytest.MonkeyPatch, model: Path, settings: CompileSettings) -> _Failover:
    """The chat's chain: 2 local stages that break at the 4th step, then a 1-stage one for good."""
    failover = _Failover()

    @contextmanager
    def breaking_chain(options: ChatOptions, chain_settings: CompileSettings
                       ) -> Iterator[tuple[BreakingChain, _Failover]]:
        with LocalPipeline(model, 2, settings) as first, LocalPipeline(model, 1, settings) as second:
            failover.second = second
            yield BreakingChain(first, 4), failover

    monkeypatch.setattr(chat, "_open_chain", breaking_chain)
    return failover


def test_a_message_the_tokenizer_encodes_past_the_vocabulary_blames_the_export(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A tokenizer with a token the model lacks (added after the model was made; export warns of it): the
    # message that holds it is refused naming the export, not the user's text, and the chat goes on.
    model = _chat_model(tmp_path, tiny_export)
    vocab = load_manifest(model).spec.vocab_size
    options = ChatOptions(model=model, max_new_tokens=6, settings=CompileSettings(precision=Precision.F32))
    plain = io.StringIO()
    run_chat(options, io.StringIO("hello there\nagain, please\n"), plain, notes=io.StringIO())
    encode = ModelTokenizer.encode

    def added_token(self: ModelTokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = encode(self, text, add_special_tokens)
        return [*ids, vocab] if "\N{SNOWMAN}" in text else ids

    monkeypatch.setattr(ModelTokenizer, "encode", added_token)
    out, notes = io.StringIO(), io.StringIO()
    lines = io.StringIO("hello there\nlet it \N{SNOWMAN}\nagain, please\n")
    assert run_chat(options, lines, out, notes=notes) == 2
    assert out.getvalue() == plain.getvalue()
    note = notes_but_cuts(notes)
    assert f"[the tokenizer encodes this text with token id {vocab} (at position " in note
    assert f"past the model's vocabulary of {vocab} (manifest.json's vocab_size)" in note
    assert note.rstrip().endswith("export the model again: not sent; the conversation is unchanged]")


def _chat_model(tmp_path: Path, tiny_export: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return model


def _record_sent_conversations(monkeypatch: pytest.MonkeyPatch) -> list[list[ChatMessage]]:
    """The conversation behind each prompt run_chat gives the engine, found among those it had rendered
    (it renders candidates, and sends one of them)."""
    rendered: dict[tuple[int, ...], list[ChatMessage]] = {}
    sent: list[list[ChatMessage]] = []
    render_chats = ModelTokenizer.render_chats

    def recording(self: ModelTokenizer, conversations: list[list[ChatMessage]],
                  add_generation_prompt: bool = True) -> list[str]:
        texts = render_chats(self, conversations, add_generation_prompt)
        for conversation, text in zip(conversations, texts, strict=True):
            rendered[tuple(self.encode(text, add_special_tokens=False))] = list(conversation)
        return texts

    class RecordingEngine(chat.Engine):
        def add(self, request: StreamRequest) -> int:
            sent.append(rendered[tuple(request.prompt_ids)])
            return super().add(request)

    monkeypatch.setattr(ModelTokenizer, "render_chats", recording)
    monkeypatch.setattr(chat, "Engine", RecordingEngine)
    return sent


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_new_tokens": 600}, "--max-new-tokens 600 and the chat template's"),
    ({"max_new_tokens": 8, "system": "s" * 480}, "--system takes 531 tokens with the chat template"),
])
def test_a_chat_that_cannot_fit_a_message_is_refused_before_reading(tmp_path: Path, tiny_export: Path,
                                                                   fields: dict[str, Any], message: str) -> None:
    lines = io.StringIO("hello\n")
    with pytest.raises(GenerationError, match=message):
        run_chat(ChatOptions(model=_chat_model(tmp_path, tiny_export), **fields), lines, io.StringIO())
    assert lines.tell() == 0


class CtrlCAtTheSecondPrompt(io.StringIO):
    def readline(self, size: int | None = -1) -> str:
        if self.tell() > 0:
            raise KeyboardInterrupt
        return super().readline()


@pytest.mark.parametrize("leave", ["ctrl-d", "ctrl-c", "/quit"])
def test_leaving_the_chat_ends_the_prompt_line(tiny_export: Path, leave: str) -> None:
    # Ctrl-D (end of input) and Ctrl-C leave the cursor after `you> `: the chat ends that line, so the
    # shell's prompt does not land on it. /quit was ended by its Enter.
    prompt_out = io.StringIO()
    lines = CtrlCAtTheSecondPrompt("hello\n") if leave == "ctrl-c" else io.StringIO(
        "hello\n" + ("/quit\n" if leave == "/quit" else ""))
    options = ChatOptions(model=tiny_export, max_new_tokens=2)
    if leave == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            run_chat(options, lines, io.StringIO(), prompt_out=prompt_out)
    else:
        assert run_chat(options, lines, io.StringIO(), prompt_out=prompt_out) == 1
    assert prompt_out.getvalue() == ("you> you> " if leave == "/quit" else "you> you> \n")


def test_a_line_ended_by_ctrl_d_gets_its_reply_on_a_line_of_its_own(tiny_export: Path) -> None:
    prompt_out, out = io.StringIO(), io.StringIO()
    assert run_chat(ChatOptions(model=tiny_export, max_new_tokens=2), io.StringIO("hello"), out,
                    prompt_out=prompt_out) == 1
    assert prompt_out.getvalue() == "you> \nyou> \n"


def test_chat_on_a_model_without_a_chat_template_points_to_generate(
        tmp_path: Path, tiny_export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from deskfleet.controller.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    strip_chat_template(model)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model)]) == 2
    assert (f"deskfleet: error: {model} has no chat template, so it cannot chat: use `deskfleet generate --prompt "
            "TEXT` with it instead") in capsys.readouterr().err
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--chat"]) == 2
    assert (f"deskfleet: error: --chat: {model} has no chat template; leave out --chat to give it the prompts as "
            "written") in capsys.readouterr().err


def strip_chat_template(model: Path) -> None:
    """Make the export `model` one of a checkpoint without a chat template: the file, tokenizer_config.json's
    entry and the manifest's mention of it gone (the manifest's entry for tokenizer_config.json kept true)."""
    import hashlib
    import json

    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["files"].pop("chat_template.jinja", None)
    data = (model / "tokenizer_config.json").read_bytes()
    manifest["files"]["tokenizer_config.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest["tokenizer_files"] = [name for name in manifest["tokenizer_files"] if name != "chat_template.jinja"]
    (model / "manifest.json").write_text(json.dumps(manifest))


def test_an_export_that_lost_its_chat_template_file_says_it_is_incomplete(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from deskfleet.controller.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    assert (model / "chat_template.jinja").is_file()
    (model / "chat_template.jinja").unlink()  # its manifest still names it: the export is damaged
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    incomplete = (f"deskfleet: error: {model / 'chat_template.jinja'} is missing, though the export's manifest.json "
                  "names it: the export is incomplete")
    assert main(["chat", "--model", str(model)]) == 2
    assert incomplete in capsys.readouterr().err
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--chat"]) == 2
    assert incomplete in capsys.readouterr().err
    # a prompt given as written needs no template: generate still runs
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--json"]) == 0


def test_the_chat_command_exits_2_when_no_message_fits(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from deskfleet.controller.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(tiny_export), "--max-new-tokens", "512"]) == 2
    assert "leave no room for a message in the model's context of 512 tokens" in capsys.readouterr().err


def test_a_long_chat_drops_its_oldest_exchanges_and_answers(tmp_path: Path, tiny_export: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A byte tokenizer and a context of 512: each 150-letter exchange takes ~190 tokens, so the third
    # message fits only without the first exchange.
    seen = _record_sent_conversations(monkeypatch)
    out, notes = io.StringIO(), io.StringIO()
    turns = "".join(f"{letter * 150}\n" for letter in "abc")
    options = ChatOptions(model=_chat_model(tmp_path, tiny_export), max_new_tokens=4,
                          settings=CompileSettings(precision=Precision.F32))
    assert run_chat(options, io.StringIO(turns), out, notes=notes) == 3
    assert notes_but_cuts(notes) == ("[the conversation outgrew the model's context of 512 tokens: "
                                "dropped its oldest exchange]\n")
    sent = seen[-1]
    assert [m.role for m in sent] == ["user", "assistant", "user"]
    assert [sent[0].content, sent[2].content] == ["b" * 150, "c" * 150]
    # a script reading --json is told the same, on the reply's own line (stderr is for people)
    out = io.StringIO()
    assert run_chat(options, io.StringIO(turns), out, notes=io.StringIO(), as_json=True) == 3
    assert [json.loads(line)["dropped_exchanges"] for line in out.getvalue().splitlines()] == [0, 0, 1]
    # counted in exchanges (a message and its reply), however many one prompt leaves out: after three short
    # exchanges a 400-letter message fits only alone
    out = io.StringIO()
    turns = "".join(f"{letter * 40}\n" for letter in "abc") + "d" * 400 + "\n"
    assert run_chat(options, io.StringIO(turns), out, notes=io.StringIO(), as_json=True) == 4
    assert [json.loads(line)["dropped_exchanges"] for line in out.getvalue().splitlines()] == [0, 0, 0, 3]


def test_a_message_cancelled_before_its_reply_began_does_not_say_it_dropped_exchanges(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "[... outgrew the model's context ...: dropped its oldest exchange]" then "[interrupted before the reply began:
    # not sent; the conversation is unchanged]": the drop is said as the reply begins, so a cancel says only the latter
    model = _chat_model(tmp_path, tiny_export)
    settings = CompileSettings(precision=Precision.F32)
    options = ChatOptions(model=model, max_new_tokens=4, settings=settings)
    chains: list[CtrlCChain] = []
    armed: list[bool] = []
    fit_prompt = chat._fit_prompt

    def arming_fit(*args: Any, **kwargs: Any) -> tuple[list[int], int]:
        prompt, dropped = fit_prompt(*args, **kwargs)
        if dropped and not armed:  # the third message: Ctrl-C at its first collect
            armed.append(True)
            chains[0].break_at = chains[0].collected
        return prompt, dropped

    @contextmanager
    def interruptible_chain(chat_options: ChatOptions,
                            chain_settings: CompileSettings) -> Iterator[tuple[CtrlCChain, None]]:
        with LocalPipeline(model, 2, settings) as pipeline:
            chains.append(CtrlCChain(pipeline, None))
            yield chains[0], None

    monkeypatch.setattr(chat, "_fit_prompt", arming_fit)
    monkeypatch.setattr(chat, "_open_chain", interruptible_chain)
    out, notes = io.StringIO(), io.StringIO()
    turns = "".join(f"{letter * 150}\n" for letter in "abcd")
    assert run_chat(options, io.StringIO(turns), out, notes=notes) == 3
    said = notes_but_cuts(notes)
    # the third message cancelled, saying nothing of a drop; the fourth drops the oldest exchange, and says so
    assert said == ("[interrupted before the reply began: not sent; the conversation is unchanged]\n"
                    "[the conversation outgrew the model's context of 512 tokens: dropped its oldest exchange]\n"), said


def test_a_ctrl_c_after_the_first_token_before_it_showed_text_keeps_the_message(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the note of dropped exchanges is said at the first token; a token that shows no text yet (part of a character)
    # and a Ctrl-C then cancelled the message by the text shown, and the note was followed by "...unchanged"
    first_saying = chat._first_saying

    def interrupted_at_the_first_token(push: Callable[[int, int], None],
                                       say: Callable[[], None]) -> Callable[[int, int], None]:
        def push_nothing_shown(stream_id: int, token: int) -> None:
            raise KeyboardInterrupt
        return first_saying(push_nothing_shown, say)

    monkeypatch.setattr(chat, "_first_saying", interrupted_at_the_first_token)
    options = ChatOptions(model=_chat_model(tmp_path, tiny_export), max_new_tokens=4,
                          settings=CompileSettings(precision=Precision.F32))
    out, notes = io.StringIO(), io.StringIO()
    run_chat(options, io.StringIO("".join(f"{letter * 150}\n" for letter in "abc")), out, notes=notes)
    said = notes_but_cuts(notes)
    assert "dropped its oldest exchange" in said and "unchanged" not in said, said


class CharTokenizer:
    """A conversation renders as its messages, a token per character; it counts the render calls (each a
    child process in ModelTokenizer) and the conversations they render."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def render_chats(self, conversations: list[list[ChatMessage]]) -> list[str]:
        self.calls.append(len(conversations))
        return ["".join(f"<{m.role}>{m.content}" for m in conversation) for conversation in conversations]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(character) for character in text]


def test_fitting_a_long_conversation_takes_at_most_two_render_calls() -> None:
    # The prompt is the one that drops the fewest exchanges and fits, as trying each in turn finds it, but
    # in at most two render calls of about 2 * sqrt(exchanges) conversations in all.
    rng = random.Random(7)
    for exchanges in range(40):
        turns = [ChatMessage(role, "x" * rng.randrange(1, 30)) for _ in range(exchanges)
                 for role in ("user", "assistant")]
        message = ChatMessage("user", "m" * rng.randrange(1, 60))
        whole = CharTokenizer().render_chats([[*turns, message]])[0]
        for room in sorted({1, 10, 40, 70, len(whole) // 2, len(whole) - 1, len(whole), len(whole) + 5}):
            reference = CharTokenizer()
            fits = [(reference.encode(text), dropped) for dropped, text in zip(
                range(0, len(turns) + 1, 2),
                reference.render_chats([[*turns[dropped:], message] for dropped in range(0, len(turns) + 1, 2)]),
                strict=True) if len(text) <= room]
            tokenizer = CharTokenizer()
            if not fits:
                with pytest.raises(GenerationError, match="this message alone makes a prompt"):
                    chat._fit_prompt(tokenizer, [], turns, message, 1, room + 1)  # type: ignore[arg-type]
                system = [ChatMessage("system", "s" * 5)]  # a long --system prompt is named as part of it
                with pytest.raises(GenerationError, match="this message alone with the --system prompt makes a "
                                                          r"prompt of \d+ tokens; .*: shorten it by \d+ tokens"):
                    chat._fit_prompt(CharTokenizer(), system, turns, message, 1,  # type: ignore[arg-type]
                                     room + 1)
            else:
                assert chat._fit_prompt(tokenizer, [], turns, message, 1, room + 1) == fits[0]  # type: ignore[arg-type]
            assert len(tokenizer.calls) <= 2
            assert sum(tokenizer.calls) <= 2 * math.isqrt(exchanges + 1) + 3


@pytest.mark.parametrize(("over", "says"), [(1, "shorten it by 1 token or more"),
                                            (2, "shorten it by 2 tokens or more")])
def test_how_much_to_shorten_a_message_is_said_in_tokens(over: int, says: str) -> None:
    message = ChatMessage("user", "m" * 20)
    alone = len(CharTokenizer().render_chats([[message]])[0])
    with pytest.raises(GenerationError, match=f"{says}$"):  # a room of alone - over, with 1 token of reply
        chat._fit_prompt(CharTokenizer(), [], [], message, 1, alone - over + 1)  # type: ignore[arg-type]


def test_each_turn_of_a_chat_past_its_context_renders_in_at_most_two_requests(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 24 short exchanges overflow the context of 512 (each drops the oldest), then a long message must
    # drop many at once: it was one child process per exchange dropped, and Ctrl-C meanwhile left the chat.
    # (The chat's renderer keeps one child for every request: tests/controller/test_chat_template_renderer.py.)
    from deskfleet.controller.chat_template import TemplateRenderer

    sent = _record_sent_conversations(monkeypatch)
    children: list[tuple[int, list[Any]]] = []  # (the turn, the conversations a request rendered)
    render = TemplateRenderer.render

    def counting(self: TemplateRenderer, template: str, conversations: list[Any]) -> list[str]:
        children.append((len(sent), conversations))
        return render(self, template, conversations)

    monkeypatch.setattr(TemplateRenderer, "render", counting)
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=2, settings=CompileSettings(precision=Precision.F32))
    notes = io.StringIO()
    assert run_chat(options, io.StringIO("hi\n" * 24 + "z" * 300 + "\n"), io.StringIO(), notes=notes) == 25
    per_turn = [sum(turn == number for turn, _ in children) for number in range(25)]
    # the first turn's two more, at the start: the room check and the template's end of turn
    assert per_turn[0] == 3 and max(per_turn[1:]) <= 2
    assert notes_but_cuts(notes).splitlines()[-1].endswith("exchanges]")
    last = [conversation for turn, calls in children if turn == 24 for conversation in calls]
    whole = [ChatMessage(m["role"], m["content"]) for m in max(last, key=lambda c: len(c["messages"]))["messages"]]
    tokenizer = ModelTokenizer(model)
    texts = tokenizer.render_chats([whole[dropped:] for dropped in range(0, len(whole), 2)])
    first_fit = next(dropped for dropped, text in zip(range(0, len(whole), 2), texts, strict=True)
                     if len(tokenizer.encode(text, add_special_tokens=False)) <= 510)
    assert first_fit >= 4 and sent[-1] == whole[first_fit:]


def test_ctrl_c_before_the_reply_begins_cancels_that_message_only(tmp_path: Path, tiny_export: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=6, settings=CompileSettings(precision=Precision.F32))
    plain = io.StringIO()
    run_chat(options, io.StringIO("hello there\nagain, please\n"), plain, notes=io.StringIO())
    render_chats = ModelTokenizer.render_chats

    def interrupted(self: ModelTokenizer, conversations: list[list[ChatMessage]],
                    add_generation_prompt: bool = True) -> list[str]:
        if any(message.content == "slow to render" for conversation in conversations for message in conversation):
            raise KeyboardInterrupt  # Ctrl-C while the template renders
        return render_chats(self, conversations, add_generation_prompt)

    monkeypatch.setattr(ModelTokenizer, "render_chats", interrupted)
    out, notes, prompt_out = io.StringIO(), io.StringIO(), io.StringIO()
    lines = io.StringIO("hello there\nslow to render\nagain, please\n")
    try:
        replies = run_chat(options, lines, out, prompt_out=prompt_out, notes=notes)
    except KeyboardInterrupt:  # caught here: left to pytest, it would stop the whole run
        pytest.fail("Ctrl-C before the reply ended the chat")
    assert replies == 2
    assert out.getvalue() == plain.getvalue()
    assert notes_but_cuts(notes) == "[interrupted before the reply began: not sent; the conversation is unchanged]\n"
    assert prompt_out.getvalue() == "you> you> \nyou> you> \n"  # the ^C's line ended, and the last prompt's


def test_a_message_that_cannot_be_sent_keeps_the_conversation(tmp_path: Path, tiny_export: Path) -> None:
    # Too long alone, or not UTF-8 (a byte that surrogateescape kept): refused with a note, and the
    # next message continues the conversation as if they had never been typed.
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=6, settings=CompileSettings(precision=Precision.F32))
    plain = io.StringIO()
    run_chat(options, io.StringIO("hello there\nagain, please\n"), plain, notes=io.StringIO())
    out, notes = io.StringIO(), io.StringIO()
    lines = io.StringIO(f"hello there\n{'x' * 600}\nd\udcffef f():\nagain, please\n")
    assert run_chat(options, lines, out, notes=notes) == 2
    assert out.getvalue() == plain.getvalue()
    assert notes_but_cuts(notes).splitlines() == [
        "[this message alone makes a prompt of 632 tokens; with --max-new-tokens 6 the model's context of 512 "
        "tokens leaves room for 506: shorten it by 126 tokens or more: not sent; the conversation is unchanged]",
        "[this message is not valid UTF-8 text (byte 0xff at character 1): not sent; the conversation is unchanged]"]


def test_a_message_the_chat_template_refuses_keeps_the_conversation(tmp_path: Path, tiny_export: Path) -> None:
    # The template's own raise_exception, and a render over the 4M-character cap: that message is refused
    # with a note, and the chat goes on as if it had never been typed.
    from deskfleet.controller.chat_template import MAX_RENDERED_CHARS

    model = _chat_model(tmp_path, tiny_export)
    (model / "chat_template.jinja").write_text(
        "{% for message in messages %}{% if message['content'] == 'boom' %}"
        "{{ raise_exception('this template refuses boom') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE)
    options = ChatOptions(model=model, max_new_tokens=6, settings=CompileSettings(precision=Precision.F32))
    plain = io.StringIO()
    run_chat(options, io.StringIO("hello there\nagain, please\n"), plain, notes=io.StringIO())
    out, notes = io.StringIO(), io.StringIO()
    lines = io.StringIO(f"hello there\nboom\n{'x' * MAX_RENDERED_CHARS}\n{'y' * (MAX_RENDERED_CHARS + 1)}\n"
                        "again, please\n")
    assert run_chat(options, lines, out, notes=notes) == 2
    assert out.getvalue() == plain.getvalue()
    assert notes_but_cuts(notes).splitlines() == [
        "[the chat template refused the conversation: this template refuses boom: not sent; the conversation is "
        "unchanged]",
        f"[{model / 'chat_template.jinja'}: the chat template renders more than {MAX_RENDERED_CHARS} characters: not "
        "sent; the conversation is unchanged]",
        # a message past the cap by itself is named as the message, not as the template file's fault
        f"[this message is {MAX_RENDERED_CHARS + 1:,} characters, more than the {MAX_RENDERED_CHARS:,} a chat "
        "template may render: not sent; the conversation is unchanged]"]


class CtrlCChain(BreakingChain):
    """A local pipeline where Ctrl-C lands at its `break_at`-th collect (once)."""

    def collect(self, timeout: float | None = None) -> Any:
        if self.collected == self.break_at:
            self.break_at = None
            raise KeyboardInterrupt
        return super().collect(timeout)


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(tmp_path: Path, tiny_export: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C while the first reply streams (a 2-stage chain: steps in flight): the reply stops, a note says
    # so, the partial reply stays in the conversation, and the next message gets the reply a chat whose
    # first exchange was that partial reply gives; the stages hold nothing afterwards.
    model = _chat_model(tmp_path, tiny_export)
    settings = CompileSettings(precision=Precision.F32)
    options = ChatOptions(model=model, max_new_tokens=12, settings=settings)
    pipelines: list[LocalPipeline] = []

    @contextmanager
    def interrupted_chain(chat_options: ChatOptions,
                          chain_settings: CompileSettings) -> Iterator[tuple[CtrlCChain, None]]:
        with LocalPipeline(model, 2, settings) as pipeline:
            pipelines.append(pipeline)
            yield CtrlCChain(pipeline, 5), None

    seen = _record_sent_conversations(monkeypatch)
    monkeypatch.setattr(chat, "_open_chain", interrupted_chain)
    out, notes = io.StringIO(), io.StringIO()
    assert run_chat(options, io.StringIO("hello there\nagain, please\n"), out, notes=notes) == 2
    assert notes_but_cuts(notes) == ("[interrupted: the reply so far stays in the conversation; Ctrl-C at the prompt "
                                "leaves]\n")
    sent = seen[-1]  # the second turn's prompt
    partial, second = out.getvalue().split("\n", 1)
    tokenizer = ModelTokenizer(model)
    first = tokenizer.encode_chat([ChatMessage("user", "hello there")])
    whole = run_generate(GenerateOptions(model=model, prompt_ids=[first],
                                         max_new_tokens=12, settings=settings))
    assert partial and len(partial) < len(str(whole["text"])) and str(whole["text"]).startswith(partial)
    assert sent == [ChatMessage("user", "hello there"), ChatMessage("assistant", partial),
                    ChatMessage("user", "again, please")]
    expected = run_generate(GenerateOptions(model=model, prompt_ids=[tokenizer.encode_chat(sent)],
                                            max_new_tokens=12, settings=settings))
    assert second == f"{expected['text']}\n"
    assert pipelines[0].micro_batches == (0, 0)


def notes_but_cuts(notes: io.StringIO) -> str:
    """The chat's notes less the one after each reply that ran to --max-new-tokens (these tiny random models'
    replies always do: they never write EOS)."""
    return "".join(line for line in notes.getvalue().splitlines(keepends=True)
                   if not line.startswith("[the reply reached --max-new-tokens"))


def test_a_reply_cut_at_max_new_tokens_says_so_and_one_that_ended_does_not(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chat_model(tmp_path, tiny_export)
    notes = io.StringIO()
    run_chat(ChatOptions(model=model, max_new_tokens=6, settings=CompileSettings(precision=Precision.F32)),
             io.StringIO("hello\n/quit\n"), io.StringIO(), notes=notes)
    assert notes.getvalue() == ("[the reply reached --max-new-tokens 6 and was cut there; a larger --max-new-tokens "
                                "lets replies run longer]\n")
    # at the largest --max-new-tokens the context allows, a larger one is no advice
    prompt = ModelTokenizer(model).encode_chat([ChatMessage("user", "hello")])
    largest = load_manifest(model).spec.max_context - len(prompt)

    class CutEngine(chat.Engine):  # as if the reply had run to --max-new-tokens (this one ends sooner)
        def results(self) -> dict[int, Any]:
            return {stream_id: replace(result, stopped_by_eos=False) for stream_id, result in super().results().items()}

    notes = io.StringIO()
    with monkeypatch.context() as patch:
        patch.setattr(chat, "Engine", CutEngine)
        run_chat(ChatOptions(model=model, max_new_tokens=largest, settings=CompileSettings(precision=Precision.F32)),
                 io.StringIO("hello\n/quit\n"), io.StringIO(), notes=notes)
    assert notes.getvalue() == (f"[the reply reached --max-new-tokens {largest} and was cut there; the model's "
                                "context leaves no room for a longer one]\n")

    class EndingEngine(chat.Engine):  # as if the reply's last token were EOS
        def results(self) -> dict[int, Any]:
            return {stream_id: replace(result, stopped_by_eos=True) for stream_id, result in super().results().items()}

    monkeypatch.setattr(chat, "Engine", EndingEngine)
    notes = io.StringIO()
    run_chat(ChatOptions(model=model, max_new_tokens=6, settings=CompileSettings(precision=Precision.F32)),
             io.StringIO("hello\n/quit\n"), io.StringIO(), notes=notes)
    assert notes.getvalue() == ""


def test_as_json_every_message_sent_gets_one_line_with_its_reply_or_why_not(tmp_path: Path,
                                                                             tiny_export: Path) -> None:
    # Piped, plain replies follow one another on stdout, and a reply of several lines cannot be told from the next.
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=6, settings=CompileSettings(precision=Precision.F32))
    plain = io.StringIO()
    run_chat(options, io.StringIO("hello there\nagain, please\n"), plain, notes=io.StringIO())
    out = io.StringIO()
    lines = io.StringIO(f"hello there\n\n{'x' * 600}\nagain, please\n")
    assert run_chat(options, lines, out, notes=io.StringIO(), as_json=True) == 2
    first, refused, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert first["reply"] + "\n" + second["reply"] + "\n" == plain.getvalue()
    assert (first["stopped"], first["reply_tokens"], first["failovers"]) == ("max_new_tokens", 6, 0)
    assert second["prompt_tokens"] > first["prompt_tokens"]  # the whole conversation
    assert set(second) == {"reply", "stopped", "reply_tokens", "prompt_tokens", "reused_tokens", "seconds", "failovers",
                           "dropped_exchanges"}
    assert first["dropped_exchanges"] == second["dropped_exchanges"] == 0
    assert refused == {"error": "this message alone makes a prompt of 632 tokens; with --max-new-tokens 6 the "
                                "model's context of 512 tokens leaves room for 506: shorten it by 126 tokens or more: "
                                "not sent; the conversation is unchanged"}


def test_the_chat_command_takes_json(tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = _chat_model(tmp_path, tiny_export)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model), "--max-new-tokens", "3", "--precision", "f32", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["reply_tokens"] == 3


def test_the_chat_command_takes_a_logit_bias(tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = _chat_model(tmp_path, tiny_export)
    tokenizer = ModelTokenizer(model)
    forced = tokenizer.encode(" x", add_special_tokens=False)[-1]  # a plain token, no end of turn
    assert forced not in tokenizer.end_of_turn_ids()
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model), "--max-new-tokens", "3", "--precision", "f32", "--json",
                 "--logit-bias", f"{forced}=100"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["reply"] == tokenizer.decode([forced] * 3)
    # one outside the vocabulary is refused at the start (each message was refused, and the chat exited 0)
    vocab = load_manifest(model).spec.vocab_size
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", "--model", str(model), "--max-new-tokens", "3", "--precision", "f32", "--json",
                 "--logit-bias", f"{vocab}=5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"--logit-bias token {vocab} is outside the model's vocabulary" in captured.err


def test_a_bom_before_the_first_message_is_not_sent(tmp_path: Path, tiny_export: Path) -> None:
    # a messages file saved with a BOM (Windows' Notepad) sent it as 3 tokens of the first message
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=3, settings=CompileSettings(precision=Precision.F32))
    replies = []
    for lines in ("hello\nagain\n", "\ufeffhello\nagain\n", "\ufeffhello\n\ufeffagain\n"):  # `cat a b`: two BOMs
        out = io.StringIO()
        run_chat(options, io.StringIO(lines), out, notes=io.StringIO(), as_json=True)
        replies.append([(reply["reply"], reply["prompt_tokens"])
                        for reply in map(json.loads, out.getvalue().splitlines())])
    assert replies[2] == replies[1] == replies[0] and len(replies[0]) == 2


def test_a_mistyped_command_is_not_sent_and_a_message_starting_with_a_slash_is(tmp_path: Path,
                                                                            tiny_export: Path) -> None:
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=3, settings=CompileSettings(precision=Precision.F32))
    out, notes = io.StringIO(), io.StringIO()
    assert run_chat(options, io.StringIO("/rest\n/etc/hosts holds what?\n"), out, notes=notes, as_json=True) == 1
    refused, answered = map(json.loads, out.getvalue().splitlines())
    assert refused == {"error": "/rest is no command (/reset, /quit, /exit): not sent; the conversation is unchanged"}
    assert answered["reply_tokens"] == 3
    assert notes_but_cuts(notes) == "[/rest is no command (/reset, /quit, /exit): not sent; the conversation is " \
                                    "unchanged]\n"


def test_adaptive_k_goes_on_from_turn_to_turn(tmp_path: Path, tiny_export: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Each turn is a run of its own; its first rounds would learn the acceptance from the prior again
    model = _chat_model(tmp_path, tiny_export)
    engines: list[tuple[chat.Engine, float, int]] = []  # each turn's engine, its acceptance and K at its start

    class RecordedEngine(chat.Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append((self, self.k_policy.alpha, self.k_policy.k))

    monkeypatch.setattr(chat, "Engine", RecordedEngine)
    settings = CompileSettings(precision=Precision.F32)
    run_chat(ChatOptions(model=model, max_new_tokens=16, prompt_lookup=True, settings=settings),
             io.StringIO("say it again and again and again\nand again\n/quit\n"), io.StringIO())
    (first, first_alpha, _), (second, second_alpha, second_k) = engines
    assert first_alpha == pytest.approx(LOOKUP_PRIOR_ACCEPTANCE)  # prompt lookup's prior
    assert sum(first.accepted_histogram().values()) > 0  # the first turn drafted, so it learned something
    # the second turn starts from the first's end (its own figures start empty: AdaptiveK.carried)
    assert second_alpha == pytest.approx(first.k_policy.alpha)
    assert second_alpha != pytest.approx(LOOKUP_PRIOR_ACCEPTANCE)
    assert second_k == first.k_policy.k and second is not first


def test_a_fixed_k_or_other_bounds_start_afresh(tiny_export: Path) -> None:
    from deskfleet.common.speculative import AdaptiveK
    from deskfleet.controller.engine import Engine, EngineOptions

    spec = load_manifest(tiny_export).spec
    learned = AdaptiveK(1, 8)
    for _ in range(6):
        learned.record_round(learned.k, 0)  # nothing accepted: the acceptance falls
    chain: Any = object()
    assert Engine(chain, spec, None, EngineOptions(), learned).k_policy.alpha == pytest.approx(learned.alpha)
    assert Engine(chain, spec, None, EngineOptions(k_max=6), learned).k_policy.alpha == pytest.approx(0.6)
    fixed = Engine(chain, spec, None, EngineOptions(fixed_k=3), learned).k_policy
    assert (fixed.k_min, fixed.k_max, fixed.alpha) == (3, 3, pytest.approx(0.6))


def test_after_a_failover_the_next_turn_learns_adaptive_k_afresh(tmp_path: Path, tiny_export: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The new chain's round trips are its own: the costs learned on the broken chain would mislead the next turn
    model = _chat_model(tmp_path, tiny_export)
    settings = CompileSettings(precision=Precision.F32)
    handed: list[object] = []

    class RecordedEngine(chat.Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            handed.append(args[4] if len(args) > 4 else kwargs.get("learned_k"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(chat, "Engine", RecordedEngine)
    failover = _chain_that_fails_over(monkeypatch, model, settings)
    turns = "say it again and again and again\nand again\nonce more\n/quit\n"
    assert run_chat(ChatOptions(model=model, max_new_tokens=12, prompt_lookup=True, settings=settings),
                    io.StringIO(turns), io.StringIO()) == 3
    first, second, third = handed
    assert len(failover.recovered) == 1
    assert first is None and second is None  # the first turn broke its chain and failed over
    assert third is not None  # the second ran on one chain throughout: the third goes on from it


def test_a_sampling_chat_reports_each_replys_seed(tmp_path: Path, tiny_export: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Reply i samples with seed + i; without --seed one is drawn per chat (it was 0: every restarted chat gave
    # the same replies), and --json says which, so a reply can be had again.
    model = _chat_model(tmp_path, tiny_export)
    monkeypatch.setattr(decoding_options, "random_seed", lambda: 40)

    def replies(**fields: Any) -> tuple[list[tuple[Any, str]], str]:
        out, notes = io.StringIO(), io.StringIO()
        run_chat(ChatOptions(model=model, max_new_tokens=8, **fields), io.StringIO("hi\nagain\n"), out,
                 notes=notes, as_json=True)
        return [(reply.get("seed"), reply["reply"]) for reply in map(json.loads, out.getvalue().splitlines())], \
            notes.getvalue()

    seeded, notes = replies(temperature=1.5, seed=7)
    assert [seed for seed, _ in seeded] == [7, 8] and "drawn at random" not in notes
    seeded, _ = replies(temperature=1.5, seed=40)
    drawn, notes = replies(temperature=1.5)
    assert drawn == seeded and [seed for seed, _ in drawn] == [40, 41]  # the replies the seed reported gives
    assert "[sampling with seed 40, drawn at random: --seed 40 gives these replies again]" in notes
    assert [seed for seed, _ in replies()[0]] == [None, None]  # greedy: nothing drawn, nothing reported


@pytest.mark.parametrize("system", ["", " \n\t"])
def test_an_empty_system_prompt_is_refused(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch, system: str) -> None:
    # `--system "$SYSTEM"` with SYSTEM unset chatted without a system prompt, as `--prompt ""` no longer runs
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(tiny_export), "--system", system]) == 2
    assert "deskfleet: error: --system is empty or blank (an unset variable?)" in capsys.readouterr().err


def test_a_template_that_takes_no_system_turn_says_so_when_given_system(
        tmp_path: Path, tiny_export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # it said "deskfleet: error: roles must alternate", naming neither the template nor --system
    import sys

    model = _chat_model(tmp_path, tiny_export)
    (model / "chat_template.jinja").write_text(
        "{% if messages[0].role == 'system' %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model), "--system", "be brief"]) == 2
    err = capsys.readouterr().err
    assert ("deskfleet: error: the chat template refused the conversation: roles "
            "must alternate (it takes the conversation without --system: this template takes no system turn; leave "
            "out --system, or put it in your first message)") in err
    (model / "chat_template.jinja").write_text("{{ raise_exception('no chat here') }}")  # refuses every conversation
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(model), "--system", "be brief"]) == 2
    err = capsys.readouterr().err
    assert "refused the conversation: no chat here" in err and "--system" not in err


class _TerminalGoneAfter(io.StringIO):
    """Messages that end with the read failing as a tty whose window or SSH session closed does (EIO)."""

    def readline(self, size: int | None = -1) -> str:
        line = super().readline()
        if not line:
            raise OSError(5, "Input/output error")
        return line


def test_a_terminal_gone_mid_chat_ends_it_in_one_line(tmp_path: Path, tiny_export: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # reading the next message raised OSError EIO up through the command: a Python traceback
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    monkeypatch.setattr("sys.stdin", _TerminalGoneAfter("hello\n"))
    assert main(["chat", "--model", str(model), "--max-new-tokens", "2"]) == 1
    assert capsys.readouterr().err.endswith(
        "deskfleet: error: standard input could not be read (Input/output error): the terminal or pipe the "
        "messages came from is gone; the chat ended there\n")


def test_a_fleet_replies_json_gives_the_re_plans_since_the_reply_before(tmp_path: Path, tiny_export: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A re-plan as the chain opened (a PC gone since the deploy) was warned of, but no reply's JSON said so
    model = _chat_model(tmp_path, tiny_export)

    class OpenedAfterAReplan:
        replans: ClassVar[list[dict[str, object]]] = [{"error": "agent a: the link closed", "adopted": False}]
        # and a PC left out by an earlier run's re-plan taken back first (FleetFailover.rejoin)
        rejoined: ClassVar[list[dict[str, object]]] = [{"agents": ["b" * 52], "stages": [["b" * 52, 0, 4]]}]

        def start_run(self) -> None:
            pass

    @contextmanager
    def fleet_chain(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[LocalPipeline, object]]:
        with LocalPipeline(model, 1, settings) as pipeline:
            yield pipeline, OpenedAfterAReplan()

    monkeypatch.setattr(chat, "_open_chain", fleet_chain)
    out = io.StringIO()
    run_chat(ChatOptions(model=model, max_new_tokens=3, settings=CompileSettings(precision=Precision.F32)),
             io.StringIO("hello\nagain\n"), out, as_json=True)
    first, second = map(json.loads, out.getvalue().splitlines())
    assert first["replans"] == OpenedAfterAReplan.replans and second["replans"] == []
    assert first["rejoined"] == OpenedAfterAReplan.rejoined and "rejoined" not in second


def test_a_fleet_chat_takes_a_pc_back_between_replies(tmp_path: Path, tiny_export: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A chat took PCs back only when it started: a PC its user paused and resumed stayed out of a long chat's chain
    model = _chat_model(tmp_path, tiny_export)
    opened: list[int] = []
    looks: list[int] = []

    class Reopened:
        replans: ClassVar[list[dict[str, object]]] = []

        def __init__(self) -> None:
            self.rejoined = [{"agents": ["b" * 52]}] if opened else []  # the second opening took B back

        def start_run(self) -> None:
            pass

    @contextmanager
    def fleet_chain(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[LocalPipeline, object]]:
        with LocalPipeline(model, 1, settings) as pipeline:
            failover = Reopened()
            opened.append(1)
            yield pipeline, failover

    def look() -> bool:
        looks.append(len(opened))
        return len(looks) == 2  # B called in after the first reply

    monkeypatch.setattr(chat, "_open_chain", fleet_chain)
    monkeypatch.setattr(chat, "_take_back_look", lambda options: look)
    options = ChatOptions(model=model, max_new_tokens=4, reuse_kv=True, fleet_dir=tmp_path / "fleet",
                          settings=CompileSettings(precision=Precision.F32))
    out = io.StringIO()
    run_chat(options, io.StringIO("hello\nagain\nand again\n"), out, as_json=True)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert looks == [1, 1, 2] and len(opened) == 2  # a look before each message; the second reopened the chain
    assert "rejoined" not in replies[0] and replies[1]["rejoined"] == [{"agents": ["b" * 52]}]
    assert "rejoined" not in replies[2]
    assert replies[1]["reused_tokens"] == 0 and replies[2]["reused_tokens"] > 0  # the kept state went with the chain
    monkeypatch.setattr(chat, "_take_back_look", lambda options: None)
    local = io.StringIO()
    run_chat(ChatOptions(model=model, max_new_tokens=4, settings=CompileSettings(precision=Precision.F32)),
             io.StringIO("hello\nagain\nand again\n"), local, as_json=True)
    assert [reply["reply"] for reply in replies] == [json.loads(line)["reply"]
                                                     for line in local.getvalue().splitlines()]


def test_a_reply_whose_chain_broke_past_re_planning_fails_alone_and_the_next_opens_the_chain_again(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # From an exploratory test: a kill -9 under --max-failovers 0 ended the chat with a usage error's status 2, the
    # reply's JSON line unwritten and the conversation lost
    model = _chat_model(tmp_path, tiny_export)
    opened: list[int] = []
    runs: list[int] = []

    @contextmanager
    def fleet_chain(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[LocalPipeline, object]]:
        opened.append(1)
        with LocalPipeline(model, 1, settings) as pipeline:
            yield pipeline, _NoReplans()

    class BreaksOnTheSecondReply(Engine):
        def run(self, on_token: Any = None, recover: Any = None, feed: Any = None) -> Any:
            runs.append(1)
            if len(runs) != 2:
                return super().run(on_token=on_token, recover=recover, feed=feed)

            def breaking(stream_id: int, token: int) -> None:
                on_token(stream_id, token)
                raise FailoverError("agent b: the link closed (gave up: 0 re-plan(s) already in this run, "
                                    "--max-failovers 0)")
            return super().run(on_token=breaking, recover=recover, feed=feed)

    monkeypatch.setattr(chat, "_open_chain", fleet_chain)
    monkeypatch.setattr(chat, "_take_back_look", lambda options: None)
    monkeypatch.setattr(chat, "Engine", BreaksOnTheSecondReply)
    options = ChatOptions(model=model, max_new_tokens=4, reuse_kv=True, fleet_dir=tmp_path / "fleet",
                          settings=CompileSettings(precision=Precision.F32))
    out = io.StringIO()
    assert run_chat(options, io.StringIO("hello\nagain\nand again\n"), out, as_json=True) == 2
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == 3 and "reply" in replies[0] and "reply" in replies[2]
    assert replies[1]["error"].startswith("the reply failed: agent b: the link closed (gave up: 0 re-plan(s)") and \
        replies[1]["error"].endswith("the next message opens the chain again, re-planning over the PCs that answer "
                                     "where --max-failovers allows (with 0, only once the lost PCs are back)")
    assert replies[1]["failovers"] == 0 and replies[1]["replans"] == []  # as a reply's line lists them
    assert len(opened) == 2  # the broken chain closed, and the third message opened another
    # the conversation went on as if the failed message had not been sent
    local = io.StringIO()
    run_chat(ChatOptions(model=model, max_new_tokens=4, settings=CompileSettings(precision=Precision.F32)),
             io.StringIO("hello\nand again\n"), local, as_json=True)
    assert [replies[0]["reply"], replies[2]["reply"]] == [json.loads(line)["reply"]
                                                          for line in local.getvalue().splitlines()]


def test_a_chain_that_does_not_open_again_for_a_pc_back_costs_one_message_not_the_chat(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the chain that worked was closed for the PC back; a reopening that failed (the re-plan, a chain that did not
    # open) ended the whole chat, its conversation lost; a look that raised did too
    model = _chat_model(tmp_path, tiny_export)
    opened: list[int] = []

    @contextmanager
    def fleet_chain(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[LocalPipeline, object]]:
        opened.append(1)
        if len(opened) == 2:
            raise ChainError("agent b: cannot reach 127.0.0.1:7432", "b" * 52)
        with LocalPipeline(model, 1, settings) as pipeline:
            yield pipeline, _NoReplans()

    looks = iter([False, True, OSError("agents.json is being written"), False])

    def look() -> bool:
        said = next(looks)
        if isinstance(said, Exception):
            raise said
        return said

    monkeypatch.setattr(chat, "_open_chain", fleet_chain)
    monkeypatch.setattr(chat, "_take_back_look", lambda options: look)
    options = ChatOptions(model=model, max_new_tokens=4, fleet_dir=tmp_path / "fleet",
                          settings=CompileSettings(precision=Precision.F32))
    out = io.StringIO()
    assert run_chat(options, io.StringIO("hello\nagain\nagain\nand again\n"), out, as_json=True) == 3
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert "reply" in replies[0] and "reply" in replies[2] and "reply" in replies[3]
    assert replies[1]["error"].startswith("the chain could not be opened again (agent b: cannot reach")
    assert len(opened) == 3  # the message after the failed reopening opened it again


def test_generate_chat_names_the_prompt_the_template_refused(tmp_path: Path, tiny_export: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # "the chat template refused the conversation: no bad words", and which of 10,000 lines it was left to guess
    model = _chat_model(tmp_path, tiny_export)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if 'bad' in m.content %}{{ raise_exception('no bad words') }}{% endif %}"
        "{% endfor %}" + CHAT_TEMPLATE)
    common = ["generate", "--model", str(model), "--chat", "--max-new-tokens", "1"]
    assert main([*common, "--prompt", "ok", "--prompt", "ok2", "--prompt", "bad"]) == 2
    assert "deskfleet: error: --prompt #3: the chat template refused the conversation: no bad words" in \
        capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("fine\n\nalso fine\nbad one\n")
    assert main([*common, "--prompts-file", str(prompts)]) == 2
    assert f"deskfleet: error: line 4 of --prompts-file {prompts}: the chat template refused" in capsys.readouterr().err


def test_a_render_error_names_its_conversation_across_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller import chat_template
    from deskfleet.controller.chat_template import ChatTemplateRefusal, render_isolated

    monkeypatch.setattr(chat_template, "RENDER_BATCH_CONVERSATIONS", 2)  # 5 conversations: 3 child processes
    template = ("{% if messages[0].content == 'no' %}{{ raise_exception('refused') }}{% endif %}"
                "{{ messages[0].content }}")
    conversations = [{"messages": [{"role": "user", "content": text}]} for text in ("a", "b", "c", "no", "e")]
    with pytest.raises(ChatTemplateRefusal) as refused:
        render_isolated(template, conversations)
    assert refused.value.conversation == 3
    with pytest.raises(chat_template.ChatTemplateError) as failed:
        render_isolated("{% for %}", conversations)  # one that does not compile fails on none
    assert failed.value.conversation is None
    assert render_isolated(template, conversations[:3]) == ["a", "b", "c"]


def test_ctrl_c_before_the_first_reply_token_cancels_that_message(tmp_path: Path, tiny_export: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # a Ctrl-C while the chain prefilled kept the message with an empty reply: the model saw both next turn, and
    # they took context, where the docs say a Ctrl-C before the reply begins cancels the message
    model = _chat_model(tmp_path, tiny_export)
    settings = CompileSettings(precision=Precision.F32)
    options = ChatOptions(model=model, max_new_tokens=6, settings=settings)

    @contextmanager
    def interrupted_chain(chat_options: ChatOptions,
                          chain_settings: CompileSettings) -> Iterator[tuple[CtrlCChain, None]]:
        with LocalPipeline(model, 2, settings) as pipeline:
            yield CtrlCChain(pipeline, 0), None  # at the first collect: no token shown yet

    seen = _record_sent_conversations(monkeypatch)
    monkeypatch.setattr(chat, "_open_chain", interrupted_chain)
    out, notes = io.StringIO(), io.StringIO()
    assert run_chat(options, io.StringIO("hello there\nagain, please\n"), out, notes=notes, as_json=True) == 1
    said = [json.loads(line) for line in out.getvalue().splitlines()]
    assert said[0] == {"error": "interrupted before the reply began: not sent; the conversation is unchanged"}
    assert notes_but_cuts(notes).startswith("[interrupted before the reply began: not sent; the conversation is "
                                            "unchanged]\n")
    assert seen[-1] == [ChatMessage("user", "again, please")]  # the cancelled message is not in the conversation


def test_a_message_keeps_its_indentation_and_loses_only_its_line_ending(tmp_path: Path, tiny_export: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # a pasted line of code was stripped: "    return x" went to the model as "return x"
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=2, settings=CompileSettings(precision=Precision.F32))
    seen = _record_sent_conversations(monkeypatch)
    assert run_chat(options, io.StringIO("    return x\r\n  \n /reset \n"), io.StringIO(), notes=io.StringIO()) == 1
    assert seen == [[ChatMessage("user", "    return x")]]  # the blank line skipped, the spaced /reset a command
