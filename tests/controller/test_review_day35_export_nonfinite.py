"""Review finding (day 35): `deskfleet export` refuses a checkpoint whose weights hold NaN or inf, naming the tensor.

Such a checkpoint exported "successfully" (NNCF printed numpy's "invalid value encountered in cast"), and the
export then failed at the first generate step: "the stage chose tokens [300] outside the vocabulary ... its
logits were not finite".
"""

from __future__ import annotations

import hashlib
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deskfleet.common.model_spec import WeightFormat
from deskfleet.controller.cli import main
from deskfleet.controller.export.exporter import export_checkpoint
from deskfleet.controller.export.random_checkpoint import make_random_checkpoint
from deskfleet.controller.export.weights import CheckpointWeights, MalformedCheckpointError

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300)
DOWN = "model.layers.1.mlp.down_proj.weight"  # [32, 64]: read after rope, embed and layer 0 are written


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("nonfinite") / "clean", **TINY)


def _damaged(clean: Path, folder: Path, name: str, values: list[float]) -> Path:
    """A copy of `clean` whose tensor `name` holds `values` in its first elements."""
    shutil.copytree(clean, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors[name].view(-1)[:len(values)] = torch.tensor(values)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _contents(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize(("name", "values", "counts"), [
    (DOWN, [float("nan")] * 3, "3 NaN values"),
    ("model.embed_tokens.weight", [float("inf"), float("-inf"), float("nan")], "1 NaN and 2 infinite values"),
])
def test_non_finite_weights_are_refused_naming_the_tensor_and_nothing_is_left(
        clean: Path, tmp_path: Path, name: str, values: list[float], counts: str) -> None:
    checkpoint = _damaged(clean, tmp_path / "checkpoint", name, values)
    with pytest.raises(MalformedCheckpointError, match=rf"^{name} \(in model.safetensors\) holds {counts} \(of \d+\): "
                                                       "the checkpoint is damaged; download or convert it again$"):
        export_checkpoint(checkpoint, tmp_path / "export", WeightFormat.F32)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint"]  # no export, no staging folder


def test_an_existing_export_is_left_as_it_was(clean: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    export_checkpoint(clean, out, WeightFormat.F32)
    before = _contents(out)
    checkpoint = _damaged(clean, tmp_path / "checkpoint", DOWN, [float("nan")])
    with pytest.raises(MalformedCheckpointError, match=rf"^{DOWN} \(in model.safetensors\) holds 1 NaN value \(of"):
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert _contents(out) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint", "export"]


def test_the_command_says_which_tensor_and_exits_with_an_error(clean: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _damaged(clean, tmp_path / "checkpoint", DOWN, [float("nan")] * 3)
    capsys.readouterr()
    assert main(["export", str(checkpoint), "-o", str(tmp_path / "export")]) == 2  # INT4, through NNCF
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == (f"deskfleet: error: {DOWN} (in model.safetensors) holds 3 NaN values (of 2048): "
                                    "the checkpoint is damaged; download or convert it again")
    assert "exported" not in out and not (tmp_path / "export").exists()


def test_finite_values_whose_sum_overflows_are_read(clean: Path, tmp_path: Path) -> None:
    # the check sums first: a sum past float32's range is looked at value by value, and these are all finite
    checkpoint = _damaged(clean, tmp_path / "checkpoint", DOWN, [3e38, 3e38])
    with CheckpointWeights(checkpoint) as weights:
        assert torch.equal(weights.get(DOWN)[0, :2], torch.tensor([3e38, 3e38]))


def test_a_failed_export_removes_the_folders_it_made_above_its_output(clean: Path, tmp_path: Path) -> None:
    # `-o new/a/b/out` interrupted or failed left new/a/b behind, empty (found by review, with Ctrl-C)
    checkpoint = _damaged(clean, tmp_path / "checkpoint", DOWN, [float("nan")])
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "new" / "a" / "b" / "out", tmp_path / "kept" / "c" / "out"):
        with pytest.raises(MalformedCheckpointError):
            export_checkpoint(checkpoint, out, WeightFormat.F32)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint", "kept"]
    assert list((tmp_path / "kept").iterdir()) == []  # a folder that was there stays


def test_a_ctrl_c_inside_a_tensor_read_stops_the_export_and_calls_no_checkpoint_damaged(clean: Path) -> None:
    # safetensors builds the tensor through torch, which turned a KeyboardInterrupt landing there into a ValueError
    # ("could not determine the shape of object type 'torch.storage.UntypedStorage'"): the export said the
    # checkpoint was damaged (exit 2) instead of "export stopped by Ctrl-C" (130)
    def read_as_torch_does(handle: object) -> torch.Tensor:
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None
        return torch.ones(2)

    with CheckpointWeights(clean) as weights, pytest.raises(KeyboardInterrupt):
        weights._read(DOWN, read_as_torch_does)
