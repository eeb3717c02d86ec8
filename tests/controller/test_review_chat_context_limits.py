"""The errors of a request past the model's context say what can make it fit (tiny_export: a context of 512)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller.cli import main


@pytest.mark.parametrize(("prompt_tokens", "max_new_tokens", "remedy"), [
    # a prompt that leaves room: the largest --max-new-tokens that fits
    (500, 64, "(ask for at most 12 new tokens (--max-new-tokens 12), or export with a larger --max-context)"),
    (511, 2, "(ask for at most 1 new tokens (--max-new-tokens 1), or export with a larger --max-context)"),
    # a prompt that fills the context: fewer new tokens cannot help ("ask for fewer tokens" said they would)
    (512, 1, "(the prompt alone fills it: shorten the prompt to at most 511 tokens, or export with a larger "
             "--max-context)"),
    (2000, 64, "(the prompt alone fills it: shorten the prompt to at most 448 tokens, or export with a larger "
               "--max-context)"),  # it said 511, which 64 new tokens do not fit after
    (600, 512, "(the prompt alone fills it, and so would the new tokens: shorten the prompt and ask for fewer, or "
               "export with a larger --max-context)"),
])
def test_a_prompt_past_the_context_is_told_what_fits(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                                    prompt_tokens: int, max_new_tokens: int, remedy: str) -> None:
    ids = ",".join(["5"] * prompt_tokens)
    assert main(["generate", "--model", str(tiny_export), "--prompt-ids", ids,
                 "--max-new-tokens", str(max_new_tokens)]) == 2
    assert capsys.readouterr().err == (
        f"deskfleet: error: --prompt-ids: {prompt_tokens} prompt tokens + {max_new_tokens} new tokens = "
        f"{prompt_tokens + max_new_tokens} exceed the model's context of 512 {remedy}\n")

