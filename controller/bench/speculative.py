"""`deskfleet bench speculative`: one stage, greedy code completion with and without the draft model.

Prompts: held-out code prompts of the demo model's evaluation set (assets/models/train/evaluate.py:
the function signatures + docstrings of the held-out standard-library modules, the same random pick of
`--prompts` as its acceptance figure; the pool as the corpus's Python has them is shipped beside it in
heldout_prompts.json), or one prompt per line of `--prompts-file` (read as generate reads it:
controller/run.py read_prompts_file, "\\n" for newlines).

Variants, each on the same 1-stage LocalPipeline:
    plain             no draft: one target call per token
    k=K               the draft model proposes exactly K tokens per round (for each K of --k)
    adaptive          AdaptiveK chooses K from measured acceptance and round cost (1..--k-max)
    lookup k=K        prompt lookup (controller/prompt_lookup.py) proposes up to K tokens copied from the
    lookup adaptive   stream's own context, no draft model (unless --no-lookup)
    lookup-first k=K  with a draft model and lookup on: copied tokens where the context repeats itself,
    lookup-first adaptive   the draft model's elsewhere (controller/lookup_first.py)
Every prompt runs as one stream through the Engine (what `deskfleet generate --draft` runs), until EOS or
`new_tokens`; greedy speculative output is token-identical to plain, so every variant makes the same
tokens (checked). Interleaved: for each round, for each prompt, every variant in turn.

Decode tok/s = tokens after the first / time after the first token, summed over the prompts of a round;
speedup = its median over rounds vs plain's. The profile says where time goes: the target's time per call
(plain: 1 token; speculative: K+1 tokens to verify), the draft's time per proposed token, their ratio,
and the speedup the measured acceptance and costs predict. `target_call_costs` (controller/bench/call_costs.py)
times the target alone at each width, back to back and alternating; each variant's `width_switches` and
`switch_share_of_decode_calls` say how much of its target time went to changing the width between calls.
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.speculative import MAX_K
from deskfleet.common.wire import Forward, ForwardResult

from .arguments import check_at_least
from .call_costs import context_needed, measure_call_costs
from .host import host_report
from .parity import _read_properties, compare, summarize
from .rounds import round_order

# The demo model's evaluation folder in this source tree (the package's folders are the repo's: controller/bench/
# is two below its root), whatever the current folder is; an installed copy of the package (pip install ., not
# editable) has no assets beside it, and takes the folder under the current one, as the repo root has it. Where
# neither is, the benches say so (or use their built-in prompts).
_SOURCE_EVAL_DIR = Path(__file__).resolve().parents[2] / "assets" / "models" / "train"
DEFAULT_EVAL_DIR = _SOURCE_EVAL_DIR if _SOURCE_EVAL_DIR.is_dir() else Path("assets") / "models" / "train"
PROMPT_POOL_FILE = "heldout_prompts.json"  # heldout_prompt_pool() of the corpus's Python, shipped
DEFAULT_HELDOUT_PROMPTS = 12  # how many of them `bench speculative` takes when not told
GOAL = 2.0
_Item = TypeVar("_Item")


@dataclass
class VariantStats:
    """What one variant did over one round (all prompts)."""

    decoded_tokens: int = 0  # tokens after each stream's first
    decode_s: float = 0.0
    generated_tokens: int = 0
    wall_s: float = 0.0
    histogram: Counter[int] = field(default_factory=Counter)
    target_calls: Counter[str] = field(default_factory=Counter)  # by kind: prefill, plain (1 token), verify
    target_s: dict[str, float] = field(default_factory=dict)  # seconds by kind
    draft_s: float = 0.0
    draft_tokens: int = 0
    width_switches: int = 0  # decode calls whose width (T) differed from the previous decode call's
    copied_rows: int = 0  # lookup-first: rows whose proposal was copied from the context
    drafted_rows: int = 0  # lookup-first: rows the draft model proposed for

    @property
    def decode_tok_s(self) -> float:
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else 0.0


class TimingChain:
    """A StageChain that times each call of a one-step-at-a-time chain, by kind (prefill, plain, verify)."""

    def __init__(self, chain: Any) -> None:
        self.chain = chain
        self.stats: VariantStats | None = None
        self._sent: list[tuple[str, float]] = []
        self._last_decode_width: int | None = None  # None after a prefill: its switch is not the policy's

    def submit(self, message: Forward) -> None:
        kind = call_kind(message)
        width = int(message.input_ids.shape[1]) if message.input_ids is not None else 1
        if kind == "prefill":
            self._last_decode_width = None
        else:
            if self.stats is not None and self._last_decode_width not in (None, width):
                self.stats.width_switches += 1
            self._last_decode_width = width
        self._sent.append((kind, time.perf_counter()))
        self.chain.submit(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        result: ForwardResult = self.chain.collect(timeout)
        kind, sent = self._sent.pop(0)
        if self.stats is not None:
            self.stats.target_calls[kind] += 1
            self.stats.target_s[kind] = self.stats.target_s.get(kind, 0.0) + time.perf_counter() - sent
        return result

    def release(self, batch_id: int) -> None:
        self.chain.release(batch_id)

    def renumber(self) -> None:
        self.chain.renumber()


class TimingDraft:
    """A drafter whose propose() calls are timed (everything else passes through)."""

    def __init__(self, draft: Any) -> None:
        self.draft = draft
        self.stats: VariantStats | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.draft, name)

    def propose(self, micro_batch_id: int, rows: Any) -> Any:
        counts = (getattr(self.draft, "copied_rounds", 0), getattr(self.draft, "drafted_rounds", 0))
        started = time.perf_counter()
        proposal = self.draft.propose(micro_batch_id, rows)
        if self.stats is not None:
            self.stats.draft_s += time.perf_counter() - started
            self.stats.draft_tokens += sum(len(tokens) for tokens in proposal.tokens.values())
            self.stats.copied_rows += getattr(self.draft, "copied_rounds", 0) - counts[0]
            self.stats.drafted_rows += getattr(self.draft, "drafted_rounds", 0) - counts[1]
        return proposal


# Public methods: pure parts

def call_kind(message: Forward) -> str:
    """"verify" (draft tokens to check), "plain" (one token per row) or "prefill" (a prompt)."""
    if message.draft is not None:
        return "verify"
    width = int(message.input_ids.shape[1]) if message.input_ids is not None else 1
    return "plain" if width == 1 else "prefill"


LOOKUP = "lookup "  # the name prefix of prompt-lookup variants
LOOKUP_FIRST = "lookup-first "  # the name prefix of lookup-first variants (a draft model and lookup)
DRAFTERS = {"": "draft model", LOOKUP: "prompt lookup", LOOKUP_FIRST: "lookup first"}  # by name prefix


def variant_names(ks: Sequence[int], adaptive: bool, draft_model: bool = True, lookup: bool = False) -> list[str]:
    drafted = [*(f"k={k}" for k in ks), *(["adaptive"] if adaptive else [])]
    prefixes = [*([""] if draft_model else []), *([LOOKUP] if lookup else []),
                *([LOOKUP_FIRST] if draft_model and lookup else [])]
    return ["plain", *(prefix + name for prefix in prefixes for name in drafted)]


def variant_drafter(name: str) -> str | None:
    """Which drafter a variant runs: "draft model", "prompt lookup", "lookup first", or None (plain)."""
    if name == "plain":
        return None
    return DRAFTERS[LOOKUP_FIRST if name.startswith(LOOKUP_FIRST) else LOOKUP if name.startswith(LOOKUP) else ""]


def variant_fixed_k(name: str) -> int | None:
    """The K a variant fixes (None: adaptive, or plain)."""
    _, _, k = name.removeprefix(LOOKUP_FIRST).removeprefix(LOOKUP).partition("k=")
    return int(k) if k else None


def heldout_code_prompts(eval_dir: Path, count: int, stdlib: Path | None = None,
                         option: str = "--prompts") -> list[str]:
    """The demo model's held-out code prompts: evaluate.py's acceptance pick (random.Random(4).sample).

    The pool comes from `eval_dir/heldout_prompts.json` (built from the corpus's Python, 3.11.7), so every
    machine benchmarks the same prompts whatever its own Python; without that file, or with `stdlib`
    given, evaluate.py builds it from that standard library (another Python's versions of the held-out
    modules give other prompts)."""
    shipped = Path(eval_dir) / PROMPT_POOL_FILE
    pool = (read_prompt_pool(shipped) if stdlib is None and shipped.is_file()
            else heldout_prompt_pool(eval_dir, stdlib or Path(sysconfig.get_paths()["stdlib"]))[0])
    if not pool:
        raise ValueError(f"no held-out prompts found in {eval_dir}")
    if count > len(pool):  # taking all of them instead ran a bench other than the one asked for, unsaid
        raise ValueError(f"{option} {count}: the held-out set of {eval_dir} holds {len(pool)} prompts")
    return list(random.Random(4).sample(pool, count))


def heldout_prompt_pool(eval_dir: Path, stdlib: Path) -> tuple[list[str], bool]:
    """(every held-out function head evaluate.py finds in `stdlib`, in its order; whether that standard
    library's held-out files are the ones the corpus manifest lists)."""
    script = Path(eval_dir) / "evaluate.py"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: pass --prompts-file, or --eval-dir of the demo model")
    sys.path.insert(0, str(script.parent))
    try:
        spec = importlib.util.spec_from_file_location("deskfleet_demo_evaluate", script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        files, same = module.heldout_files(stdlib)
        by_module = module.function_prompts(files)
        return [prompt for name in module.HELDOUT for prompt in by_module.get(name, [])], bool(same)
    finally:
        sys.path.remove(str(script.parent))


def read_prompt_pool(path: Path) -> list[str]:
    try:
        pool = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the prompt pool {path}: {error}") from None
    if not isinstance(pool, list) or not all(isinstance(prompt, str) for prompt in pool):
        raise ValueError(f"{path} is not a JSON list of prompt strings")
    return pool


def predicted_speedup(mean_accepted: float, k: float, plain_call_s: float, verify_call_s: float,
                      draft_token_s: float, plain_steps_per_round: float = 0.0) -> float:
    """Tokens per round over the round's cost, relative to one plain call per token. A drafter that may
    propose nothing (prompt lookup) also takes `plain_steps_per_round` plain steps per verified round."""
    round_s = verify_call_s + k * draft_token_s + plain_steps_per_round * plain_call_s
    tokens = mean_accepted + 1.0 + plain_steps_per_round
    return tokens * plain_call_s / round_s if round_s > 0 else 0.0


def build_report(rounds: dict[str, list[VariantStats]], meta: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = dict(meta)
    speeds = {name: [stats.decode_tok_s for stats in runs] for name, runs in rounds.items()}
    report["decode_tok_s"] = {name: summarize(values) for name, values in speeds.items()}
    report["end_to_end_tok_s"] = {
        name: round(sum(s.generated_tokens for s in runs) / sum(s.wall_s for s in runs), 3)
        for name, runs in rounds.items() if sum(s.wall_s for s in runs) > 0}
    plain = rounds.get("plain")
    plain_call = _mean_call(plain, "plain") if plain else None
    penalty_ms = (meta.get("target_call_costs") or {}).get("switch_penalty_ms")
    variants: dict[str, Any] = {}
    for name, runs in rounds.items():
        if name == "plain":
            continue
        histogram: Counter[int] = Counter()
        for stats in runs:
            histogram.update(stats.histogram)
        verifications = sum(histogram.values())
        mean_accepted = sum(a * n for a, n in histogram.items()) / verifications if verifications else 0.0
        draft_tokens = sum(s.draft_tokens for s in runs)
        draft_token_s = sum(s.draft_s for s in runs) / draft_tokens if draft_tokens else 0.0
        verify_call = _mean_call(runs, "verify") or 0.0
        mean_k = draft_tokens / verifications if verifications else 0.0
        entry: dict[str, Any] = {
            "accepted_histogram": {str(a): n for a, n in sorted(histogram.items())},
            "mean_accepted": round(mean_accepted, 3),
            "mean_k": round(mean_k, 3),
            "acceptance_rate": round(mean_accepted / mean_k, 3) if mean_k else None,
            "verifications": verifications,
            "plain_steps": sum(stats.target_calls["plain"] for stats in runs),  # rounds that proposed nothing
            "width_switches": sum(stats.width_switches for stats in runs),
        }
        copied, drafted = sum(s.copied_rows for s in runs), sum(s.drafted_rows for s in runs)
        if copied + drafted:
            entry["copied_share_of_proposals"] = round(copied / (copied + drafted), 3)
        if plain is not None:
            entry["speedup"] = compare(speeds[name], speeds["plain"])
        profile: dict[str, Any] = {"draft_ms_per_token": round(draft_token_s * 1e3, 3),
                                   "target_verify_ms_per_call": round(verify_call * 1e3, 3)}
        if plain_call:
            profile["target_plain_ms_per_call"] = round(plain_call * 1e3, 3)
            profile["draft_over_target_cost"] = round(draft_token_s / plain_call, 3)
            profile["verify_over_plain_call"] = round(verify_call / plain_call, 3) if verify_call else None
            plain_per_round = entry["plain_steps"] / verifications if verifications else 0.0
            profile["predicted_speedup"] = round(predicted_speedup(mean_accepted, mean_k, plain_call, verify_call,
                                                                   draft_token_s, plain_per_round), 3)
        if penalty_ms is not None:
            decode_s = sum(stats.target_s.get(kind, 0.0) for stats in runs for kind in ("plain", "verify"))
            switches_s = entry["width_switches"] * penalty_ms / 1e3
            profile["switch_share_of_decode_calls"] = round(switches_s / decode_s, 3) if decode_s else None
        entry["profile"] = profile
        variants[name] = entry
    report["speculative"] = variants
    best = _best(variants, list(variants))
    if best is not None:
        report["best"] = best
        report["best_by_drafter"] = {
            drafter: found for drafter in DRAFTERS.values()
            if (found := _best(variants, [name for name in variants if variant_drafter(name) == drafter]))
            is not None}
    return report


def _best(variants: dict[str, Any], names: list[str]) -> dict[str, Any] | None:
    timed = [name for name in names if "speedup" in variants[name]]
    if not timed:
        return None
    best = max(timed, key=lambda name: variants[name]["speedup"]["ratio_of_medians"])
    speedup = variants[best]["speedup"]["ratio_of_medians"]
    return {"variant": best, "speedup": speedup, "goal": f">= {GOAL}x", "goal_met": speedup >= GOAL}


# Public methods: the benchmark

def run_speculative_bench(target: Path, draft: Path | None, ks: Sequence[int] = (2, 4, 6), adaptive: bool = True,
                          lookup: bool = True, k_max: int = 8, prompts: list[str] | None = None,
                          prompt_ids: list[list[int]] | None = None, eval_dir: Path | None = None,
                          num_prompts: int | None = None, new_tokens: int = 64,
                          rounds: int = 3, settings: CompileSettings | None = None,
                          progress: bool = True) -> dict[str, Any]:
    """Run the speculative benchmark; prompts from `prompt_ids`, else `prompts`, else the eval set.

    `num_prompts`: how many of them (None: every prompt given, or DEFAULT_HELDOUT_PROMPTS of the eval set); more
    than there are is refused, naming how many there are.

    `draft` None: only the prompt-lookup variants (then `lookup` must be on)."""
    from deskfleet.controller.draft import DraftModel, check_draft_for
    from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
    from deskfleet.controller.lookup_first import LookupFirstDraft
    from deskfleet.controller.pipeline import LocalPipeline
    from deskfleet.controller.prompt_lookup import PromptLookupDraft
    from deskfleet.controller.tokenizer import ModelTokenizer

    if draft is None and not lookup:
        raise ValueError("nothing to compare: give a draft model, or keep the prompt-lookup variants")
    if not ks and not adaptive:
        raise ValueError("no speculative variant: give --k values, or keep the adaptive one")
    if any(k < 1 for k in ks):
        raise ValueError(f"--k values must be 1 or more, got {list(ks)}: K 0 drafts nothing, which is the plain "
                         f"variant (always run)")
    if any(k > MAX_K for k in ks):
        raise ValueError(f"--k values must be at most {MAX_K}, got {list(ks)}")
    check_at_least(1, k_max=k_max, rounds=rounds)
    check_at_least(2, new_tokens=new_tokens)  # decoding is timed from the second token: 1 divided by zero
    if num_prompts is not None:
        check_at_least(1, prompts=num_prompts)
    if k_max > MAX_K:
        raise ValueError(f"--k-max must be at most {MAX_K}, got {k_max}")
    target = Path(target)
    settings = (settings or CompileSettings()).for_drafting()  # what `generate --draft` compiles
    manifest = load_manifest(target)
    spec = manifest.spec
    if draft is not None:  # a draft of another tokenizer was timed, accepting nothing, without a word
        try:
            check_draft_for(Path(draft), load_manifest(Path(draft)), target, manifest)
        except ValueError as error:
            raise ValueError(f"--draft {draft} cannot draft for --model {target}: {error}") from None
    widths = sorted({1, *(k + 1 for k in ks), k_max + 1})  # what target_call_costs times, after the rounds
    if context_needed(widths) > spec.max_context:
        raise ValueError(f"timing the target's calls at widths {widths} (--k values + 1, --k-max + 1) takes "
                         f"{context_needed(widths)} slots, more than the model's context {spec.max_context}: "
                         "give smaller --k / --k-max, or export with a larger --max-context")
    source = "prompt_ids"
    if prompt_ids is None:
        if prompts is None:
            prompts = heldout_code_prompts(eval_dir or DEFAULT_EVAL_DIR, num_prompts or DEFAULT_HELDOUT_PROMPTS)
            pool_file = Path(eval_dir or DEFAULT_EVAL_DIR) / PROMPT_POOL_FILE
            origin = pool_file if pool_file.is_file() else pool_file.with_name("evaluate.py")
            source = f"held-out code prompts of {origin}"
        else:
            source = "prompts file"
        tokenizer = ModelTokenizer(target)
        prompt_ids = [tokenizer.encode(text) for text in _first(prompts, num_prompts, source)]
    prompt_ids = _first(prompt_ids, num_prompts, source)
    if not prompt_ids:
        raise ValueError("no prompts")
    longest = max(len(ids) for ids in prompt_ids)
    if longest >= spec.max_context:  # no --new-tokens fits: it was told to give a negative one
        which = next(index for index, ids in enumerate(prompt_ids, 1) if len(ids) == longest)
        raise ValueError(f"prompt {which} of the {source} alone takes {longest} tokens, the model's context is "
                         f"{spec.max_context}: give shorter prompts")
    if longest + new_tokens > spec.max_context:
        raise ValueError(f"--new-tokens {new_tokens}: with the longest prompt's {longest} tokens that exceeds the "
                         f"model's context of {spec.max_context} tokens (give --new-tokens "
                         f"{spec.max_context - longest} or less)")
    names = variant_names(ks, adaptive, draft_model=draft is not None, lookup=lookup)
    options = {name: EngineOptions(max_rows=1, micro_batches=1, k_max=k_max, fixed_k=variant_fixed_k(name))
               for name in names}
    started = time.perf_counter()
    results: dict[str, list[VariantStats]] = {name: [] for name in names}
    tokens_by_variant: dict[str, list[list[int]]] = {name: [] for name in names}
    with LocalPipeline(target, 1, settings, manifest) as pipeline:
        chain = TimingChain(pipeline)
        model = DraftModel(Path(draft), settings) if draft is not None else None  # one run at a time uses it
        drafters = {"draft model": TimingDraft(model) if model is not None else None,
                    "prompt lookup": TimingDraft(PromptLookupDraft()),
                    "lookup first": TimingDraft(LookupFirstDraft(model)) if model is not None else None}
        compiled = _read_properties(pipeline.stages[0].compiled)
        for index in range(rounds + 1):  # round 0 warms up, untimed
            current = {name: VariantStats() for name in names}
            for prompt_index, ids in enumerate(prompt_ids):
                for name in round_order(names, index):
                    stats = current[name]
                    kind = variant_drafter(name)
                    drafter = drafters[kind] if kind is not None else None
                    chain.stats = stats
                    if drafter is not None:
                        drafter.stats = stats
                    engine = Engine(chain, spec, drafter, options[name])
                    engine.add(StreamRequest(list(ids), max_new_tokens=new_tokens))
                    began = time.perf_counter()
                    (result,) = engine.run().values()
                    stats.wall_s += time.perf_counter() - began
                    stats.generated_tokens += len(result.tokens)
                    stats.decoded_tokens += len(result.tokens) - 1
                    stats.decode_s += result.last_token_s - result.first_token_s
                    stats.histogram.update(engine.accepted_histogram())
                    if index == 0:
                        tokens_by_variant[name].append(result.tokens)
                    elif progress and prompt_index == len(prompt_ids) - 1:
                        print(f"round {index}/{rounds} {name}: {stats.decode_tok_s:.1f} tok/s", file=sys.stderr,
                              flush=True)
            if index > 0:
                for name in names:
                    results[name].append(current[name])
        call_costs = measure_call_costs(pipeline.stages[0], widths, spec.max_context)
    chain.stats = None
    reference = tokens_by_variant["plain"]
    meta: dict[str, Any] = {
        "target": str(target), "draft": str(draft) if draft is not None else None,
        "target_spec": {"layers": spec.num_layers, "hidden": spec.hidden_size, "vocab": spec.vocab_size,
                        "weights": manifest.weight_format.value},
        "draft_spec": _spec_summary(Path(draft)) if draft is not None else None,
        "compiled_properties": compiled,
        "target_call_costs": call_costs,
        "host": host_report(),
        "prompts": {"source": source, "count": len(prompt_ids),
                    "tokens_median": statistics.median(len(ids) for ids in prompt_ids)},
        "new_tokens_max": new_tokens,
        "generated_tokens_per_round": sum(len(tokens) for tokens in reference),
        "rounds": rounds,
        "order": names,
        "greedy_identical_to_plain": {name: tokens_by_variant[name] == reference for name in names if name != "plain"},
    }
    report = build_report(results, meta)
    report["bench_s"] = round(time.perf_counter() - started, 1)
    return report


# Private methods

def _first(items: list[_Item], count: int | None, source: str) -> list[_Item]:
    """The first `count` items (None: all); more than there are is refused: a bench of fewer prompts than asked
    for, unsaid, is not the bench asked for."""
    if count is not None and count > len(items):
        raise ValueError(f"--prompts {count}: there are only {len(items)} ({source})")
    return items[:count]


def _mean_call(runs: list[VariantStats], kind: str) -> float | None:
    calls = sum(stats.target_calls[kind] for stats in runs)
    return sum(stats.target_s.get(kind, 0.0) for stats in runs) / calls if calls else None


def _spec_summary(model: Path) -> dict[str, Any]:
    manifest = load_manifest(model)
    spec = manifest.spec
    return {"layers": spec.num_layers, "hidden": spec.hidden_size, "vocab": spec.vocab_size,
            "weights": manifest.weight_format.value}
