"""What each --precision asks a device for, and what a compiled CPU stage then runs with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from deskfleet.agent.openvino_core import openvino_core
from deskfleet.agent.stage import (
    CompileSettings,
    LayerRange,
    Precision,
    Stage,
    export_weight_group_size,
    weight_group_size,
)
from deskfleet.common.model_spec import load_manifest


def test_fast_on_a_cpu_asks_for_f32_arithmetic_and_leaves_quantization_on() -> None:
    wanted = CompileSettings(device="CPU", precision=Precision.FAST).properties()
    assert wanted["INFERENCE_PRECISION_HINT"] == "f32"  # not the bf16 default of AMX CPUs
    assert "KV_CACHE_PRECISION" not in wanted and "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in wanted


def test_fast_on_a_cpu_quantizes_activations_in_groups_of_the_weights_groups() -> None:
    assert CompileSettings(device="CPU").properties(128)["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "128"
    assert CompileSettings(device="CPU", precision=Precision.F32).properties(
        128)["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "0"  # exact: none at all
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in CompileSettings(device="AUTO").properties(128)


def _u4_constants(*shapes: tuple[int, ...]) -> ov.Model:
    results = [ops.result(ops.convert(ops.constant(np.zeros(shape, np.uint8), dtype=ov.Type.u4), ov.Type.f32))
               for shape in shapes]
    return ov.Model(results, [ops.parameter([1], ov.Type.f32)])


def test_the_weight_group_size_is_read_from_the_grouped_4_bit_constants() -> None:
    assert weight_group_size(_u4_constants((8, 2, 128), (8, 2, 1))) == 128  # [.., 1]: a zero point
    assert weight_group_size(_u4_constants((8, 2, 128), (8, 4, 64))) == 64  # divides both
    assert weight_group_size(_u4_constants((8, 256))) is None  # per channel


def test_an_int4_stage_compiles_with_its_weights_group_size(checkpoint_factory: Callable[..., Path],
                                                            export_factory: Callable[[Path, str], Path],
                                                            tiny_export: Path) -> None:
    # the same checkpoint as the exactness tests' INT4 model: hidden 128, so NNCF groups by 128
    model = export_factory(checkpoint_factory("int4", "llama", num_hidden_layers=4, hidden_size=128,
                                              intermediate_size=256), "int4")
    assert export_weight_group_size(model) == 128
    assert export_weight_group_size(tiny_export) is None  # f32 weights
    manifest = load_manifest(model)
    stage = Stage(model, manifest, LayerRange(0, 2, 4), CompileSettings(precision=Precision.FAST))
    assert int(stage.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 128


def test_exact_on_a_cpu_asks_for_f32_everywhere_and_no_quantization() -> None:
    wanted = CompileSettings(device="CPU", precision=Precision.F32).properties()
    assert (wanted["INFERENCE_PRECISION_HINT"], wanted["KV_CACHE_PRECISION"],
            wanted["DYNAMIC_QUANTIZATION_GROUP_SIZE"]) == ("f32", "f32", "0")


@pytest.mark.parametrize("device", ["AUTO", "HETERO:CPU", "MULTI:CPU"])
def test_fast_leaves_other_devices_at_their_own_default(device: str) -> None:
    # AUTO may pick the GPU, whose fast default (f16) must not be forced to f32.
    wanted = CompileSettings(device=device, precision=Precision.FAST, num_threads=2).properties()
    assert wanted == {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": "2"}


def test_a_fast_cpu_stage_runs_f32_with_a_u8_kv_cache_and_dynamic_quantization(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    n = manifest.spec.num_layers
    stage = Stage(tiny_export, manifest, LayerRange(0, n, n), CompileSettings(precision=Precision.FAST))
    compiled = stage.compiled
    assert compiled.get_property("INFERENCE_PRECISION_HINT").to_string() == "f32"
    assert compiled.get_property("KV_CACHE_PRECISION").to_string() == "u8"
    assert int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) > 0


@pytest.mark.parametrize("kv_cache", ["u8", "f16", "f32"])
def test_a_chosen_kv_cache_precision_is_asked_for(kv_cache: str) -> None:
    wanted = CompileSettings(device="CPU", precision=Precision.FAST, kv_cache=kv_cache).properties()
    assert wanted["KV_CACHE_PRECISION"] == kv_cache


def test_unknown_or_inexact_kv_cache_precisions_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV cache precision 'i4'"):
        CompileSettings(kv_cache="i4")
    with pytest.raises(ValueError, match="f32 is exact and keeps the KV cache in f32, not u8: leave out --kv-cache, "
                                         "or give --precision fast for a u8 cache"):
        CompileSettings(precision=Precision.F32, kv_cache="u8")
    assert CompileSettings(precision=Precision.F32, kv_cache="f32").properties()["KV_CACHE_PRECISION"] == "f32"


def test_drafting_on_a_fast_cpu_keeps_an_f32_kv_cache() -> None:
    assert CompileSettings(precision=Precision.FAST).for_drafting().kv_cache == "f32"
    unchanged = [CompileSettings(precision=Precision.FAST, kv_cache="u8"), CompileSettings(precision=Precision.F32),
                 CompileSettings(device="GPU"), CompileSettings(device="AUTO")]
    assert [settings.for_drafting() for settings in unchanged] == unchanged


def test_a_drafting_cpu_stage_reads_back_an_f32_kv_cache(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    n = manifest.spec.num_layers
    stage = Stage(tiny_export, manifest, LayerRange(0, n, n), CompileSettings().for_drafting())
    assert stage.compiled.get_property("KV_CACHE_PRECISION").to_string() == "f32"
    assert int(stage.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) > 0  # still fast


def test_a_device_that_is_not_a_name_or_not_here_is_refused_by_name() -> None:
    # `--device cpu` and `--device GPU` on a PC without one printed OpenVINO's internal exceptions
    with pytest.raises(ValueError, match=r"'cpu' is not an OpenVINO device name .* \(names are upper case: CPU\)"):
        CompileSettings(device="cpu")
    missing = next(name for name in ("NPU", "GPU", "XPU") if name not in openvino_core().available_devices)
    with pytest.raises(ValueError, match=f"device {missing} is not available on this PC \\(OpenVINO finds"):
        CompileSettings(device=missing).properties()
    with pytest.raises(ValueError, match=r"device CPU\.7 is not available"):  # an index this PC lacks
        CompileSettings(device="CPU.7").properties()
    # a virtual device's list: every device it names must be here (AUTO:GPU,CPU printed the GPU plugin's error)
    with pytest.raises(ValueError, match=rf"device AUTO:{missing},CPU lists {missing}, not available on this PC "
                                         r"\(OpenVINO finds .*\): leave it out of the list"):
        CompileSettings(device=f"AUTO:{missing},CPU").properties()
    assert CompileSettings(device=f"AUTO:CPU,-{missing}").properties()  # excluded: nothing to find
    assert CompileSettings(device="AUTO").properties()
