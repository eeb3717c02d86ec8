"""TemplateRenderer: one child renders every request of a chat, as render_isolated does, under the same limits; a
request that times out, is interrupted or runs out of memory ends that child and the next request gets a new one,
never an earlier request's answer; a child that dies says what it wrote, one killed between requests is replaced,
the terminal's Ctrl-C does not reach it; a chat keeps one child for all its turns."""

from __future__ import annotations

import io
import os
import queue
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller import chat_template
from deskfleet.controller.chat import ChatOptions, run_chat
from deskfleet.controller.chat_template import ChatTemplateError, TemplateRenderer, render_isolated
from deskfleet.controller.export.random_checkpoint import CHAT_TEMPLATE

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"


def _conversation(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}


def test_one_child_renders_every_request_as_a_child_per_call_does() -> None:
    conversations = [_conversation(f"message {index}") for index in range(3)]
    with TemplateRenderer() as renderer:
        assert renderer.render(TEMPLATE, conversations) == render_isolated(TEMPLATE, conversations)
        pid = renderer.pid
        assert renderer.render(CHAT_TEMPLATE, conversations[:1]) == render_isolated(CHAT_TEMPLATE, conversations[:1])
        assert renderer.pid == pid is not None  # the same child, with another template too
        with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
            renderer.render("{{ 1/0 }}", conversations)
        assert renderer.pid == pid  # a template's own error leaves the child as it was
        assert renderer.render(TEMPLATE, conversations[:1]) == ["<user>message 0>"]
    assert renderer.pid is None


def test_a_request_past_the_time_limit_ends_the_child_and_the_next_gets_a_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 1.0)
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with TemplateRenderer() as renderer:
        renderer.render(TEMPLATE, [_conversation("warm")])
        first = renderer.pid
        with pytest.raises(ChatTemplateError, match="took more than 1 s"):
            renderer.render(looping, [_conversation("x")])
        assert renderer.pid is None
        assert renderer.render(TEMPLATE, [_conversation("after")]) == ["<user>after>"]
        assert renderer.pid not in (None, first)


def test_an_interrupted_request_never_answers_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C while the answer is awaited: the child still writes it; read as the next request's, it would give
    # the turn before's prompt
    with TemplateRenderer() as renderer:
        renderer.render(TEMPLATE, [_conversation("warm")])
        get = queue.Queue.get
        interrupts = [1]

        def interrupted_get(self: queue.Queue[str | None], *args: Any, **kwargs: Any) -> Any:
            if interrupts:
                interrupts.pop()
                raise KeyboardInterrupt
            return get(self, *args, **kwargs)

        monkeypatch.setattr(queue.Queue, "get", interrupted_get)
        with pytest.raises(KeyboardInterrupt):
            renderer.render(TEMPLATE, [_conversation("first")])
        assert renderer.render(TEMPLATE, [_conversation("second")]) == ["<user>second>"]


def test_running_out_of_memory_ends_the_child_with_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 120.0)  # filling 2 GiB is slow on some machines
    with TemplateRenderer() as renderer:
        with pytest.raises(ChatTemplateError, match="GiB"):
            renderer.render("{{ 'a' * 4000000000 }}", [_conversation("x")])
        assert renderer.pid is None
        assert renderer.render(TEMPLATE, [_conversation("after")]) == ["<user>after>"]


def test_a_child_killed_between_requests_is_replaced_by_the_next_one() -> None:
    with TemplateRenderer() as renderer:
        renderer.render(TEMPLATE, [_conversation("warm")])
        assert renderer._child is not None
        first = renderer._child.pid
        renderer._child.kill()
        renderer._child.wait()
        assert renderer.render(TEMPLATE, [_conversation("after")]) == ["<user>after>"]
        assert renderer.pid not in (None, first)


def test_a_child_that_dies_rendering_is_a_named_error_saying_what_it_wrote() -> None:
    # an exception the child's renderer does not catch (Python's compiler refuses 120 nested blocks) ends it
    nested = "{% if 1 %}" * 120 + "x" + "{% endif %}" * 120
    with TemplateRenderer() as renderer:
        with pytest.raises(ChatTemplateError, match=r"(?s)its child ended.*IndentationError: too many levels"):
            renderer.render(nested, [_conversation("x")])
        assert renderer.render(TEMPLATE, [_conversation("after")]) == ["<user>after>"]


def test_the_terminals_ctrl_c_does_not_reach_the_child() -> None:
    # Ctrl-C in a terminal signals its foreground process group: the chat survives a Ctrl-C that stops a reply,
    # and so must its renderer, started in a session of its own (and ignoring SIGINT besides)
    with TemplateRenderer() as renderer:
        renderer.render(TEMPLATE, [_conversation("warm")])
        assert renderer._child is not None
        pid = renderer._child.pid
        if hasattr(os, "getpgid"):
            assert os.getpgid(pid) != os.getpgid(0)
            os.kill(pid, signal.SIGINT)
            with pytest.raises(subprocess.TimeoutExpired):
                renderer._child.wait(timeout=1)
        assert renderer.render(TEMPLATE, [_conversation("after")]) == ["<user>after>"] and renderer.pid == pid


def test_a_chat_renders_all_its_turns_in_one_child(tmp_path: Path, tiny_export: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    started: list[list[str]] = []
    popen = subprocess.Popen

    def counting(argv: list[str], *args: Any, **kwargs: Any) -> Any:
        if "deskfleet.controller.chat_template" in argv:
            started.append(argv)
        return popen(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", counting)
    options = ChatOptions(model=model, max_new_tokens=4, settings=CompileSettings(precision=Precision.F32))
    assert run_chat(options, io.StringIO("hello\nagain\nonce more\n"), io.StringIO()) == 3
    assert len(started) == 1 and started[0][-1] == "--serve"
