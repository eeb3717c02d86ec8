"""Greedy generation of one stream through a pipeline: prefill, then one token per step until EOS."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from deskfleet.common.model_spec import ModelSpec

from .pipeline import LocalPipeline, StepRequest


class GenerationError(ValueError):
    """The request cannot be run as given (bad prompt id, context overflow, ...)."""


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    stopped_by_eos: bool

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token (which prefill produces)."""
        decoded = len(self.tokens) - 1
        return decoded / self.decode_s if decoded > 0 and self.decode_s > 0 else 0.0


def check_request(spec: ModelSpec, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Raise GenerationError naming what is wrong with a prompt before any stage runs."""
    if not prompt_ids:
        raise GenerationError("the prompt is empty")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    for position, token in enumerate(prompt_ids):
        if not 0 <= token < spec.vocab_size:
            raise GenerationError(
                f"prompt id {token} at position {position} is outside the vocabulary (size {spec.vocab_size})")
    needed = len(prompt_ids) + max_new_tokens
    if needed > spec.max_context:
        raise GenerationError(
            f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens = {needed} exceed the model's "
            f"context of {spec.max_context} (export with a larger --max-context or ask for fewer tokens)")


def generate_greedy(pipeline: LocalPipeline, prompt_ids: list[int], max_new_tokens: int,
                    ignore_eos: bool = False, on_token: Callable[[int], None] | None = None,
                    batch_id: int = 0) -> GenerationResult:
    """Greedy tokens for one prompt. Stops at an EOS id of the model unless ignore_eos."""
    spec = pipeline.manifest.spec
    check_request(spec, prompt_ids, max_new_tokens)
    eos = set(spec.eos_token_ids)
    beam = np.zeros(1, dtype=np.int32)
    started = time.perf_counter()
    length = len(prompt_ids)
    result = pipeline.step(StepRequest(
        batch_id=batch_id,
        payload=np.array([prompt_ids], dtype=np.int64),
        attention_mask=np.ones((1, length), dtype=np.int64),
        position_ids=np.arange(length, dtype=np.int64)[None, :],
        beam_idx=beam,
        reset=True,
    ))
    prefilled = time.perf_counter()
    tokens: list[int] = []
    stopped = False
    while True:
        token = int(result.next_tokens[0, -1])
        tokens.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos and not ignore_eos:
            stopped = True
            break
        if len(tokens) == max_new_tokens:
            break
        length += 1
        result = pipeline.step(StepRequest(
            batch_id=batch_id,
            payload=np.array([[token]], dtype=np.int64),
            attention_mask=np.ones((1, length), dtype=np.int64),
            position_ids=np.array([[length - 1]], dtype=np.int64),
            beam_idx=beam,
        ))
    finished = time.perf_counter()
    return GenerationResult(tokens=tokens, prompt_tokens=len(prompt_ids), prefill_s=prefilled - started,
                            decode_s=finished - prefilled, stopped_by_eos=stopped)
