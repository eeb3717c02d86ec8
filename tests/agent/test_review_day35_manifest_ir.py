"""Review finding (day 35): a manifest.json edited away from the IR it describes is refused by name.

spec.vocab_size edited to 100 (or 1000) failed `generate` with OpenVINO's shape-inference text ("Check
'TRShape::broadcast_merge_into' ... opset1::Select ... Argument shapes are inconsistent"), from the argmax the
last stage builds over the manifest's vocabulary; spec.num_layers lowered to 1 (with layer_bytes) ran layer 0
alone, exit 0, with other tokens, while the manifest still listed layer_001's files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deskfleet.agent.stage import LayerRange, build_stage_model
from deskfleet.common.model_spec import ManifestError, load_manifest
from deskfleet.controller.cli import main

VOCAB, HIDDEN = 300, 32


@pytest.fixture(scope="module")
def export(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> Path:
    """A 2-layer llama of hidden size 32 and 300 tokens, in f32."""
    checkpoint = checkpoint_factory("review-day35-manifest", num_hidden_layers=2, hidden_size=HIDDEN,
                                    intermediate_size=64, vocab_size=VOCAB)
    return export_factory(checkpoint, "f32")


def _edited(export: Path, folder: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    shutil.copytree(export, folder)
    body = json.loads((folder / "manifest.json").read_text())
    edit(body)
    (folder / "manifest.json").write_text(json.dumps(body))
    return folder


def _spec(field: str, value: int) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        body["spec"][field] = value
    return edit


@pytest.mark.parametrize(("field", "value", "start", "stop", "message"), [
    ("vocab_size", 100, 0, 2, rf"manifest.json says vocab_size 100, but embed.xml holds {VOCAB} embedding rows"),
    ("vocab_size", 1000, 0, 1, rf"manifest.json says vocab_size 1000, but embed.xml holds {VOCAB} embedding rows"),
    ("vocab_size", 100, 1, 2,
     rf"manifest.json says vocab_size 100, but head.xml gives {VOCAB} logits a token \(its lm_head's rows\)"),
    ("hidden_size", 48, 0, 1, rf"manifest.json says hidden_size 48, but embed.xml gives {HIDDEN} values a token"),
    ("hidden_size", 48, 1, 2, rf"manifest.json says hidden_size 48, but layer_001.xml takes {HIDDEN} values a token"),
])
def test_a_width_edited_in_the_manifest_is_refused_when_the_stage_is_built(
        export: Path, tmp_path: Path, field: str, value: int, start: int, stop: int, message: str) -> None:
    folder = _edited(export, tmp_path / "model", _spec(field, value))
    manifest = load_manifest(folder)
    with pytest.raises(ManifestError, match=rf"{message}: the export folder was edited or holds files of another "
                                            "export; export the model again"):
        build_stage_model(folder, manifest, LayerRange(start, stop, 2))


def test_the_stages_of_the_real_export_are_built(export: Path) -> None:
    manifest = load_manifest(export)
    for start, stop in ((0, 2), (0, 1), (1, 2)):
        build_stage_model(export, manifest, LayerRange(start, stop, 2))


def test_generate_names_the_edited_vocabulary_instead_of_openvino_text(
        export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _edited(export, tmp_path / "model", _spec("vocab_size", 100))
    capsys.readouterr()
    code = main(["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--precision", "f32"])
    err = capsys.readouterr().err
    assert code == 2
    assert "manifest.json says vocab_size 100, but embed.xml holds 300 embedding rows" in err
    assert "Argument shapes are inconsistent" not in err


def test_a_lowered_layer_count_is_refused_naming_the_files_of_the_dropped_layer(
        export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def one_layer(body: dict[str, Any]) -> None:
        body["spec"]["num_layers"], body["layer_bytes"] = 1, body["layer_bytes"][:1]

    folder = _edited(export, tmp_path / "model", one_layer)
    with pytest.raises(ManifestError, match=r"manifest\.json: spec\.num_layers is 1 \(layer_000 only\), but the "
                                            r"manifest lists layer_001\.bin, layer_001\.xml, files of no layer"):
        load_manifest(folder)
    capsys.readouterr()
    assert main(["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--precision", "f32"]) == 2
    assert "spec.num_layers is 1" in capsys.readouterr().err
