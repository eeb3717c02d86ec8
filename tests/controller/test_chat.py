"""`deskfleet chat`: turns through the chat template, streamed replies equal to a plain engine run."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller.chat import ChatOptions, run_chat
from deskfleet.controller.export.random_checkpoint import CHAT_TEMPLATE
from deskfleet.controller.run import GenerateOptions, run_generate
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer


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
