"""A checkpoint without tokenizer.json: transformers' error for a SentencePiece tokenizer.model it cannot convert
asked for tiktoken, over several lines; and with no tokenizer file at all, a tokenizer_class of LlamaTokenizer,
Qwen2Tokenizer or GPT2Tokenizer loaded as an empty 4-token vocabulary, exported, that encodes any prompt to no
ids. The export's error is one line naming the files and what to do."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.model_spec import WeightFormat
from deskfleet.controller.export.exporter import ExportError, export_checkpoint


def without_tokenizer_json(source: Path, tmp_path: Path, tokenizer_model: bytes | None) -> Path:
    checkpoint = tmp_path / "no-tokenizer-json"
    shutil.copytree(source, checkpoint)
    (checkpoint / "tokenizer.json").unlink()
    if tokenizer_model is not None:
        (checkpoint / "tokenizer.model").write_bytes(tokenizer_model)
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "LlamaTokenizer"  # as a SentencePiece Llama or Mistral checkpoint names it
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return checkpoint


@pytest.mark.parametrize(("tokenizer_model", "says"), [
    (b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02", "tokenizer.model (SentencePiece)"),  # a protobuf's start
    (b"IQ== 0\nIg== 1\n", "tokenizer.model (tiktoken)"),
    (None, "none of the files its LlamaTokenizer reads (tokenizer.json, tokenizer.model)"),
])
def test_a_folder_without_tokenizer_json_is_refused_in_one_line_naming_the_file(
        tokenizer_model: bytes | None, says: str, checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = without_tokenizer_json(checkpoint_factory("review-tokenizer-files", num_hidden_layers=1), tmp_path,
                                        tokenizer_model)
    with pytest.raises(ExportError) as caught:
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    message = str(caught.value)
    assert says in message
    assert "tokenizer.json beside it" in message or "copy the model's tokenizer files into it" in message
    assert "\n" not in message
    if tokenizer_model is not None and b"<unk>" in tokenizer_model:
        assert "tiktoken" not in message
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("tokenizer_class", ["Qwen2Tokenizer", "GPT2Tokenizer"])
def test_a_tokenizer_config_without_a_vocabulary_file_is_refused(
        tokenizer_class: str, checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = without_tokenizer_json(checkpoint_factory("review-tokenizer-files", num_hidden_layers=1), tmp_path,
                                        None)
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = tokenizer_class
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ExportError, match=rf"none of the files its {tokenizer_class} reads \(.*vocab\.json"):
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)


@pytest.mark.parametrize(("damage", "says"), [
    ("tokenizer.json cut short", r"tokenizer\.json is not valid JSON: .*: fix it, or copy it from the model again"),
    ("tokenizer_config.json bad", r"tokenizer_config\.json is not valid JSON: Expecting property name"),
    ("tokenizer.json a folder", r"tokenizer\.json is a folder, not a file"),
    ("tokenizer.json a broken link", r"tokenizer\.json is a broken link \(to blobs/0a1b2c\)"),
])
def test_a_damaged_tokenizer_file_is_named(damage: str, says: str, checkpoint_factory: Callable[..., Path],
                                           tmp_path: Path) -> None:
    # "cannot load the tokenizer of DIR: EOF while parsing a string at line 27 column 8" named no file, nor did
    # "Expecting property name enclosed in double quotes"; a folder or a broken link was said to be missing
    checkpoint = tmp_path / "damaged"
    shutil.copytree(checkpoint_factory("review-tokenizer-files", num_hidden_layers=1), checkpoint)
    name = damage.split()[0]
    path = checkpoint / name
    if damage.endswith("cut short"):
        path.write_bytes(path.read_bytes()[:500])
    elif damage.endswith("bad"):
        path.write_text("{bad", encoding="utf-8")
    else:
        path.unlink()
        if damage.endswith("folder"):
            path.mkdir()
        else:
            path.symlink_to("blobs/0a1b2c")
    folder = re.escape(str(checkpoint))
    with pytest.raises(ExportError, match=rf"cannot load the tokenizer of {folder}: {folder}/{says}") as caught:
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    assert "has no tokenizer.json" not in str(caught.value)
    assert not (tmp_path / "export").exists()
