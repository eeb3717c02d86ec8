"""Review findings on the manifest: each test failed before its fix."""

from __future__ import annotations

import json

import pytest

from deskfleet.common.model_spec import Manifest, ManifestError
from deskfleet.common.wire import ManifestEntry
from tests.common.test_model_spec import manifest


def _tampered(path: tuple[str, ...], value: object) -> str:
    body = json.loads(manifest().to_json())
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(body)


@pytest.mark.parametrize(("path", "value", "message"), [
    # OverflowError escaped from_json (int(inf)); a float was truncated to the file's size
    (("embed_bytes",), float("inf"), "embed_bytes must be a whole number of bytes"),
    (("head_bytes",), 6.9, "head_bytes must be a whole number of bytes"),
    (("embed_bytes",), "5", "embed_bytes must be a whole number of bytes"),
    # these were kept, and deploying the stage then failed with a TypeError building its ManifestEntry
    (("files", "layer_001.bin", "sha256"), 5, r"sha256 of layer_001.bin must be 64 lowercase hex"),
    (("files", "layer_001.bin", "sha256"), "A" * 64, r"sha256 of layer_001.bin must be 64 lowercase hex"),
    (("files", "rope.bin"), {"sha256": "0" * 64, "size": -3}, r"size of rope.bin must be a whole number"),
    (("files", "rope.bin"), {"sha256": "0" * 64, "size": True}, r"size of rope.bin must be a whole number"),
    (("files", "rope.bin"), {"sha256": "0" * 64}, r"entry of rope.bin must hold exactly sha256 and size"),
    (("tokenizer_files",), [7], r"tokenizer_files\[0\] must be text"),
    (("spec", "architecture"), None, "'architecture' must be text"),
    (("spec", "tie_word_embeddings"), "yes", "tie_word_embeddings must be true or false"),
])
def test_a_tampered_manifest_is_refused_by_name(path: tuple[str, ...], value: object, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(_tampered(path, value))


def test_every_file_of_a_loaded_manifest_can_travel_as_a_wire_manifest_entry() -> None:
    loaded = Manifest.from_json(manifest().to_json())
    assert loaded == manifest()
    for name, entry in loaded.files.items():
        ManifestEntry(name, entry.sha256, entry.size)
