"""A chat that cannot fit even a one-token message is refused at start with what would make it fit: the largest
--max-new-tokens, or how much --system must lose (tiny_export: a context of 512, a byte tokenizer)."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest

from deskfleet.controller.cli import main
from deskfleet.controller.export.random_checkpoint import CHAT_TEMPLATE
from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer


@pytest.fixture
def chat_model(tmp_path: Path, tiny_export: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_export, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return model


def _chat(model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
          *options: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # no message: a chat that starts ends at once
    capsys.readouterr()
    code = main(["chat", "--model", str(model), "--precision", "f32", *options])
    return code, capsys.readouterr().err


def test_too_large_a_max_new_tokens_is_told_the_largest_that_fits(
        chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    template = len(ModelTokenizer(chat_model).encode_chat([ChatMessage("user", "")]))
    largest = 512 - template - 1
    code, err = _chat(chat_model, capsys, monkeypatch, "--max-new-tokens", "600")
    assert code == 2
    assert err == (f"deskfleet: error: --max-new-tokens 600 and the chat template's {template} tokens leave no room "
                   f"for a message in the model's context of 512 tokens (give --max-new-tokens {largest} or less)\n")
    assert _chat(chat_model, capsys, monkeypatch, "--max-new-tokens", str(largest)) == (0, "")  # it does fit
    assert _chat(chat_model, capsys, monkeypatch, "--max-new-tokens", str(largest + 1))[0] == 2


def test_too_long_a_system_prompt_is_told_how_much_to_shorten_it(
        chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # 531 tokens: 480 of --system and the template's 51; alone it leaves no room, whatever --max-new-tokens
    code, err = _chat(chat_model, capsys, monkeypatch, "--system", "s" * 480, "--max-new-tokens", "8")
    assert code == 2
    assert err == ("deskfleet: error: --system takes 531 tokens with the chat template; with --max-new-tokens 8 "
                   "that leaves no room for a message in the model's context of 512 tokens (shorten --system by "
                   "at least 28 tokens)\n")
    assert _chat(chat_model, capsys, monkeypatch, "--system", "s" * 452, "--max-new-tokens", "8") == (0, "")
    assert _chat(chat_model, capsys, monkeypatch, "--system", "s" * 453, "--max-new-tokens", "8")[0] == 2
    # shorter, it leaves room for a smaller --max-new-tokens too
    code, err = _chat(chat_model, capsys, monkeypatch, "--system", "s" * 400, "--max-new-tokens", "100")
    assert code == 2 and err.endswith("(shorten --system by at least 40 tokens, or give --max-new-tokens 60 or "
                                      "less)\n")
