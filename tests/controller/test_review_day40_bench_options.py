"""Bench sizes that outgrow the model, or ask for more prompts than there are, are refused naming the option the
user gives (README: "refused naming the option"): some said "1000 + 100 tokens exceed ..." or "200 prompts asked
for", naming none."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.bench.chat_turns import run_chat_bench
from deskfleet.controller.bench.parity import run_parity_bench
from deskfleet.controller.bench.rollback import run_rollback_bench
from deskfleet.controller.bench.speculative import run_speculative_bench
from deskfleet.controller.bench.streams import run_streams_bench


def test_sizes_beyond_the_context_name_their_options(tiny_export: Path) -> None:
    context = load_manifest(tiny_export).spec.max_context
    too_many = context  # with any prompt at all, more than the context holds
    with pytest.raises(ValueError, match=rf"^--prompt-tokens 8 \+ --new-tokens {too_many} exceed the model's context "
                                         rf"of {context} tokens$"):
        run_streams_bench(tiny_export, users=[1], prompt_tokens=8, new_tokens=too_many)
    with pytest.raises(ValueError, match=rf"^--prompt-tokens 8 \+ --new-tokens {too_many} exceed"):
        run_parity_bench(tiny_export, prompt_tokens=8, new_tokens=too_many)
    with pytest.raises(ValueError, match=rf"^--new-tokens {too_many}: with the longest prompt's 3 tokens that exceeds "
                                         rf"the model's context of {context} tokens \(give --new-tokens {context - 3} "
                                         r"or less\)$"):
        run_speculative_bench(tiny_export, None, ks=(2,), prompt_ids=[[5, 6, 7]], new_tokens=too_many)
    with pytest.raises(ValueError, match=r"^--dead-slots 64 is more than the shortest of --contexts \(32\): .*"
                                         r"\(give --dead-slots 32 or less\)$"):
        run_rollback_bench(tiny_export, contexts=[32, 64], dead_slots=[64])


def test_more_turns_than_held_out_prompts_names_turns(tmp_path: Path, tiny_export: Path) -> None:
    with pytest.raises(ValueError, match=r"^--turns 100000: the held-out set of .* holds \d+ prompts$"):
        run_chat_bench(tiny_export, turns=100_000)
