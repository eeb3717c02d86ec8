"""Precomputed RoPE tables, made by transformers' own rotary module so every rope_scaling type matches."""

from __future__ import annotations

import importlib

import torch

from .hf_config import CheckpointConfig, UnsupportedModelError, rope_theta

_ROTARY_CLASS = {"llama": "LlamaRotaryEmbedding", "mistral": "MistralRotaryEmbedding",
                 "qwen2": "Qwen2RotaryEmbedding"}


def rope_tables(config: CheckpointConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for logical positions 0..max_context-1, each [max_context, head_dim], float32.

    Uses the model's own transformers rotary class (inverse frequencies and attention scaling of the
    config's rope type, llama3/linear/yarn included) on all positions at once; its forward is
    elementwise in the position, so each row equals what transformers computes at that position.
    """
    architecture = config.spec.architecture
    module = importlib.import_module(f"transformers.models.{architecture}.modeling_{architecture}")
    rotary = getattr(module, _ROTARY_CLASS[architecture])(config.hf_config)
    positions = torch.arange(config.spec.max_context, dtype=torch.int64)[None, :]
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    for name, table in (("cos", cos), ("sin", sin)):
        # read_checkpoint_config refuses the values known to do it; any other mix of rope settings that overflows
        # is named here, not at every generate step as logits that are not finite
        if not bool(torch.isfinite(table).all()):
            raise UnsupportedModelError(f"the RoPE {name} table that the config's rope settings give holds values that "
                                        f"are not finite ({int((~torch.isfinite(table)).sum())} of {table.numel()}): "
                                        f"check config.json's rope_theta ({rope_theta(config.hf_config)}) and "
                                        "rope_scaling against the model's published config")
    return cos[0].to(torch.float32).contiguous(), sin[0].to(torch.float32).contiguous()
