"""What a stage's KV cache holds a token in: the precision the agents compile it with, and its bytes.

Pure code. The planner prices a deployment's KV caches with it (controller/fleet_deploy.py), and each agent
bounds what its stages' caches may grow to (agent/kv_memory_guard.py)."""

from __future__ import annotations

from deskfleet.common.devices import device_kind
from deskfleet.common.model_spec import ModelSpec
from deskfleet.common.wire_messages import Precision

KV_SCALE_BYTES = 8  # u8: a f32 scale and zero point for every token of every KV head, keys and values each


def kv_cache_precision(precision: Precision, device: str, kv_cache: str | None) -> str | None:
    """The KV cache precision the agents will compile a stage with (agent/core.py, agent/stage.py): the one
    named; f32 for --precision f32; else (the fast precision) the device's own, u8 on a CPU. None: a device's
    own that is not known here (GPU, NPU...). A fleet's stages never switch to f32 for drafting: the draft runs
    on the controller, and the stages keep what the deploy said."""
    if kv_cache is not None:
        return kv_cache
    if precision is Precision.F32:
        return "f32"
    return "u8" if device_kind(device) == "CPU" else None


def kv_cache_bytes_per_token_per_layer(spec: ModelSpec, kv_cache: str | None) -> int:
    """The bytes one token takes in one layer's KV cache of precision `kv_cache` (None: counted as f32).

    u8 stores each head's key (and value) of a token as head_dim bytes plus its f32 scale and zero point
    (the CPU plugin's scaled_attn: scale_zp [L, B, H, 2]): 72 bytes for head_dim 64, 1.125 a value."""
    if kv_cache == "u8":
        return 2 * spec.num_kv_heads * (spec.head_dim + KV_SCALE_BYTES)
    return spec.kv_bytes_per_token_per_layer(2 if kv_cache in ("f16", "bf16") else 4)
