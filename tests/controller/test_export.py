"""Export: clear errors for unsupported checkpoints, an atomic output folder, one INT4 policy for all."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import pytest

from deskfleet.common.model_spec import Manifest, ManifestError, WeightFormat, load_manifest, verify_files
from deskfleet.controller.export import exporter, output_folder
from deskfleet.controller.export.exporter import ExportError, export_checkpoint
from deskfleet.controller.export.hf_config import UnsupportedModelError, read_checkpoint_config
from deskfleet.controller.export.weights import MalformedCheckpointError


def edited_checkpoint(source: Path, tmp_path: Path, **changes: object) -> Path:
    target = tmp_path / "edited"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("changes", "field"), [
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": ["llama"]}, r"model_type=\['llama'\] is not supported"),  # a TypeError traceback before
    ({"model_type": {"name": "llama"}}, r"model_type=\{'name': 'llama'\} is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
])
def test_unsupported_configs_name_the_field(changes: dict[str, object], field: str,
                                            checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = edited_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path, **changes)
    with pytest.raises(UnsupportedModelError, match=field):
        read_checkpoint_config(checkpoint)


def test_sliding_window_shorter_than_the_context_is_refused(checkpoint_factory: Callable[..., Path]) -> None:
    checkpoint = checkpoint_factory("mistral-window", "mistral", sliding_window=64)
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        read_checkpoint_config(checkpoint)
    assert read_checkpoint_config(checkpoint, max_context=64).spec.max_context == 64


def test_a_max_context_that_fits_no_prompt_or_no_manifest_is_refused_by_its_option(
        checkpoint_factory: Callable[..., Path]) -> None:
    checkpoint = checkpoint_factory("tiny", num_hidden_layers=4)
    for context in (1, (1 << 24) + 1):  # no room for a prompt and a reply; past what a manifest may say
        with pytest.raises(ValueError, match=f"--max-context must be from 2 .* to 16,777,216, got {context}$"):
            read_checkpoint_config(checkpoint, max_context=context)
    assert read_checkpoint_config(checkpoint, max_context=2).spec.max_context == 2


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        read_checkpoint_config(tmp_path)


@pytest.mark.parametrize(("file_name", "text", "says"), [
    ("config.json", "{bad", "is not valid JSON"),
    ("config.json", "[1, 2]", "must hold a JSON object"),
    ("generation_config.json", "{bad", "is not valid JSON"),
])
def test_a_broken_config_file_is_named(checkpoint_factory: Callable[..., Path], tmp_path: Path, file_name: str,
                                       text: str, says: str) -> None:
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(checkpoint_factory("export-broken-config"), checkpoint)
    (checkpoint / file_name).write_text(text, encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match=f"{file_name} {says}"):
        read_checkpoint_config(checkpoint)


def test_manifest_lists_every_file_with_its_checksum(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    on_disk = {path.name for path in tiny_export.iterdir()} - {"manifest.json"}
    assert set(manifest.files) == on_disk
    verify_files(tiny_export, manifest)
    assert manifest.spec.num_layers == 4 and len(manifest.layer_bytes) == 4
    assert "tokenizer.json" in manifest.tokenizer_files


def test_existing_output_is_kept_without_overwrite(tiny_export: Path, checkpoint_factory: Callable[..., Path]) -> None:
    before = sorted(path.name for path in tiny_export.iterdir())
    with pytest.raises(ExportError, match="--overwrite"):
        export_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tiny_export)
    assert sorted(path.name for path in tiny_export.iterdir()) == before


def test_a_failed_export_leaves_nothing_behind(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, tiny_export: Path) -> None:
    calls = 0
    original = exporter._save

    def failing_save(*args: object, **kwargs: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("disk full")
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(exporter, "_save", failing_save)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(tiny_export / "manifest.json", out / "manifest.json")  # an old export
    (out / "config.json").write_text("old export")  # a file the old manifest lists (anything else is refused)
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), out, WeightFormat.F32, overwrite=True)
    assert (out / "config.json").read_text() == "old export"
    assert [path.name for path in tmp_path.iterdir()] == ["out"]  # no partial folder left


def test_int4_policy_is_the_same_for_every_layer(checkpoint_factory: Callable[..., Path],
                                                 export_factory: Callable[[Path, str], Path]) -> None:
    # Every decoder MatMul (down_proj included) is 4-bit, so the split point cannot change the weights;
    # the RoPE table stays f32 (NNCF would otherwise compress it as an embedding).
    model = export_factory(checkpoint_factory("int4", "llama", num_hidden_layers=4, hidden_size=128,
                                              intermediate_size=256), "int4")
    core = ov.Core()
    for index in range(4):
        layer = core.read_model(model / f"layer_{index:03d}.xml")
        weight_types = {op.get_output_element_type(0).get_type_name() for op in layer.get_ops()
                        if op.get_type_name() == "Constant" and len(op.get_output_shape(0)) >= 2
                        and min(op.get_output_shape(0)) > 1 and op.get_output_size() == 1
                        and op.get_output_element_type(0).get_type_name() in {"u4", "i4", "u8", "i8"}}
        assert weight_types == {"u4"}, f"layer {index} weight constants: {weight_types}"
    rope = core.read_model(model / "rope.xml")
    tables = [op for op in rope.get_ops() if op.get_type_name() == "Constant" and len(op.get_output_shape(0)) == 2]
    assert tables and all(op.get_output_element_type(0) == ov.Type.f32 for op in tables)
    table = max(tables, key=lambda op: int(np.prod(op.get_output_shape(0))))
    assert table.get_output_shape(0)[0] == load_manifest(model).spec.max_context


def test_a_layer_projects_qkv_and_gate_up_with_one_matmul_each(tiny_export: Path) -> None:
    # q, k, v stacked into one MatMul and gate, up into another: 4 weight MatMuls a layer (qkv, o, gate_up,
    # down); the stacked ones are as wide as their parts together.
    spec = load_manifest(tiny_export).spec
    layer = ov.Core().read_model(tiny_export / "layer_000.xml")
    widths = sorted(int(op.get_output_partial_shape(0)[-1].get_length()) for op in layer.get_ops()
                    if op.get_type_name() == "MatMul" and op.input_value(1).get_partial_shape().rank.get_length() == 2)
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    assert widths == sorted([qkv, spec.hidden_size, 2 * spec.intermediate_size, spec.hidden_size])


def test_corrupted_layer_file_is_refused_before_compiling(tiny_export: Path, tmp_path: Path) -> None:
    from deskfleet.agent.stage import LayerRange, build_stage_model

    copy = tmp_path / "copy"
    shutil.copytree(tiny_export, copy)
    data = bytearray((copy / "layer_001.bin").read_bytes())
    data[100] ^= 0xFF
    (copy / "layer_001.bin").write_bytes(bytes(data))
    manifest = load_manifest(copy)
    build_stage_model(copy, manifest, LayerRange(2, 4, 4))  # other layers are fine
    with pytest.raises(ManifestError, match=r"layer_001\.bin is corrupted"):
        build_stage_model(copy, manifest, LayerRange(0, 2, 4))
    (copy / "layer_002.xml").unlink()
    with pytest.raises(ManifestError, match=r"layer_002\.xml is missing"):
        build_stage_model(copy, manifest, LayerRange(2, 4, 4))


# Bad checkpoints and outputs: refused by name before any IR is converted, and nothing lost.

def _copy(checkpoint: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(checkpoint, target)
    return target


def _edit_tensors(checkpoint: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    edit(tensors)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the export starts converting IR: every check must come before that work."""
    def converting(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export converted IR before refusing the checkpoint")

    monkeypatch.setattr(exporter, "_convert", converting)


@pytest.mark.parametrize(("edit", "says"), [
    (lambda t: t.pop("lm_head.weight"), "lm_head.weight is missing"),
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), "model.layers.1.mlp.down_proj.weight is missing"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((32, 64), np.float32)}),
     r"model.layers.0.self_attn.q_proj.weight has shape \[32, 64\] where the config gives \[64, 64\]"),
    (lambda t: t.update({"model.norm.weight": np.ones(1, np.float32)}),
     r"model.norm.weight has shape \[1\] where the config gives \[64\]"),
    (lambda t: t.update({"model.embed_tokens.weight": np.zeros((600, 64), np.float32)}),
     r"model.embed_tokens.weight has shape \[600, 64\] where the config gives \[512, 64\]"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((128, 64), np.int8)}),
     "model.layers.0.mlp.up_proj.weight is I8: only f16, bf16, f32 and f64 tensors can be exported"),
])
def test_weights_that_do_not_match_the_config_are_refused_before_any_work(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, no_conversion: None,
        edit: Callable[[dict[str, np.ndarray]], object], says: str) -> None:
    checkpoint = _copy(checkpoint_factory("export-untied", tie_word_embeddings=False), tmp_path)
    _edit_tensors(checkpoint, edit)
    with pytest.raises(MalformedCheckpointError, match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_tied_embeddings_with_a_different_lm_head_stored_are_refused(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, no_conversion: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers would compute the logits with the stored lm_head.weight, export with the embedding
    checkpoint = edited_checkpoint(checkpoint_factory("export-untied", tie_word_embeddings=False), tmp_path,
                                   tie_word_embeddings=True)
    says = (r"config\.json sets tie_word_embeddings=true, but the checkpoint's lm_head\.weight differs from "
            r"model\.embed_tokens\.weight: set tie_word_embeddings to false")
    with pytest.raises(MalformedCheckpointError, match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    # a copy of the embedding differing in its last row only, compared in blocks of 100 rows
    from deskfleet.controller.export import weights

    monkeypatch.setattr(weights, "COMPARE_BLOCK_BYTES", 100 * 64 * 4)

    def near_copy(tensors: dict[str, np.ndarray]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["lm_head.weight"][-1, -1] += 1.0

    _edit_tensors(checkpoint, near_copy)
    with pytest.raises(MalformedCheckpointError, match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    assert not (tmp_path / "out").exists()


def test_tied_embeddings_with_an_equal_lm_head_stored_are_accepted(
        checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    from deskfleet.controller.export.weights import CheckpointWeights

    checkpoint = _copy(checkpoint_factory("export-tied", tie_word_embeddings=True), tmp_path)
    config = read_checkpoint_config(checkpoint)
    assert config.spec.tie_word_embeddings
    _edit_tensors(checkpoint, lambda tensors: tensors.update(
        {"lm_head.weight": tensors["model.embed_tokens.weight"].astype(np.float16).astype(np.float32)}))
    with CheckpointWeights(checkpoint) as stored, pytest.raises(MalformedCheckpointError, match="differs"):
        stored.check(config)  # rounded through f16: not the same weights
    _edit_tensors(checkpoint, lambda tensors: tensors.update(
        {"lm_head.weight": tensors["model.embed_tokens.weight"].copy()}))
    with CheckpointWeights(checkpoint) as stored:
        stored.check(config)


def test_a_config_with_more_layers_than_the_weights_is_refused(checkpoint_factory: Callable[..., Path],
                                                               tmp_path: Path, no_conversion: None) -> None:
    checkpoint = edited_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path, num_hidden_layers=5)
    with pytest.raises(MalformedCheckpointError, match=r"config\.json gives 5 layers, but the weights have no layer 4"):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    # ten million layers are refused as fast, before a list of every tensor they would need is made
    huge = edited_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path / "huge",
                             num_hidden_layers=10**7)
    with pytest.raises(MalformedCheckpointError, match="gives 10000000 layers"):
        export_checkpoint(huge, tmp_path / "out", WeightFormat.F32)
    # weights with no layer at all: "no layer 1" said layer 0 was there
    bare = edited_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path / "bare", num_hidden_layers=2)
    _edit_tensors(bare, lambda tensors: [tensors.pop(name) for name in list(tensors)
                                         if name.startswith("model.layers.")])
    with pytest.raises(MalformedCheckpointError, match=r"gives 2 layers, but the weights hold none \(no "
                                                       r"model\.layers\.0\.input_layernorm\.weight\)"):
        export_checkpoint(bare, tmp_path / "out", WeightFormat.F32)


@pytest.mark.parametrize(("changes", "error", "says"), [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, UnsupportedModelError,
     "quantization_config \\(quant_method='gptq'\\)"),
    # the config's own field names, checked before transformers (num_attention_heads 0: "integer modulo by zero")
    ({"num_key_value_heads": 0}, UnsupportedModelError, "num_key_value_heads=0 in .* must be a whole number from 1"),
    ({"num_hidden_layers": 0}, UnsupportedModelError, "num_hidden_layers=0 in .* must be a whole number from 1"),
    ({"num_attention_heads": 0}, UnsupportedModelError, "num_attention_heads=0 in .* must be a whole number from 1"),
    ({"num_key_value_heads": 3}, UnsupportedModelError, "num_attention_heads=4 is not a multiple of "
                                                        "num_key_value_heads=3"),
    # values that exported and made NaN RoPE tables or norms, so every generate step failed
    ({"rms_norm_eps": -1.0}, UnsupportedModelError, "rms_norm_eps=-1.0 must be a finite number above 0"),
    ({"rope_theta": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 0}}, UnsupportedModelError,
     "rope_theta=0 must be a finite number above 0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.5, "rope_theta": 10000.0}}, UnsupportedModelError,
     "rope_parameters.factor=0.5 must be at least 1"),  # the key the file uses (transformers 5's), not rope_scaling
    ({"rope_parameters": {"rope_type": "linear", "factor": "2", "rope_theta": 10000.0}}, UnsupportedModelError,
     "rope_parameters.factor='2' must be a number"),  # it was told it "must be at least 1"
    ({"rope_parameters": {"rope_type": "bogus", "rope_theta": 10000.0}}, UnsupportedModelError,
     r"rope_parameters.rope_type='bogus' is not supported \(supported: default, linear, llama3, yarn\)$"),
    ({"max_position_embeddings": 0}, UnsupportedModelError, "max_position_embeddings=0 must be at least 2"),
    # 1 exported a model no prompt could be answered by ("shorten the prompt to at most 0 tokens")
    ({"max_position_embeddings": 1}, UnsupportedModelError, "max_position_embeddings=1 must be at least 2"),
    ({"rms_norm_eps": "small"}, UnsupportedModelError, "config.json is refused by transformers"),
])
def test_impossible_configs_are_refused_by_name(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                no_conversion: None, changes: dict[str, object],
                                                error: type[Exception], says: str) -> None:
    checkpoint = edited_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path, **changes)
    with pytest.raises(error, match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)


