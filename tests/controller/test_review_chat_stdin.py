"""`deskfleet chat` started with its standard input closed (`<&-`): Python then has no sys.stdin."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deskfleet.controller.cli import main


def test_a_chat_whose_standard_input_is_closed_says_so(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # It was an AttributeError's traceback ('NoneType' object has no attribute 'isatty').
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["chat", "--model", str(tiny_export), "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == (
        "deskfleet: error: standard input is closed, and chat reads its messages from it: run it in a terminal or "
        "give it the messages on standard input (a pipe or a file)\n")


def test_a_chat_reads_its_messages_as_utf8_whatever_the_locale(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # under LC_ALL=C, valid UTF-8 was refused as "not valid UTF-8 text (byte 0xc3 ...)"; read in a Windows code
    # page it went to the model as other characters
    import io
    import json

    stdin = io.TextIOWrapper(io.BytesIO("café\n".encode()), encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", "--model", str(tiny_export), "--max-new-tokens", "2", "--precision", "f32", "--json"]) == 0
    said = json.loads(capsys.readouterr().out.splitlines()[0])
    assert "error" not in said and said["reply_tokens"] >= 1
