"""`generate --chat` renders every prompt through the chat template in child processes with a time limit
(controller/chat_template.py). One child rendered them all, so a --prompts-file of 600,000 one-line prompts
(24 s) was refused as "the chat template took more than 10 s to render": the limit bounded the size of the
file, not the template's work. Children now take batches."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from deskfleet.controller import chat_template
from deskfleet.controller.chat_template import RENDER_BATCH_CONVERSATIONS, render_isolated

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _children(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The conversations each child process is given, in order."""
    children: list[list[Any]] = []
    run = subprocess.run

    def recording(*args: Any, **kwargs: Any) -> Any:
        children.append(json.loads(kwargs["input"])["conversations"])
        return run(*args, **kwargs)

    monkeypatch.setattr(chat_template.subprocess, "run", recording)
    return children


def test_many_conversations_render_in_bounded_children_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    children = _children(monkeypatch)
    count = 2 * RENDER_BATCH_CONVERSATIONS + 7
    conversations = [{"messages": [{"role": "user", "content": f"prompt {number}"}]} for number in range(count)]
    texts = render_isolated(TEMPLATE, conversations)
    assert texts == [f"<user>prompt {number}" for number in range(count)]
    assert [len(batch) for batch in children] == [RENDER_BATCH_CONVERSATIONS, RENDER_BATCH_CONVERSATIONS, 7]


def test_long_conversations_render_in_children_of_bounded_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # three prompts of 40% of a child's text each: two children; one longer than that alone: a child of its own
    children = _children(monkeypatch)
    monkeypatch.setattr(chat_template, "RENDER_BATCH_CHARS", 1000)  # the parent's batching; 64M in earnest
    contents = ["a" * 400, "b" * 400, "c" * 400, "d" * 1001, "e"]
    texts = render_isolated(TEMPLATE, [{"messages": [{"role": "user", "content": text}]} for text in contents])
    assert texts == [f"<user>{text}" for text in contents]
    assert [[c["messages"][0]["content"][0] for c in batch] for batch in children] == [["a", "b"], ["c"], ["d"],
                                                                                        ["e"]]
