"""A checkpoint folder may hold Python files that its tokenizer_config.json (auto_map) names as its tokenizer.
transformers asks on the terminal whether to run them when its trust_remote_code is left unset, so a "y" on
standard input ran the checkpoint's code inside `deskfleet export`; the export refuses such a tokenizer instead."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.model_spec import WeightFormat
from deskfleet.controller.export.exporter import ExportError, export_checkpoint
from deskfleet.controller.export.hf_config import UnsupportedModelError


def with_custom_tokenizer_code(source: Path, tmp_path: Path, marker: Path) -> Path:
    checkpoint = tmp_path / "custom-code"
    shutil.copytree(source, checkpoint)
    (checkpoint / "tokenization_custom.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n", encoding="utf-8")
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "CustomTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return checkpoint


def test_a_tokenizer_that_is_custom_code_is_refused_and_never_run(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran.txt"
    checkpoint = with_custom_tokenizer_code(checkpoint_factory("review-remote-code", num_hidden_layers=1), tmp_path,
                                            marker)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # the answer transformers' prompt would read
    with pytest.raises(ExportError, match="auto_map") as caught:
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    assert not marker.exists(), "the checkpoint's code ran"
    assert "\n" not in str(caught.value) and "trust_remote_code" not in str(caught.value)
    assert not (tmp_path / "export").exists()


def test_a_config_that_names_custom_model_code_is_refused(
        checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    # Told never to run it, transformers built the standard llama instead and the export went through: the
    # README said such a config was refused; the model may not be the one the code describes.
    checkpoint = tmp_path / "custom-model"
    shutil.copytree(checkpoint_factory("review-remote-code", num_hidden_layers=1), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    (checkpoint / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match=r"config field auto_map names the checkpoint's own code "
                                          r"\(configuration_x.XConfig, modeling_x.XModel\): deskfleet never runs it"):
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    assert not (tmp_path / "export").exists()


def test_a_tokenizer_config_whose_auto_map_names_code_is_refused_even_with_a_standard_class(
        checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    # with tokenizer_class left standard, the export went through without a word on the standard tokenizer, which
    # may not split text as the named code does (the README said any such auto_map was refused)
    marker = tmp_path / "ran.txt"
    checkpoint = with_custom_tokenizer_code(checkpoint_factory("review-remote-code", num_hidden_layers=1), tmp_path,
                                            marker)
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ExportError, match=r"tokenizer_config.json's auto_map names "
                                          r"tokenization_custom.CustomTokenizer\): deskfleet runs no code"):
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    assert not marker.exists() and not (tmp_path / "export").exists()
    # a Hugging Face cache snapshot holds links to its blobs: the file a link names is read all the same
    blob = tmp_path / "blob.json"
    config_path.rename(blob)
    config_path.symlink_to(blob)
    with pytest.raises(ExportError, match=r"tokenizer_config.json's auto_map names"):
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
