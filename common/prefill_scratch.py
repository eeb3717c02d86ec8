"""The working memory a stage keeps after a call: the CPU plugin keeps the buffers of an InferRequest's largest call
until the request is destroyed, and a prompt's call is the largest by far.

Pure code. The planner reserves it for a deployment's `--streams` prompts of the whole context
(controller/fleet_deploy.py, footprint_of), and each agent's KV memory guard counts it for a call larger than any its
micro-batch's request ran before (agent/stage_executor.py).
"""

from __future__ import annotations

import math

from deskfleet.common.devices import device_kind
from deskfleet.common.model_spec import ModelSpec

# Per token of the call (rows x tokens) and per unit of hidden_size + intermediate_size, at its peak during the
# call, less the KV cache. Measured (one thread; two the same): a stage fed hidden states, 170M (1024 + 2816)
# layers [4:8) after 2048 tokens 335 MB (42.6 bytes), [8:12) with the head 318 MB (40.5), 1024 tokens 163 MB
# (41.4); 1.1B-shaped (2048 + 8192) layers [4:12), 1024 tokens 439 MB (41.8). The first stage (fed token ids):
# 170M [0:4) 258 MB (32.8), the whole 170M 242 MB (30.8), the whole 330M as the 170M (it does not grow with the
# layers), the whole 1.1B 315 MB (30.0), the demo target (384 + 1024) 48 MB (33.1). 4 rows of 512 tokens took
# what 1 of 2048 did.
PREFILL_SCRATCH = 44.0
PREFILL_SCRATCH_FIRST = 34.0


def prefill_scratch_per_token(device: str, width: int, first: bool = False) -> int:
    """The bytes a stage on `device` keeps per token of its largest call, for layers of hidden_size +
    intermediate_size `width` (`first`: the first stage, fed token ids); measured on the CPU plugin, 0 (none known)
    on other devices."""
    if device_kind(device) != "CPU":
        return 0
    return math.ceil((PREFILL_SCRATCH_FIRST if first else PREFILL_SCRATCH) * width)


def layer_width(spec: ModelSpec) -> int:
    """hidden_size + intermediate_size: what a layer's scratch per token grows with."""
    return spec.hidden_size + spec.intermediate_size
