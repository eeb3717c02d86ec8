"""Checks on a generation request, made before any stage runs."""

from __future__ import annotations

from deskfleet.common.model_spec import ModelSpec


class GenerationError(ValueError):
    """The request cannot be run as given (bad prompt id, context overflow, ...)."""


def check_tokenized(spec: ModelSpec, prompt_ids: list[int]) -> None:
    """GenerationError when the tokenizer encoded a text prompt with a token id past the model's vocabulary:
    not the prompt's fault (check_request would name the prompt id as if it were), but the export's: a
    tokenizer with tokens added after the model was made (export warns of those), or a manifest.json whose
    vocab_size was edited."""
    if (outside := _outside_vocabulary(spec, prompt_ids)) is not None:
        position, token = outside
        raise GenerationError(
            f"the tokenizer encodes this text with token id {token} (at position {position}), past the model's "
            f"vocabulary of {spec.vocab_size} (manifest.json's vocab_size): the tokenizer holds tokens the "
            "model was not exported with, or manifest.json was edited; export the model again")


def check_request(spec: ModelSpec, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Raise GenerationError naming what is wrong with a prompt before any stage runs."""
    if not prompt_ids:
        raise GenerationError("the prompt is empty")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if (outside := _outside_vocabulary(spec, prompt_ids)) is not None:
        position, token = outside
        raise GenerationError(
            f"prompt id {token} at position {position} is outside the vocabulary (size {spec.vocab_size})")
    needed = len(prompt_ids) + max_new_tokens
    if needed > spec.max_context:
        room = spec.max_context - len(prompt_ids)  # new tokens that fit after this prompt
        # The remedy that can work: fewer new tokens help only where at least one fits after the prompt.
        if room >= 1:
            remedy = f"ask for at most {room} new tokens (--max-new-tokens {room})"
        elif max_new_tokens < spec.max_context:  # the prompt must leave room for the new tokens asked for
            remedy = (f"the prompt alone fills it: shorten the prompt to at most {spec.max_context - max_new_tokens} "
                      "tokens")
        else:
            remedy = "the prompt alone fills it, and so would the new tokens: shorten the prompt and ask for fewer"
        raise GenerationError(
            f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens = {needed} exceed the model's "
            f"context of {spec.max_context} ({remedy}, or export with a larger --max-context)")


def _outside_vocabulary(spec: ModelSpec, prompt_ids: list[int]) -> tuple[int, int] | None:
    """The first (position, id) of `prompt_ids` outside the model's vocabulary, or None."""
    return next(((position, token) for position, token in enumerate(prompt_ids)
                 if not 0 <= token < spec.vocab_size), None)
