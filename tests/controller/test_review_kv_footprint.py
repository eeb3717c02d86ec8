"""The footprint a deploy plans with must be the one its stages will hold: the KV cache in the precision the
agents compile (u8 for the default `fast` on a CPU, f32 for --precision f32 or --kv-cache f32; a fleet's stages
never switch to f32 for drafting), grown as the CPU plugin grows it, and the scratch a prefill leaves.

Measured on a 170M-shaped INT4 export (hidden 1024, intermediate 2816, 4 KV heads of 64, 12 layers, context
2048), one stage of every layer, anonymous memory over what the warm-up left: decoded to 2048 tokens the u8
cache held 35.2 MB and the f32 one 99.3 MB; a prefill of 2048 tokens left 242 MB of scratch held (a stage fed
hidden states: 42.6 bytes a token per unit of hidden + intermediate, 335 MB for 2048 tokens)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.common.kv_cache_size import kv_cache_precision
from deskfleet.common.model_spec import Manifest, load_manifest
from deskfleet.common.planner import AgentCandidate, PlanOptions, plan
from deskfleet.common.wire import Precision
from deskfleet.controller import fleet_deploy
from deskfleet.controller.fleet_deploy import footprint_of

MB = 1_000_000
BARE = PlanOptions(margin_fraction=0.0, margin_min_bytes=0, stage_overhead_bytes=0)


def shaped_170m(manifest: Manifest) -> Manifest:
    spec = dataclasses.replace(manifest.spec, hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                               head_dim=64, num_layers=12, max_context=2048)
    last = manifest.layer_ir(manifest.spec.num_layers - 1)  # its files stand for the layers the export lacks
    files = {**manifest.files, **{name.replace(last, manifest.layer_ir(layer)): manifest.files[name]
                                  for layer in range(manifest.spec.num_layers, 12) for name in manifest.ir_files(last)}}
    return dataclasses.replace(manifest, spec=spec, layer_bytes=(5_864_748,) * 12, files=files)


def test_the_kv_precision_is_the_one_the_agents_compile() -> None:
    assert kv_cache_precision(Precision.DEVICE_DEFAULT, "CPU", None) == "u8"  # fast: the CPU plugin's default
    assert kv_cache_precision(Precision.F16, "cpu", None) == "u8"  # the agent compiles f16 as fast
    assert kv_cache_precision(Precision.F32, "CPU", None) == "f32"
    assert kv_cache_precision(Precision.DEVICE_DEFAULT, "CPU", "f32") == "f32"
    assert kv_cache_precision(Precision.DEVICE_DEFAULT, "GPU", None) is None


def test_a_cpu_footprint_counts_the_cache_in_its_precision_grown(tiny_export: Path) -> None:
    manifest = load_manifest(tiny_export)
    spec = manifest.spec
    fast = footprint_of(manifest, "CPU")
    assert fast.kv_precision == "u8"
    assert fast.kv_bytes_per_token_per_layer == 2 * spec.num_kv_heads * (spec.head_dim + 8)  # bytes + scale, zero
    assert fast.kv_growth == 2.5
    exact = footprint_of(manifest, "CPU", Precision.F32)
    assert exact.kv_precision == "f32"
    assert exact.kv_bytes_per_token_per_layer == 2 * spec.num_kv_heads * spec.head_dim * 4
    assert exact.kv_growth == 2.0
    assert footprint_of(manifest, "CPU", kv_cache="f32").kv_bytes_per_token_per_layer == \
        exact.kv_bytes_per_token_per_layer
    assert footprint_of(manifest, "CPU", kv_cache="f16").kv_bytes_per_token_per_layer == 2 * spec.num_kv_heads * \
        spec.head_dim * 2
    width = spec.hidden_size + spec.intermediate_size
    assert fast.prefill_bytes_per_token == 44 * width and fast.first_prefill_bytes_per_token == 34 * width
    gpu = footprint_of(manifest, "GPU")  # not measured: f32's bytes, as they are
    assert (gpu.kv_growth, gpu.prefill_bytes_per_token) == (1.0, 0)
    assert gpu.kv_bytes_per_token_per_layer == exact.kv_bytes_per_token_per_layer


@pytest.mark.parametrize(("precision", "measured_kv", "measured_first", "measured_other"), [
    (Precision.DEVICE_DEFAULT, 35.2 * MB, 242 * MB, 335 * MB),
    (Precision.F32, 99.3 * MB, 242 * MB, 335 * MB),
])
def test_the_170m_stage_is_planned_at_what_it_was_measured_to_hold(
        tiny_export: Path, precision: Precision, measured_kv: float, measured_first: float,
        measured_other: float) -> None:
    footprint = footprint_of(shaped_170m(load_manifest(tiny_export)), "CPU", precision)
    whole = plan(footprint, [AgentCandidate("a", AgentState.AVAILABLE, 8 << 30, 1.0)], BARE).stages[0]
    reserved = whole.kv_bytes + whole.prefill_bytes
    measured = measured_kv + measured_first
    assert measured <= reserved <= 1.15 * measured
    # a stage fed hidden states (layers [4:8), measured: its scratch 335 MB at its peak)
    assert measured_other <= footprint.prefill_scratch_bytes(1) <= 1.15 * measured_other


def test_deploy_plans_with_the_kv_precision_it_deploys(tiny_export: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.controller.fleet_store import FleetStore

    seen = []

    class Planned(Exception):
        pass

    def plan_survey(footprint, *args, **kwargs):
        seen.append(footprint)
        raise Planned

    monkeypatch.setattr(fleet_deploy, "plan_survey", plan_survey)
    store = FleetStore(tmp_path / "controller")
    for precision, kv_cache in ((Precision.DEVICE_DEFAULT, None), (Precision.F32, None),
                                (Precision.DEVICE_DEFAULT, "f32")):
        with pytest.raises(Planned):
            asyncio.run(fleet_deploy.deploy(store, tiny_export, None, BARE, precision,
                                            kv_cache=kv_cache))
    assert [footprint.kv_precision for footprint in seen] == ["u8", "f32", "f32"]
    assert seen[1].kv_bytes_per_token_per_layer == 4 * seen[0].kv_bytes_per_token_per_layer * \
        load_manifest(tiny_export).spec.head_dim // (load_manifest(tiny_export).spec.head_dim + 8)


def test_fleet_plan_reserves_the_kv_cache_of_the_precision_it_is_given(
        tiny_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `fleet plan` had no --precision / --kv-cache: it always planned the default deploy's u8 cache, so the plan
    # it showed for an f32 deploy reserved a quarter of the cache that deploy would hold
    from deskfleet.controller.cli import main

    def planned(*options: str) -> str:
        code = main(["fleet", "plan", "--model", str(tiny_export), "--assume-agent", "16e9", "--discover-seconds",
                     "0", "--data-dir", str(tmp_path / "controller"), *options])
        assert code == 0
        return next(line for line in capsys.readouterr().out.splitlines() if "(total:" in line)

    assert "KV (u8, x2.5 as the cache grows)" in planned()
    assert "KV (f32, x2 as the cache grows)" in planned("--precision", "f32")
    assert "KV (f32, x2 as the cache grows)" in planned("--kv-cache", "f32")


def test_a_paper_plan_holds_the_model_as_a_deploy_would(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `fleet plan --layers ...` counted the weights at their file size, the KV cache without growth and no
    # prefill scratch: an 8B-shaped INT4 model at context 8192 showed 1 PC at 5.4 GB where a deploy of its export
    # reserves 12.8 GB over 2 PCs
    from deskfleet.controller.cli import main

    eight_b = ["fleet", "plan", "--layers", "32", "--layer-bytes", "115595018", "--embed-bytes", "525336576",
               "--head-bytes", "525336576", "--kv-bytes-per-token", "2176", "--context", "8192", "--assume-agent",
               "12e9", "--assume-agent", "12e9", "--discover-seconds", "0", "--data-dir", str(tmp_path / "c")]

    def planned(*options: str) -> str:
        main([*eight_b, *options])
        return capsys.readouterr().out

    with_width = planned("--width", str(4096 + 14336))
    assert "2 stage(s):" in with_width and "prefill scratch 5.13 GB / 6.64 GB" in with_width
    assert "9.42 GB" in with_width and "10.16 GB" in with_width  # what a deploy of the export reserves
    without = planned()
    assert "the weights x1.3 as held + KV (u8, x2.5 as the cache grows) + runtime" in without  # no width: no scratch
    assert "x2.5" not in planned("--device", "GPU")  # no growth measured there
