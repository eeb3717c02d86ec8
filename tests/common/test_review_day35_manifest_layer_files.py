"""Review finding (day 35): a manifest whose layer files are not those of its num_layers layers is refused.

Lowering spec.num_layers (and layer_bytes with it) in an export's manifest.json left the dropped layers' files
listed; generate then ran the shorter model, exit 0, with other tokens and not a word.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from deskfleet.common.model_spec import Manifest, ManifestError
from tests.common.test_model_spec import manifest


def _body_with_graphs() -> dict[str, Any]:
    """The 4-layer test manifest, listing each layer's .xml too (as an export does)."""
    body = json.loads(manifest().to_json())
    for index in range(4):
        body["files"][f"layer_{index:03d}.xml"] = {"sha256": "4" * 64, "size": 7}
    return body


def test_files_of_layers_past_num_layers_are_refused() -> None:
    body = _body_with_graphs()
    body["spec"]["num_layers"], body["layer_bytes"] = 3, body["layer_bytes"][:3]
    with pytest.raises(ManifestError, match=r"spec.num_layers is 3 \(layer_000 to layer_002\), but the manifest "
                                            r"lists layer_003\.bin, layer_003\.xml, files of no layer of the model"):
        Manifest.from_json(json.dumps(body))
    body["spec"]["num_layers"], body["layer_bytes"] = 1, body["layer_bytes"][:1]
    with pytest.raises(ManifestError, match=r"is 1 \(layer_000 only\), but the manifest lists layer_001\.bin, "
                                            r"layer_001\.xml, layer_002\.bin, layer_002\.xml and 2 more"):
        Manifest.from_json(json.dumps(body))


@pytest.mark.parametrize("name", ["layer_004.bin", "layer_17.xml"])
def test_a_stray_layer_file_is_refused_by_name(name: str) -> None:
    body = _body_with_graphs()
    body["files"][name] = {"sha256": "5" * 64, "size": 3}
    with pytest.raises(ManifestError, match=rf"but the manifest lists {name.replace('.', '[.]')}, files of no layer"):
        Manifest.from_json(json.dumps(body))


def test_a_layer_graph_left_out_is_refused_by_name() -> None:
    body = _body_with_graphs()
    del body["files"]["layer_002.xml"]
    with pytest.raises(ManifestError, match=r"but the manifest does not list layer_002\.xml, files of the model's "
                                            r"layers: it was edited"):
        Manifest.from_json(json.dumps(body))


def test_a_complete_list_loads() -> None:
    body = _body_with_graphs()
    assert Manifest.from_json(json.dumps(body)).files.keys() == body["files"].keys()
