"""Weight files as checkpoints come: PyTorch pickles only (refused naming them, never unpickled: torch.load of
an untrusted file can run code), sharded safetensors (exported as transformers computes them) and an index
naming a shard that is missing (refused naming it)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deskfleet.common.model_spec import WeightFormat
from deskfleet.controller.export.exporter import export_checkpoint

from .test_review_export_config import assert_same_logits


class RunsOnLoad:
    """Unpickling it creates `marker`: what a malicious pytorch_model.bin could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("names", [["pytorch_model.bin"],
                                   ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]])
def test_a_pickle_only_checkpoint_is_refused_naming_it_and_never_loaded(
        names: list[str], checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = tmp_path / "pickled"
    shutil.copytree(checkpoint_factory("review-weight-files", num_hidden_layers=1), checkpoint)
    tensors = load_file(checkpoint / "model.safetensors")
    (checkpoint / "model.safetensors").unlink()
    marker = tmp_path / "unpickled.txt"
    for name in names:
        torch.save({**tensors, "payload": RunsOnLoad(marker)}, checkpoint / name)
    with pytest.raises(FileNotFoundError) as caught:
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    message = str(caught.value)
    assert names[0] in message and "safetensors" in message and "\n" not in message
    assert not marker.exists()
    assert not (tmp_path / "export").exists()


def sharded(source: Path, target: Path) -> Path:
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, target)
    (target / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(target, max_shard_size="60KB")
    assert len(list(target.glob("model-*.safetensors"))) > 2
    return target


def test_sharded_safetensors_export_the_model_and_a_missing_shard_is_named(
        checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = sharded(checkpoint_factory("review-weight-files", num_hidden_layers=1), tmp_path / "sharded")
    export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    assert_same_logits(checkpoint, tmp_path / "export")
    missing = sorted(checkpoint.glob("model-*.safetensors"))[1]
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{missing.name} is missing \(named by the checkpoint's "
                                                r"model\.safetensors\.index\.json\)"):
        export_checkpoint(checkpoint, tmp_path / "export2", WeightFormat.F32)
