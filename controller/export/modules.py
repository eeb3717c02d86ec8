"""Small torch modules, one per export unit, that compute exactly what transformers computes.

Each is traced to its own OpenVINO IR. A stage is later fused from them on the agent:

    rope:   position_ids [B,T], attention_mask [B,S]   -> cos [B,T,D], sin [B,T,D], attention_bias [B,1,T,S]
    embed:  input_ids [B,T]                            -> hidden [B,T,H]
    layer:  hidden [B,T,H], attention_bias, cos, sin,
            past_key [B,KV,P,D], past_value [B,KV,P,D] -> hidden [B,T,H], present_key/value [B,KV,P+T,D]
    head:   hidden [B,T,H]                             -> logits [B,T,V], next_tokens [B,T]

S = P + T physical KV slots; attention_mask marks the live ones (dead slots are rolled-back draft tokens or
padding of a row in a micro-batch). Positions are logical and travel separately from slots.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from .hf_config import CheckpointConfig
from .weights import CheckpointWeights


class RmsNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.eps))


def _linear(weights: CheckpointWeights, prefix: str, bias: bool) -> nn.Linear:
    return _fused_linear(weights, [prefix], bias)


def _fused_linear(weights: CheckpointWeights, prefixes: list[str], bias: bool) -> nn.Linear:
    """One Linear computing several projections of the same input, their outputs side by side.

    Row i of the weight is output channel i, so stacking the rows computes each projection exactly as
    before, and INT4 group quantization (groups run along a row) quantizes every row as it would alone.
    One MatMul instead of three (q, k, v) or two (gate, up): the CPU plugin quantizes the activation for
    a MatMul once and dispatches one kernel (README: fused projections).
    """
    weight = torch.cat([weights.get(f"{prefix}.weight") for prefix in prefixes], dim=0)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(torch.cat([weights.get(f"{prefix}.bias") for prefix in prefixes]),
                                  requires_grad=False)
    return layer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    # states: [B, KV, S, D] -> [B, KV * groups, S, D]
    if groups == 1:
        return states
    batch, kv_heads, slots, head_dim = states.shape
    expanded = states[:, :, None, :, :].expand(batch, kv_heads, groups, slots, head_dim)
    return expanded.reshape(batch, kv_heads * groups, slots, head_dim)


class RopeAndMask(nn.Module):
    """Gathers the precomputed RoPE rows by logical position and builds the additive attention bias."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
        super().__init__()
        self.cos_table: torch.Tensor
        self.sin_table: torch.Tensor
        self.register_buffer("cos_table", cos_table)  # [max_context, D]
        self.register_buffer("sin_table", sin_table)

    def forward(self, position_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos = self.cos_table[position_ids]  # [B, T, D]
        sin = self.sin_table[position_ids]
        # Slot indices built from shapes by cumsum, which traces with dynamic sizes.
        slot = torch.ones_like(attention_mask[0]).cumsum(0) - 1  # [S]
        query = torch.ones_like(position_ids[0]).cumsum(0) - 1  # [T]
        past = torch.ones_like(attention_mask[0]).sum() - torch.ones_like(position_ids[0]).sum()  # S - T
        causal = (slot[None, :] - query[:, None]) <= past  # [T, S]: key slot <= the query's own slot
        allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)  # [B, 1, T, S]
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        return cos, sin, bias


class Embed(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V, H]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[input_ids]  # [B, T, H]


class DecoderLayer(nn.Module):
    def __init__(self, config: CheckpointConfig, weights: CheckpointWeights, index: int) -> None:
        super().__init__()
        spec = config.spec
        prefix = f"model.layers.{index}"
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.input_norm = RmsNorm(weights.get(f"{prefix}.input_layernorm.weight"), config.rms_norm_eps)
        self.post_attention_norm = RmsNorm(
            weights.get(f"{prefix}.post_attention_layernorm.weight"), config.rms_norm_eps)
        attention = f"{prefix}.self_attn"
        self.qkv_proj = _fused_linear(weights, [f"{attention}.q_proj", f"{attention}.k_proj", f"{attention}.v_proj"],
                                      config.attention_bias)
        self.qkv_sizes = [self.num_heads * self.head_dim, *2 * [self.num_kv_heads * self.head_dim]]
        self.o_proj = _linear(weights, f"{attention}.o_proj", config.output_bias)
        self.gate_up_proj = _fused_linear(weights, [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"],
                                          config.mlp_bias)
        self.down_proj = _linear(weights, f"{prefix}.mlp.down_proj", config.mlp_bias)

    def forward(self, hidden: torch.Tensor, attention_bias: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden: [B, T, H]; past_key/value: [B, KV, P, D]
        residual = hidden
        normed = self.input_norm(hidden)
        query, key, value = torch.split(self.qkv_proj(normed), self.qkv_sizes, dim=-1)
        query = query.reshape(*normed.shape[:-1], self.num_heads, self.head_dim).transpose(1, 2)
        key = key.reshape(*normed.shape[:-1], self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = value.reshape(*normed.shape[:-1], self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        present_key = torch.cat([past_key, key], dim=2)  # [B, KV, P+T, D]
        present_value = torch.cat([past_value, value], dim=2)
        groups = self.num_heads // self.num_kv_heads
        attended = functional.scaled_dot_product_attention(
            query, _repeat_kv(present_key, groups), _repeat_kv(present_value, groups),
            attn_mask=attention_bias, scale=self.head_dim ** -0.5)  # [B, NH, T, D]
        attended = attended.transpose(1, 2).reshape(*normed.shape[:-1], self.num_heads * self.head_dim)
        hidden = residual + self.o_proj(attended)
        normed = self.post_attention_norm(hidden)
        gate, up = torch.chunk(self.gate_up_proj(normed), 2, dim=-1)
        hidden = hidden + self.down_proj(functional.silu(gate) * up)
        return hidden, present_key, present_value


class Head(nn.Module):
    """Final norm, lm_head, and the in-graph argmax so greedy decoding never copies the logits."""

    def __init__(self, config: CheckpointConfig, weights: CheckpointWeights) -> None:
        super().__init__()
        self.norm = RmsNorm(weights.get("model.norm.weight"), config.rms_norm_eps)
        name = "model.embed_tokens.weight" if config.spec.tie_word_embeddings else "lm_head.weight"
        self.weight = nn.Parameter(weights.get(name), requires_grad=False)  # [V, H]

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = functional.linear(self.norm(hidden), self.weight)  # [B, T, V]
        return logits, torch.argmax(logits, dim=-1)