@pytest.mark.parametrize(("bos", "says"), [
    (512, r"bos token id 512 is outside the vocabulary \(size 512\)"),
    (-1, r"bos token id -1 is outside the vocabulary"),
])
def test_a_bos_token_outside_the_vocabulary_is_refused(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                       no_conversion: None, bos: int, says: str) -> None:
    # transformers only warns about it; a prompt starting with it would index past the embedding
    checkpoint = edited_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path, bos_token_id=bos)
    with pytest.raises(ManifestError, match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    assert not (tmp_path / "out").exists()


def test_the_spec_checks_bos_like_eos_and_still_allows_none(tiny_export: Path) -> None:
    spec = load_manifest(tiny_export).spec
    dataclasses.replace(spec, bos_token_id=None).validate()
    dataclasses.replace(spec, bos_token_id=spec.vocab_size - 1).validate()
    with pytest.raises(ManifestError, match="outside the vocabulary"):
        dataclasses.replace(spec, bos_token_id=spec.vocab_size).validate()
    # a tampered manifest: a string or true is no token id (true would read as id 1)
    for value in ("1", True):
        with pytest.raises(ManifestError, match="bos_token_id must be a token id or null"):
            dataclasses.replace(spec, bos_token_id=value).validate()  # type: ignore[arg-type]
    body = json.loads((tiny_export / "manifest.json").read_text())
    body["spec"]["bos_token_id"] = 10**6
    with pytest.raises(ManifestError, match="bos token id 1000000 is outside the vocabulary"):
        Manifest.from_json(json.dumps(body))


def test_a_corrupt_weights_file_or_tokenizer_is_refused_before_any_work(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, no_conversion: None) -> None:
    checkpoint = _copy(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path)
    weights = checkpoint / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:100])
    with pytest.raises(MalformedCheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    weights.write_bytes(intact)
    (checkpoint / "tokenizer.json").unlink()
    (checkpoint / "tokenizer_config.json").unlink()
    with pytest.raises(ExportError, match="cannot load the tokenizer"):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)


