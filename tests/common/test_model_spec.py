"""The manifest: round trips, validation and file verification name what is wrong."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from deskfleet.common.model_spec import (
    FileEntry,
    Manifest,
    ManifestError,
    ModelSpec,
    NewerManifestError,
    WeightFormat,
    load_manifest,
    sha256_of,
    verify_files,
)

SPEC = ModelSpec(architecture="llama", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, max_context=256, bos_token_id=1, eos_token_ids=(2,),
                 rope_type="default", tie_word_embeddings=False)


def manifest(files: dict[str, FileEntry] | None = None) -> Manifest:
    """A manifest whose weight files have the sizes it plans with, plus `files`."""
    weights = {**{f"layer_{index:03d}.bin": FileEntry("1" * 64, 10) for index in range(4)},
               "embed.bin": FileEntry("2" * 64, 5), "head.bin": FileEntry("3" * 64, 6)}
    return Manifest(model_name="tiny", spec=SPEC, weight_format=WeightFormat.INT4, files={**weights, **(files or {})},
                    tokenizer_files=("tokenizer.json",), layer_bytes=(10, 10, 10, 10), embed_bytes=5, head_bytes=6)


def test_round_trip() -> None:
    original = manifest({"a.bin": FileEntry("0" * 64, 3)})
    assert Manifest.from_json(original.to_json()) == original


def test_parameters_multiplied_per_token() -> None:
    # q and o: 64 x 64 each; k and v: 64 x 32 each (2 KV heads of 16); gate, up, down: 64 x 128 each
    assert SPEC.layer_parameters == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert SPEC.head_parameters == 512 * 64


def test_kv_bytes() -> None:
    assert SPEC.kv_bytes_per_token_per_layer() == 2 * 2 * 16 * 4
    assert SPEC.kv_bytes_per_token_per_layer(2) == 2 * 2 * 16 * 2


@pytest.mark.parametrize(("change", "message"), [
    ({"num_layers": 0}, "num_layers"),
    ({"num_kv_heads": 3}, "not a multiple"),
    ({"eos_token_ids": (600,)}, "outside the vocabulary"),
])
def test_validation_names_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        dataclasses.replace(SPEC, **change).validate()  # type: ignore[arg-type]


def test_malformed_manifests_are_refused() -> None:
    body = json.loads(manifest().to_json())
    # a later deskfleet's export: the fix is an upgrade (it said "format_version 2 is not 1 (export the model again)")
    with pytest.raises(NewerManifestError, match=r"made by a newer deskfleet \(manifest format_version 99; this "
                                                 r"deskfleet reads 1\): upgrade deskfleet here"):
        Manifest.from_json(json.dumps({**body, "format_version": 99}))
    with pytest.raises(ManifestError, match=r"^the manifest has no format_version$"):  # it said "None is not 1"
        Manifest.from_json(json.dumps({k: v for k, v in body.items() if k != "format_version"}))
    with pytest.raises(ManifestError, match="format_version 0 is not 1"):
        Manifest.from_json(json.dumps({**body, "format_version": 0}))
    with pytest.raises(ManifestError, match=r"^malformed manifest: it has no 'spec'$"):
        Manifest.from_json(json.dumps({k: v for k, v in body.items() if k != "spec"}))
    with pytest.raises(ManifestError, match="layer sizes"):
        Manifest.from_json(json.dumps({**body, "layer_bytes": [1]}))
    # reprs such as JSONDecodeError('Expecting ...') and ValueError("'int3' is not a valid WeightFormat") are gone
    with pytest.raises(ManifestError, match=r"^malformed manifest: not JSON \(Expecting ',' delimiter"):
        Manifest.from_json("[1, 2")
    with pytest.raises(ManifestError, match=r"^malformed manifest: 'int3' is not a valid WeightFormat$"):
        Manifest.from_json(json.dumps({**body, "weight_format": "int3"}))


def test_a_manifest_whose_planning_sizes_are_not_its_files_is_refused() -> None:
    # A manifest listing 4 GB layer files but 1-byte layer sizes had the planner put 16 GB on an 8 GB PC.
    body = json.loads(manifest().to_json())
    for name in ("layer_002.bin", "head.bin"):
        lying = {**body, "files": {**body["files"], name: {"sha256": "1" * 64, "size": 4 * 10**9}}}
        with pytest.raises(ManifestError, match=f"sizes {name} at .* bytes for planning, but its file is listed at "
                                                "4000000000 bytes"):
            Manifest.from_json(json.dumps(lying))
    missing = {**body, "files": {k: v for k, v in body["files"].items() if k != "embed.bin"}}
    with pytest.raises(ManifestError, match=r"embed\.bin at 5 bytes for planning, but its file is not listed"):
        Manifest.from_json(json.dumps(missing))


def test_stage_stems() -> None:
    m = manifest()
    assert m.stage_ir_stems(0, 4) == ["rope", "embed", "layer_000", "layer_001", "layer_002", "layer_003", "head"]
    assert m.stage_ir_stems(1, 3) == ["rope", "layer_001", "layer_002"]
    # written as every other message writes a stage's layers: [start:stop] (it said "[2, 5)")
    with pytest.raises(ManifestError, match=r"layers \[2:5\] are outside the model's 4 layers"):
        m.stage_ir_stems(2, 5)


def test_load_and_verify(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="missing does not exist"):
        load_manifest(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ManifestError, match="file is not a folder"):
        load_manifest(tmp_path / "file")
    with pytest.raises(ManifestError, match="not a deskfleet export"):
        load_manifest(tmp_path)
    # a truncated or foreign file is named (it said "malformed manifest: JSONDecodeError(...)", naming no file)
    for text in ('{"format_version": 1, "spec": {"num', "[]"):
        (tmp_path / "manifest.json").write_text(text)
        with pytest.raises(ManifestError, match=f"^{re.escape(str(tmp_path / 'manifest.json'))}: .*export the model "
                                                "again"):
            load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({**json.loads(manifest().to_json()), "format_version": 2}))
    with pytest.raises(NewerManifestError, match=f"^{re.escape(str(tmp_path / 'manifest.json'))}: the export was made "
                                                 r"by a newer deskfleet .*again with this one$"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_bytes(b"\xff{}")
    with pytest.raises(ManifestError, match=r"manifest\.json is not UTF-8 text"):
        load_manifest(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"abc")
    m = manifest({"a.bin": FileEntry(sha256_of(tmp_path / "a.bin"), 3), "b.bin": FileEntry("0" * 64, 1)})
    (tmp_path / "manifest.json").write_text(m.to_json())
    assert load_manifest(tmp_path) == m
    verify_files(tmp_path, m, ["a.bin"])
    with pytest.raises(ManifestError, match=r"b\.bin is missing, though the export's manifest.json names it: the "
                                            r"export is incomplete \(export the model again, or copy the file back"):
        verify_files(tmp_path, m, ["b.bin"])
    with pytest.raises(ManifestError, match="not listed"):
        verify_files(tmp_path, m, ["c.bin"])
    (tmp_path / "a.bin").write_bytes(b"abd")
    with pytest.raises(ManifestError, match="corrupted"):
        verify_files(tmp_path, m, ["a.bin"])
    (tmp_path / "a.bin").write_bytes(b"abcd")
    with pytest.raises(ManifestError, match="4 bytes"):
        verify_files(tmp_path, m, ["a.bin"])


@pytest.mark.parametrize(("text", "message"), [
    ("[]", "a manifest is a JSON object"),
    ('"x"', "a manifest is a JSON object"),
])
def test_a_manifest_that_is_not_an_object_is_refused(text: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(text)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_layers", "8", "must be a whole number"), ("num_kv_heads", True, "must be a whole number"),
    ("vocab_size", 10**9, "past any real model's"), ("head_dim", 10**9, "past any real model's"),
    ("eos_token_ids", "2", "eos_token_ids must be a list"), ("files", [], "malformed manifest"),
])
def test_a_tampered_spec_is_refused_by_name(field: str, value: object, message: str) -> None:
    # these gave AttributeError/TypeError tracebacks, or (a vocabulary of 1e9) a 7.45 GiB allocation
    body = json.loads(manifest().to_json())
    if field == "files":
        body["files"] = value
    else:
        body["spec"][field] = value
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(body))
