"""The tokenizer and chat template match transformers' own, without transformers at run time."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller.tokenizer import ChatMessage, ChatTemplateError, ModelTokenizer


def test_encoding_and_chat_template_match_transformers(tiny_export: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tiny_export)
    ours = ModelTokenizer(tiny_export)
    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert ours.encode(text) == reference(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == text
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there")]
    expected = reference.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                             add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == expected
    assert ours.encode_chat(messages) == reference(expected, add_special_tokens=False)["input_ids"]


def test_missing_template_is_a_clear_error(tiny_export: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_export / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ModelTokenizer(tmp_path).render_chat([ChatMessage("user", "hi")])
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ModelTokenizer(tmp_path / "nothing")