@pytest.mark.parametrize(("index", "says"), [
    ({"metadata": {}}, 'has no "weight_map" object'),
    ({"weight_map": ["model.safetensors"]}, 'has no "weight_map" object'),
    ({"weight_map": {"model.norm.weight": "../elsewhere/model.safetensors"}}, "not a file name beside the index"),
    ({"weight_map": {"model.norm.weight": "model-00002.safetensors"}}, "model-00002.safetensors is missing"),
    ({"weight_map": {"no.such.tensor": "model.safetensors"}}, "places tensor 'no.such.tensor' in model.safetensors"),
])
def test_a_bad_shard_index_is_refused_naming_it(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                no_conversion: None, index: dict[str, object], says: str) -> None:
    checkpoint = _copy(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path)
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises((MalformedCheckpointError, FileNotFoundError), match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)


def _shard(checkpoint: Path) -> None:
    """Split model.safetensors into two shards and an index, as save_pretrained does for a large model."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for number, part in enumerate((names[:len(names) // 2], names[len(names) // 2:]), start=1):
        shard = f"model-{number:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, checkpoint / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_a_single_weights_file_beside_a_shard_index_is_refused_naming_both(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, no_conversion: None) -> None:
    # transformers loads model.safetensors and ignores the index: which weights are meant is not clear
    from deskfleet.controller.export.weights import CheckpointWeights

    checkpoint = _copy(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path)
    _shard(checkpoint)
    with pytest.raises(MalformedCheckpointError,
                       match=r"holds both model\.safetensors and model\.safetensors\.index\.json"):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]
    (checkpoint / "model.safetensors").unlink()  # the shards alone are a whole checkpoint
    with CheckpointWeights(checkpoint) as weights:
        weights.check(read_checkpoint_config(checkpoint))
    # an index whose only shard is model.safetensors says what the single file says
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    _copy(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path, "single")
    shutil.copyfile(tmp_path / "single" / "model.safetensors", checkpoint / "model.safetensors")
    index["weight_map"] = dict.fromkeys(index["weight_map"], "model.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with CheckpointWeights(checkpoint) as weights:
        weights.check(read_checkpoint_config(checkpoint))


def test_overwrite_never_deletes_the_checkpoint_or_a_folder_that_is_not_an_export(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, no_conversion: None) -> None:
    parent = tmp_path / "work"
    checkpoint = _copy(checkpoint_factory("tiny", num_hidden_layers=4), parent, "ckpt")
    (parent / "notes.txt").write_text("mine")
    before = sorted(path.name for path in checkpoint.iterdir())
    for out in (checkpoint, parent, tmp_path, checkpoint / ".." / "ckpt"):
        with pytest.raises(ExportError, match="holds the checkpoint"):
            export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "photo.jpg").write_text("precious")
    with pytest.raises(ExportError, match=r"other holds files but no manifest\.json: --overwrite replaces only"):
        export_checkpoint(checkpoint, other, WeightFormat.F32, overwrite=True)
    (other / "manifest.json").write_text('{"manifest_version": 3, "name": "a browser extension"}')
    with pytest.raises(ExportError, match=r"other/manifest\.json is not a deskfleet manifest") as foreign:
        export_checkpoint(checkpoint, other, WeightFormat.F32, overwrite=True)
    assert "export the model again" not in str(foreign.value)  # no advice for a browser extension's file
    (other / "manifest.json").unlink()
    with pytest.raises(ExportError, match=r"notes\.txt exists and is not a folder"):
        export_checkpoint(checkpoint, parent / "notes.txt", WeightFormat.F32, overwrite=True)
    assert sorted(path.name for path in checkpoint.iterdir()) == before
    assert (parent / "notes.txt").read_text() == "mine" and (other / "photo.jpg").read_text() == "precious"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other", "work"]


def test_a_failed_swap_puts_the_old_export_back(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, tiny_export: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(tiny_export / "manifest.json", out / "manifest.json")
    (out / "config.json").write_text("old export")  # a file the old manifest lists (anything else is refused)
    rename = output_folder._rename_no_replace

    def failing_rename(source: Path, target: Path) -> None:
        if source.name.startswith(".out.partial-"):
            raise OSError(28, "No space left on device")
        rename(source, target)

    monkeypatch.setattr(output_folder, "_rename_no_replace", failing_rename)
    with pytest.raises(ExportError, match="cannot move the finished export into") as raised:
        export_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), out, WeightFormat.F32, overwrite=True)
    assert (out / "config.json").read_text() == "old export"
    # the finished export is kept, and the message says where
    (staging,) = [path for path in tmp_path.iterdir() if path.name != "out"]
    assert staging.name.startswith(".out.partial-") and f"the finished export is kept at {staging}" in str(raised.value)
    verify_files(staging, load_manifest(staging))


def test_a_context_past_the_trained_one_is_a_warning(checkpoint_factory: Callable[..., Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Recorded at the logger itself: a library imported by other tests may disable existing loggers, which
    # would leave caplog empty in a full run.
    from deskfleet.controller.export import hf_config

    warnings: list[str] = []
    monkeypatch.setattr(hf_config.log, "warning", lambda text, *args: warnings.append(text % args))
    checkpoint = checkpoint_factory("tiny", num_hidden_layers=4)  # max_position_embeddings 512
    assert read_checkpoint_config(checkpoint, max_context=600).spec.max_context == 600
    assert warnings == ["--max-context 600 is past the model's max_position_embeddings (512): positions beyond it "
                        "were never trained, so text there may degrade"]
    read_checkpoint_config(checkpoint, max_context=512)
    assert len(warnings) == 1


def test_a_rope_table_that_is_not_finite_is_refused(checkpoint_factory: Callable[..., Path]) -> None:
    # what read_checkpoint_config does not know to refuse still never reaches rope.xml as NaN
    from deskfleet.controller.export.rope import rope_tables

    config = read_checkpoint_config(checkpoint_factory("tiny", num_hidden_layers=4))
    hf_config: Any = config.hf_config
    if isinstance(getattr(hf_config, "rope_parameters", None), dict):
        hf_config.rope_parameters["rope_theta"] = 0.0
    hf_config.rope_theta = 0.0
    with pytest.raises(UnsupportedModelError, match=r"the RoPE cos table .* holds values that are not finite "
                                                    r"\(\d+ of \d+\): check config.json's rope_theta \(0.0\)"):
        rope_tables(config)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "generation_config.json"])
@pytest.mark.parametrize("kind", ["broken link", "folder"])
def test_a_checkpoint_file_that_is_a_broken_link_or_a_folder_is_named_as_such(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, name: str, kind: str) -> None:
    # "has no model.safetensors" beside an `ls` that lists it (a half-copied Hugging Face cache holds links)
    # generation_config.json was skipped without a word: a chat model lost its end-of-turn token id
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(checkpoint_factory("tiny", num_hidden_layers=4), checkpoint)
    (checkpoint / name).unlink(missing_ok=True)
    if kind == "folder":
        (checkpoint / name).mkdir()
        says = rf"{checkpoint / name} is a folder, not a file$"
    else:
        (checkpoint / name).symlink_to(tmp_path / "blobs" / "a1b2")
        says = rf"{checkpoint / name} is a broken link \(to {tmp_path / 'blobs' / 'a1b2'}\): copy the file it names"
    with pytest.raises(FileNotFoundError, match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
    assert not (tmp_path / "out").exists()


def test_a_config_that_leaves_out_the_context_or_eos_or_layers_is_warned_of(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # each exported without a word: a context of transformers' default, a model that never stops, layers dropped
    from deskfleet.controller.export import hf_config, weights
    from deskfleet.controller.export.weights import CheckpointWeights

    warnings: list[str] = []
    for module in (hf_config, weights):
        monkeypatch.setattr(module.log, "warning", lambda text, *args: warnings.append(text % args))
    checkpoint = edited_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), tmp_path, num_hidden_layers=2,
                                   eos_token_id=None)
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    del config["max_position_embeddings"]
    config_path.write_text(json.dumps(config))
    (checkpoint / "generation_config.json").unlink(missing_ok=True)
    config_read = read_checkpoint_config(checkpoint)
    with CheckpointWeights(checkpoint) as held:
        held.check(config_read)
    assert warnings == [
        f"{config_path} has no max_position_embeddings: the context is {config_read.spec.max_context}, transformers' "
        "default for llama, which may not be what the model was trained for; give --max-context to choose it",
        f"neither config.json nor generation_config.json of {checkpoint} gives an eos_token_id: generate will stop "
        "only at --max-new-tokens (chat at the chat template's end of turn)",
        "config.json gives 2 layers, but the weights hold 4: layers 2 to 3 are not exported"]
    warnings.clear()
    read_checkpoint_config(checkpoint, max_context=64)  # a context chosen: nothing to warn of there
    assert not any("max_position_embeddings" in text for text in warnings)
    # no eos_token_id (or bos) key at all: LlamaConfig's defaults (eos 2, bos 1) were exported, with no warning
    del config["eos_token_id"], config["bos_token_id"]
    config_path.write_text(json.dumps(config))
    warnings.clear()
    spec = read_checkpoint_config(checkpoint).spec
    assert spec.eos_token_ids == () and spec.bos_token_id is None
    assert any("gives an eos_token_id" in text for text in warnings)


def test_a_max_context_whose_rope_table_is_huge_is_warned_of(checkpoint_factory: Callable[..., Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # --max-context 1048576 exported without a word, building a 517 MB rope.bin in 1.6 GB of memory
    from deskfleet.controller.export import hf_config

    warnings: list[str] = []
    monkeypatch.setattr(hf_config.log, "warning", lambda text, *args: warnings.append(text % args))
    checkpoint = checkpoint_factory("tiny", num_hidden_layers=4)
    read_checkpoint_config(checkpoint, max_context=4096)
    assert not any("RoPE table" in text for text in warnings)
    spec = read_checkpoint_config(checkpoint, max_context=1 << 22).spec  # head_dim 16: 537 MB
    rope_mb = 2 * (1 << 22) * spec.head_dim * 4 / 1e6
    assert any(text.startswith(f"--max-context 4194304 makes a RoPE table of {rope_mb:.0f} MB (rope.bin") for text in
               warnings), warnings


def test_int4_compression_compiles_nothing(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # NNCF's "optimized" lowering compiled small models with ov.compile_model, a Core of its own each, released in
    # its cache's order: OpenVINO's CPU plugin then left the main thread's signal stack unmapped, and the export's
    # Ctrl-C handling could crash (agent/openvino_core.py). Its numpy lowering writes the same bytes.
    import nncf.openvino.optimized_functions.models as optimized

    from deskfleet.common.model_spec import WeightFormat
    from deskfleet.controller.export.exporter import export_checkpoint

    compiled: list[object] = []
    monkeypatch.setattr(optimized.ov, "compile_model", lambda *args, **kwargs: compiled.append(args))
    export_checkpoint(checkpoint_factory("nncf-lowering", num_hidden_layers=1, hidden_size=128,
                                        intermediate_size=256), tmp_path / "out", WeightFormat.INT4)
    assert compiled == []
    assert "NNCF_DISABLE_OPTIMIZED_COMPRESSION" not in os.environ  # set for the compression only


@pytest.mark.parametrize("kind", ["broken link", "folder"])
def test_a_shard_that_is_a_broken_link_or_a_folder_is_named_as_such_not_as_missing(
        checkpoint_factory: Callable[..., Path], tmp_path: Path, kind: str) -> None:
    from safetensors.numpy import load_file

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(checkpoint_factory("tiny", num_hidden_layers=4), checkpoint)
    shard = "model-00002-of-00002.safetensors"
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00002.safetensors")
    tensors = list(load_file(checkpoint / "model-00001-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map[tensors[-1]] = shard
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if kind == "folder":
        (checkpoint / shard).mkdir()
        says = rf"{checkpoint / shard} is a folder, not a file \(named by the checkpoint's"
    else:
        (checkpoint / shard).symlink_to(tmp_path / "blobs" / "c3d4")
        says = rf"{checkpoint / shard} is a broken link \(to {tmp_path / 'blobs' / 'c3d4'}\)"
    with pytest.raises(FileNotFoundError, match=says):
        export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)


def test_a_hugging_face_cache_snapshot_is_named_after_its_model_not_its_commit(tmp_path: Path) -> None:
    # exported as "0123456789abcdef...", which became the fleet's model id
    from deskfleet.controller.export.exporter import model_name_of

    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "0123456789abcdef0123"
    snapshot.mkdir(parents=True)
    assert model_name_of(snapshot) == "Llama-3.1-8B"
    plain = tmp_path / "checkpoints" / "my-model"
    plain.mkdir(parents=True)
    assert model_name_of(plain) == "my-model"
    odd = tmp_path / "snapshots" / "abc"  # a folder called snapshots, not in a cache's layout
    odd.mkdir(parents=True)
    assert model_name_of(odd) == "abc"
