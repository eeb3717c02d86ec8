"""`generate --prompts-file` with a line that is not UTF-8: the error names that line, as a prompt's other
errors do (`line 37 of --prompts-file F: ...`), not only the byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller.cli import main


@pytest.mark.parametrize(("content", "line"), [
    (b"def f():\r\n\n   \nimport os\rx = 1\ncaf\xe9\nok\n", 6),  # after \r\n, \r, blank and empty lines
    (b"\xef\xbb\xbfone\ntwo\n\xff\n", 3),  # a BOM before the first line is not a line of its own
    (b"\xe9", 1),
])
def test_a_prompts_file_line_that_is_not_utf8_is_named(tiny_export: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str], content: bytes,
                                                       line: int) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    assert main(["generate", "--model", str(tiny_export), "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deskfleet: error: line {line} of --prompts-file {path}: not UTF-8 text (it holds the "
                          "byte 0x")
    assert err.count("\n") == 1
