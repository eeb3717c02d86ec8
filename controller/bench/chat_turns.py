"""`deskfleet bench chat`: what resuming the last reply's KV state saves each turn of a chat.

A scripted conversation (`turns` user messages, one line each; by default the held-out code prompts of the demo
model's evaluation set, newlines as spaces) goes through `run_chat` twice a round on the same compiled stages:
resuming the KV state each reply leaves (the default) and feeding the whole conversation every turn
(`--no-reuse-kv`), in alternating order, after an untimed warm-up round. Per turn, medians over rounds:

    prompt_tokens        the conversation as the chat template renders it
    fed_tokens           what the resumed turn feeds of it (the rest its KV state held)
    first_token_s        from the engine's start to the reply's first token, either way, and whole / resumed
    render_s             the template's rendering and fitting (in the chat's render child), which both pay alike
                         (not in first_token_s)

Greedy: in f32 both ways give the same replies (`replies_identical`); in `fast` the KV cache is u8 and a prompt
fed in two calls may round differently from one fed whole.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.model_spec import load_manifest

from ..chat import ChatOptions, ReplyStats, check_room, run_chat
from ..pipeline import LocalPipeline
from .arguments import check_at_least
from .host import host_report
from .rounds import round_order
from .speculative import DEFAULT_EVAL_DIR, heldout_code_prompts

MODES = ("resumed", "whole")


def run_chat_bench(model: Path, turns: int = 8, reply_tokens: int = 64, rounds: int = 3, stages: int = 1,
                   messages: list[str] | None = None, settings: CompileSettings | None = None,
                   progress: bool = True) -> dict[str, Any]:
    """Run the bench; `messages` (one per turn, at least `turns`) default to the demo eval set's code prompts."""
    check_at_least(1, turns=turns, reply_tokens=reply_tokens, rounds=rounds, stages=stages)
    model = Path(model)
    manifest = load_manifest(model)  # a wrong folder fails here, naming it
    if messages is None:
        messages = heldout_code_prompts(DEFAULT_EVAL_DIR, turns, option="--turns")
    lines = [" ".join(message.split()) for message in messages[:turns]]
    needs = f"--turns {turns} needs {turns} non-empty message{'s' if turns > 1 else ''}"
    if len(lines) < turns:
        raise ValueError(f"{needs}, got {len(lines)}")
    if not all(lines):
        raise ValueError(f"{needs}: message {lines.index('') + 1} is empty")
    from ..tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(model)
    tokenizer.require_chat_template(f"{model} has no chat template, so it cannot chat")
    check_room(tokenizer, [], reply_tokens, manifest.spec.max_context, "--reply-tokens")  # before compiling
    _check_each_message_fits(tokenizer, lines, reply_tokens, manifest.spec.max_context)
    settings = settings or CompileSettings()
    started = time.perf_counter()
    samples: dict[str, list[list[ReplyStats]]] = {mode: [] for mode in MODES}
    replies: dict[str, str] = {}
    with LocalPipeline(model, stages, settings, manifest) as pipeline:
        for index in range(rounds + 1):  # round 0 warms up, untimed
            for mode in round_order(MODES, index):
                stats: list[ReplyStats] = []
                out = io.StringIO()
                options = ChatOptions(model=model, stages=stages, max_new_tokens=reply_tokens, settings=settings,
                                      reuse_kv=mode == "resumed")
                notes = io.StringIO()
                given = run_chat(options, io.StringIO("\n".join(lines) + "\n"), out, notes=notes,
                                 on_reply=stats.append, chain=pipeline, ctrl_c_ends_chat=True)
                if given != turns:
                    said = [line for line in notes.getvalue().splitlines() if line.strip()]
                    raise RuntimeError(f"the chat answered {given} of {turns} messages ({mode})"
                                       + (f": {said[-1].strip('[]')}" if said else ""))
                if index == 0:
                    replies[mode] = out.getvalue()
                else:
                    samples[mode].append(stats)
                    if progress:
                        total = sum(reply.first_token_s for reply in stats)
                        print(f"round {index}/{rounds} {mode}: first tokens {total:.3f} s over {turns} turns",
                              file=sys.stderr, flush=True)
    return build_report(samples, {
        "model": str(model), "stages": stages, "turns": turns, "reply_tokens": reply_tokens, "rounds": rounds,
        "precision": settings.precision.value, "host": host_report(),
        "replies_identical": replies["resumed"] == replies["whole"],
        "bench_s": round(time.perf_counter() - started, 1)})


def _check_each_message_fits(tokenizer: Any, lines: list[str], reply_tokens: int, max_context: int) -> None:
    """ValueError naming --reply-tokens when a message alone, with the chat template and the reply, outgrows the
    context: the chat would not send it, and the bench found out only after compiling and running turns."""
    from ..tokenizer import ChatMessage

    for number, line in enumerate(lines, 1):
        prompt = len(tokenizer.encode_chat([ChatMessage("user", line)]))
        if prompt + reply_tokens > max_context:
            room = max_context - prompt
            raise ValueError(f"--reply-tokens {reply_tokens}: message {number} alone takes {prompt} tokens with the "
                             f"chat template, and the model's context is {max_context} tokens"
                             + (f" (give --reply-tokens {room} or less)" if room >= 1 else
                                " (give shorter messages)"))


def build_report(samples: dict[str, list[list[ReplyStats]]], meta: dict[str, Any]) -> dict[str, Any]:
    """Per-turn medians over rounds, and the turns after the first summed (the first has nothing to resume)."""
    turns = len(samples["resumed"][0])

    def median(mode: str, turn: int, field: str) -> float:
        return float(statistics.median(getattr(stats[turn], field) for stats in samples[mode]))

    per_turn: list[dict[str, Any]] = []
    for turn in range(turns):
        first = {mode: median(mode, turn, "first_token_s") for mode in MODES}
        reply = samples["resumed"][0][turn]
        per_turn.append({
            "turn": turn + 1, "prompt_tokens": reply.prompt_tokens,
            "fed_tokens": reply.prompt_tokens - reply.reused_tokens,
            "first_token_s": {mode: round(first[mode], 4) for mode in MODES},
            "whole_over_resumed": round(first["whole"] / first["resumed"], 2) if first["resumed"] else None,
            "render_s": round(median("resumed", turn, "render_s"), 4)})
    later = {mode: [sum(stats[turn].first_token_s for turn in range(1, turns)) for stats in samples[mode]]
             for mode in MODES}
    summary = None
    if turns > 1:
        totals = {mode: statistics.median(later[mode]) for mode in MODES}
        summary = {"first_token_s_turns_2_on": {mode: round(totals[mode], 4) for mode in MODES},
                   "whole_over_resumed": round(totals["whole"] / totals["resumed"], 2) if totals["resumed"] else None,
                   "fed_tokens_turns_2_on": {"resumed": sum(t["fed_tokens"] for t in per_turn[1:]),
                                             "whole": sum(t["prompt_tokens"] for t in per_turn[1:])}}
    return {**meta, "per_turn": per_turn, "summary": summary}
