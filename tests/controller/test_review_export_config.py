"""Config fields an architecture ignores in transformers are ignored by the export too: the exported model
computes transformers' logits (f32), not a model with the stray field applied."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.model_spec import WeightFormat, load_manifest
from deskfleet.controller.batch_track import BatchTrack
from deskfleet.controller.export.exporter import export_checkpoint

PROMPT = [1, 17, 99, 230, 5, 42, 7, 300, 11]


def exported_logits(export: Path, prompt: list[int]) -> np.ndarray:
    """The last position's logits of a one-stage f32 run of `export`."""
    manifest = load_manifest(export)
    layers = manifest.spec.num_layers
    stage = Stage(export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))
    track = BatchTrack(1, 256)
    track.add_row(0)
    output = StageExecutor(stage, 256).run(track.step([prompt]), return_logits=True)
    assert output.logits is not None
    return np.asarray(output.logits).reshape(-1)


def transformers_logits(checkpoint: Path, prompt: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].numpy()


def assert_same_logits(checkpoint: Path, export: Path) -> None:
    expected = transformers_logits(checkpoint, PROMPT)
    np.testing.assert_allclose(exported_logits(export, PROMPT), expected, atol=1e-4, rtol=0)


def with_stray_field(source: Path, tmp_path: Path, field: str, store_biases: bool) -> Path:
    """A copy of `source` whose config.json sets `field` true, with bias tensors stored for it or not."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(source, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config[field] = True
    (checkpoint / "config.json").write_text(json.dumps(config))
    if store_biases:
        tensors = load_file(checkpoint / "model.safetensors")
        projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] \
            if field == "attention_bias" else ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        generator = np.random.default_rng(0)
        for index in range(config["num_hidden_layers"]):
            for projection in projections:
                rows = tensors[f"model.layers.{index}.{projection}.weight"].shape[0]
                tensors.setdefault(f"model.layers.{index}.{projection}.bias",
                                   generator.normal(0.0, 1.0, rows).astype(np.float32))
        save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    return checkpoint


@pytest.mark.parametrize(("architecture", "field", "store_biases"), [
    ("mistral", "attention_bias", True),  # were added: logits off by whole units
    ("mistral", "attention_bias", False),  # were required: refused as missing
    ("mistral", "mlp_bias", True),
    ("qwen2", "mlp_bias", True),
    ("qwen2", "attention_bias", True),  # qkv biases as ever, an o_proj bias stored is not Qwen2's
])
def test_a_bias_field_the_architecture_ignores_is_ignored(
        architecture: str, field: str, store_biases: bool, checkpoint_factory: Callable[..., Path],
        tmp_path: Path) -> None:
    extra = {"sliding_window": None} if architecture == "mistral" else {}
    source = checkpoint_factory(f"review-{architecture}", architecture, num_hidden_layers=1, **extra)
    checkpoint = with_stray_field(source, tmp_path, field, store_biases)
    export = tmp_path / "export"
    export_checkpoint(checkpoint, export, WeightFormat.F32)
    assert_same_logits(checkpoint, export)


def test_llama_bias_fields_still_add_their_biases(checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = checkpoint_factory("review-llama-biases", "llama", num_hidden_layers=1, attention_bias=True,
                                    mlp_bias=True)
    export = tmp_path / "export"
    export_checkpoint(checkpoint, export, WeightFormat.F32)
    assert_same_logits(checkpoint, export)
