"""What a stage keeps of its largest call, per token: the planner reserves it and each agent's memory guard counts
it, from one measurement of the CPU plugin."""

from __future__ import annotations

from deskfleet.common.model_spec import ModelSpec
from deskfleet.common.prefill_scratch import (
    PREFILL_SCRATCH,
    PREFILL_SCRATCH_FIRST,
    layer_width,
    prefill_scratch_per_token,
)


def test_a_cpu_stage_keeps_per_token_a_share_of_its_layers_width_and_the_first_stage_less() -> None:
    # the demo target (hidden 384, intermediate 1024) kept 48 MB after a first-stage call of 1,024 tokens
    width = 384 + 1024
    assert prefill_scratch_per_token("CPU", width, first=True) == 47_872 == round(PREFILL_SCRATCH_FIRST * width)
    assert prefill_scratch_per_token("CPU", width) == 61_952 == round(PREFILL_SCRATCH * width)
    assert prefill_scratch_per_token("CPU", 7) == 308  # rounded up


def test_nothing_is_known_of_other_devices() -> None:
    for device in ("GPU", "GPU.1", "NPU", "HETERO:GPU,CPU"):
        assert prefill_scratch_per_token(device, 4096) == 0
        assert prefill_scratch_per_token(device, 4096, first=True) == 0


def test_a_layers_width_is_its_hidden_and_intermediate_sizes() -> None:
    spec = ModelSpec(architecture="llama", num_layers=8, hidden_size=384, num_heads=6, num_kv_heads=2, head_dim=64,
                     intermediate_size=1024, vocab_size=8192, max_context=1024, bos_token_id=1, eos_token_ids=(2,),
                     rope_type="default", tie_word_embeddings=False)
    assert layer_width(spec) == 1408
