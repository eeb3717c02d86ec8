"""The GenAI baseline's inputs are checked before any bench runs: a python that cannot import openvino_genai
failed only after deskfleet's variants had run, with the runner's ModuleNotFoundError traceback, and a
--genai-python without a --genai-model was silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller.bench.arguments import check_genai_inputs


def _python(folder: Path, name: str, script: str) -> Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


def test_a_python_without_genai_is_refused_naming_it(tmp_path: Path) -> None:
    bare = _python(tmp_path, "bare-python",
                   "echo \"ModuleNotFoundError: No module named 'openvino_genai'\" >&2; exit 1")
    with pytest.raises(ValueError, match=f"--genai-python {bare} cannot import openvino_genai "
                                         r"\(ModuleNotFoundError: No module named 'openvino_genai'\)"):
        check_genai_inputs(tmp_path, bare)
    check_genai_inputs(tmp_path, _python(tmp_path, "genai-python", "exit 0"))  # one that imports it passes


def test_a_genai_python_without_a_genai_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    python = _python(tmp_path, "genai-python", "exit 0")
    with pytest.raises(ValueError, match="needs --genai-model"):
        check_genai_inputs(None, python)
    from deskfleet.controller import cli

    assert cli.main(["bench", "streams", "--model", str(tmp_path), "--genai-python", str(python)]) == 2
    assert f"--genai-python {python} needs --genai-model" in capsys.readouterr().err
