"""A stage whose device OpenVINO refuses says which device, why in the plugin's own words, and what the PC has."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.common.model_spec import load_manifest


def test_a_device_openvino_refuses_is_named_with_the_plugins_reason(tiny_export: Path) -> None:
    # `--device CPU.0` said "Exception from src/inference/src/cpp/core.cpp:117: ... Check 'device_id.empty()' failed
    # at ...", and no more of what to give
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    settings = CompileSettings(device="CPU.0", precision=Precision.F32)
    with pytest.raises(RuntimeError, match=rf"OpenVINO could not compile layers \[0:{layers}\] on device 'CPU.0': "
                                           r".*device id \(this PC's devices: .*CPU"):
        Stage(tiny_export, manifest, LayerRange(0, layers, layers), settings)
