"""Review day 33: a messages file saved with a BOM whose first line is /quit (or /exit). The /quit check reads
the line before the BOM is dropped, so "\\ufeff/quit" is not a quit; the BOM is then dropped and "/quit" is
refused as "no command" by the new mistyped-command check, and the chat goes on to answer the lines after it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller.chat import ChatOptions, run_chat
from tests.controller.test_chat import _chat_model


@pytest.mark.parametrize("command", ["/quit", "/exit"])
def test_a_bom_before_a_first_line_quit_still_quits(tmp_path: Path, tiny_export: Path, command: str) -> None:
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=3, settings=CompileSettings(precision=Precision.F32))
    out = io.StringIO()
    replies = run_chat(options, io.StringIO(f"\ufeff{command}\nhello\n"), out, notes=io.StringIO(), as_json=True)
    assert [json.loads(line) for line in out.getvalue().splitlines()] == []
    assert replies == 0


def test_utf16_input_is_refused_and_its_quit_still_quits(tmp_path: Path, tiny_export: Path) -> None:
    # piped UTF-16 (PowerShell 5): a NUL between every character; "/quit" so was sent to the model as a message
    model = _chat_model(tmp_path, tiny_export)
    options = ChatOptions(model=model, max_new_tokens=3, settings=CompileSettings(precision=Precision.F32))
    out = io.StringIO()
    hello, quit = ("\0".join(word) + "\0" for word in ("hello", "/quit"))
    replies = run_chat(options, io.StringIO(f"{hello}\n{quit}\nnever read\n"), out, notes=io.StringIO(),
                       as_json=True)
    said = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies == 0 and len(said) == 1 and "holds NUL characters (UTF-16 input?)" in said[0]["error"]
