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


@pytest.mark.parametrize("content", [
    "def f():\nimport os\n".encode("utf-16"),  # with its BOM, as PowerShell 5's `>` writes it
    "def f():\n".encode("utf-16-be"),  # no BOM: it decoded as UTF-8 with a NUL every other byte, a garbled prompt
    "def f():\n".encode("utf-16-le"),
    # text outside ASCII, without a BOM: not a NUL every other byte, and it was called a binary file
    "Привет, мир\nпечать(1)\n".encode("utf-16-le"), "def 一():\n".encode("utf-16-be"),
    # few NULs (under 10%), and ASCII bytes once they are taken out: read as UTF-8 with a stray NUL, "not a text file"
    "Съешь же ещё этих мягких французских булок\n".encode("utf-16-le"),
])
def test_a_utf16_prompts_file_is_named_as_such(tiny_export: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    assert main(["generate", "--model", str(tiny_export), "--prompts-file", str(path)]) == 2
    assert f"--prompts-file {path} is UTF-16 text, not UTF-8: save the file as UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"def f():\n    return 1\x00\n",
                                     b"hel\x00lo\nworld\n"])  # short: read as UTF-16, printable CJK
def test_a_binary_prompts_file_is_not_called_utf16(tiny_export: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    # random bytes were "UTF-16 text (or holds NUL bytes)": the fix it gave, saving as UTF-8, was not the one
    path = tmp_path / "prompts.bin"
    path.write_bytes(content)
    assert main(["generate", "--model", str(tiny_export), "--prompts-file", str(path)]) == 2
    assert (f"--prompts-file {path} holds NUL bytes at byte {content.index(0)}: it is not a text file (a binary file "
            "given by mistake?)") in capsys.readouterr().err


def test_an_empty_prompt_is_refused_naming_it(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `--prompt "$P"` with P unset generated from BOS alone, text nobody asked for
    assert main(["generate", "--model", str(tiny_export), "--prompt", "ok", "--prompt", ""]) == 2
    assert "deskfleet: error: --prompt #2: the prompt is empty" in capsys.readouterr().err
