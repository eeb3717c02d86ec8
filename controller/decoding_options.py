"""How `deskfleet generate` and `deskfleet chat` decode: drafting, K, sampling and the target's compile settings.

GenerateOptions (controller/run.py) and ChatOptions (controller/chat.py) extend DecodingOptions with what
only they have; both CLIs fill these fields from the same options (`decoding_arguments`). `non_negative_int`
and `positive_int` are the argparse types of the CLI's whole-number options.
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.arguments import path_argument, real_number, whole_number
from deskfleet.common.logits_adjust import MAX_BIAS, MAX_BIASED_TOKENS, MAX_PENALTY
from deskfleet.common.model_spec import ModelSpec
from deskfleet.common.speculative import MAX_K, SamplingParams

from .draft import Drafter, open_drafter, target_settings
from .engine import DEFAULT_PREFILL_CHUNK, EngineOptions
from .generation import GenerationError

DEFAULT_K_MAX = 8
# The largest temperature a step carries (the wire's SamplingInfo refuses more); checked here, by the option's
# name, so that a run is not refused at its first step after every stage compiled. At 100 the softmax of any
# usable model's logits is close to uniform already.
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, kw_only=True)
class DecodingOptions:
    draft: Path | None = None  # a draft model's export folder
    prompt_lookup: bool = False  # draft by copying from the context (with `draft`: lookup first)
    k: int | None = None  # a fixed number of draft tokens; None: adaptive up to k_max
    k_max: int | None = None  # adaptive K's upper bound as given; None: DEFAULT_K_MAX
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    # stream i (or reply i) samples with seed + i; None: not given, and one is drawn at random where it samples
    # (runs of the same prompt then differ, as a user who samples expects; the report says which was drawn)
    seed: int | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens a call at most; 0: whole prompts
    # the API's penalties, -2 to 2: off the logit of each token generated so far (times its count, for frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, what is added to its logit), as the API's logit_bias
    settings: CompileSettings = field(default_factory=CompileSettings)
    seed_drawn: bool = field(default=False, init=False, compare=False)  # `seed` was drawn, not given

    def __post_init__(self) -> None:
        """Refuse options that contradict each other, would be ignored or could only fail later, naming the
        CLI option."""
        drafts = self.draft is not None or self.prompt_lookup
        if self.k is not None and not 0 <= self.k <= MAX_K:
            raise ValueError(f"--k must be from 0 to {MAX_K}, got {self.k}")
        if self.k == 0 and drafts:
            raise ValueError("--k 0 drafts no tokens, so --draft/--prompt-lookup would never be used: "
                             "leave out --draft and --prompt-lookup, or give --k 1 or more")
        # --k 0 alone asks for what plain decoding does (no draft tokens); any other K would be ignored.
        if self.k and not drafts:
            raise ValueError(f"--k needs --draft or --prompt-lookup: --k {self.k} sets how many tokens a draft "
                             "proposes, and without them nothing drafts")
        if self.k_max is not None:
            if not 1 <= self.k_max <= MAX_K:
                raise ValueError(f"--k-max must be from 1 to {MAX_K}, got {self.k_max}")
            if not drafts:
                raise ValueError(f"--k-max needs --draft or --prompt-lookup: --k-max {self.k_max} bounds how many "
                                 "tokens a draft proposes, and without them nothing drafts")
            if self.k is not None:
                raise ValueError("--k and --k-max together: --k fixes K, so --k-max would never be used")
        # SamplingParams refuses these too, but by its field names (top_p) and only once the run has begun;
        # NaN passes its `temperature < 0`.
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails this too
            raise ValueError(f"--temperature must be from 0 (greedy) to {MAX_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be more than 0 and at most 1 (1: off), got {self.top_p}")
        if self.temperature == 0 and (self.top_k or self.top_p != 1):  # ignored, the user would think they sample
            given = " and ".join(option for option, on in (("--top-k", self.top_k), ("--top-p", self.top_p != 1)) if on)
            verb = "act" if " and " in given else "acts"
            raise ValueError(f"{given} {verb} only with a --temperature above 0: the default, 0, is greedy decoding "
                             "(the most likely token every time), which they would not change")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"--seed must be 0 or more, got {self.seed}")
        if self.temperature == 0 and self.seed is not None:
            raise ValueError("--seed acts only with a --temperature above 0: the default, 0, is greedy decoding, "
                             "which draws nothing")
        if self.temperature > 0 and self.seed is None:
            object.__setattr__(self, "seed", random_seed())
            object.__setattr__(self, "seed_drawn", True)
        if self.prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk must be 0 (whole prompts) or more, got {self.prefill_chunk}")
        for option, value in (("--presence-penalty", self.presence_penalty),
                              ("--frequency-penalty", self.frequency_penalty)):
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails this too
                raise ValueError(f"{option} must be from {-MAX_PENALTY:g} to {MAX_PENALTY:g}, got {value}")
        if len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise ValueError(f"--logit-bias takes at most {MAX_BIASED_TOKENS} tokens, got {len(self.logit_bias)}")
        biased = [token for token, _ in self.logit_bias]
        if len(set(biased)) != len(biased):
            repeated = sorted({token for token in biased if biased.count(token) > 1})
            raise ValueError(f"--logit-bias gives token {repeated[0]} more than once: give each token one bias")

    def check_model(self, spec: ModelSpec) -> None:
        """What the options ask of the model it runs: a --logit-bias token outside its vocabulary is refused before
        anything compiles (chat refused every message instead, and exited 0)."""
        outside = [token for token, _ in self.logit_bias if token >= spec.vocab_size]
        if outside:
            raise GenerationError(f"--logit-bias token {outside[0]} is outside the model's vocabulary (ids 0 to "
                                  f"{spec.vocab_size - 1})")

    @property
    def base_seed(self) -> int:
        """The seed stream (or reply) 0 samples with: the one given or drawn; 0 where nothing samples."""
        return self.seed or 0

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def target_settings(self) -> CompileSettings:
        """The settings to compile the target (and the draft model) with: those for drafting when it drafts."""
        return target_settings(self.settings, self.draft, self.prompt_lookup)

    def open_drafter(self, settings: CompileSettings, target: Path | None = None,
                     over_fleet: bool = False) -> Drafter | None:
        """The drafter asked for; with `target` (its export folder), a draft model that cannot draft for it is
        refused before it compiles; `over_fleet`: the target runs on a chain of PCs."""
        return open_drafter(self.draft, self.prompt_lookup, settings, target, over_fleet=over_fleet)

    def engine_options(self, micro_batches: int, **more: Any) -> EngineOptions:
        k_max = self.k_max if self.k_max is not None else DEFAULT_K_MAX
        return EngineOptions(micro_batches=micro_batches, k_max=k_max, fixed_k=self.k,
                             prefill_chunk=self.prefill_chunk, **more)


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """generate's and chat's: drafting, sampling and the prefill chunk."""
    add_drafting_options(parser)
    parser.add_argument("--temperature", type=real_number, default=0.0,
                        help=f"0 = greedy (the default); above 0 samples, at most {MAX_TEMPERATURE:g}")
    parser.add_argument("--top-k", type=whole_number, default=0,
                        help="sample among the K likeliest tokens only (default 0: all); needs --temperature")
    parser.add_argument("--top-p", type=real_number, default=1.0,
                        help="sample among the likeliest tokens whose probabilities add up to P, in (0, 1] (default "
                             "1: all); needs --temperature")
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help="stream (or reply) i samples with seed + i (default: one drawn at random, which "
                             "--json reports)")
    parser.add_argument("--presence-penalty", type=real_number, default=0.0, metavar="P",
                        help=f"take P off the logit of every token the reply has generated so far (-{MAX_PENALTY:g} "
                             f"to {MAX_PENALTY:g}, default 0), as the OpenAI API's presence_penalty")
    parser.add_argument("--frequency-penalty", type=real_number, default=0.0, metavar="F",
                        help="take F times its count off the logit of every token the reply has generated so far "
                             f"(-{MAX_PENALTY:g} to {MAX_PENALTY:g}, default 0), as the API's frequency_penalty")
    parser.add_argument("--logit-bias", type=logit_bias_entry, action="append", default=None, metavar="TOKEN=BIAS",
                        help=f"add BIAS ({-MAX_BIAS:g} to {MAX_BIAS:g}) to token id TOKEN's logit before it is picked "
                             f"or sampled, as the API's logit_bias (repeat it, at most {MAX_BIASED_TOKENS} tokens; "
                             "-100 bans a token, 100 all but forces it)")
    add_prefill_option(parser)


def logit_bias_entry(text: str) -> tuple[int, float]:
    """argparse type: `TOKEN=BIAS`, a token id and a bias of -MAX_BIAS to MAX_BIAS (the vocabulary is checked once the
    model is known)."""
    token, equals, bias = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS (a token id, then what to add to its logit), got "
                                         f"{text!r}")
    try:
        token_id, value = int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS with a whole token id and a number, got {text!r}") \
            from None
    if token_id < 0:
        raise argparse.ArgumentTypeError(f"a token id is 0 or more, got {token_id}")
    if not -MAX_BIAS <= value <= MAX_BIAS:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"a bias must be from {-MAX_BIAS:g} to {MAX_BIAS:g}, got {bias}")
    return token_id, value


def add_drafting_options(parser: argparse.ArgumentParser) -> None:
    """--draft, --prompt-lookup and --k / --k-max (`serve` takes these without the sampling options: its requests
    say how they sample)."""
    parser.add_argument("--draft", type=path_argument, default=None,
                        help="export folder of a draft model (speculative)")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="speculative with drafts copied from the context; alone: no draft model; with "
                             "--draft: copied tokens where the context repeats itself, the draft model elsewhere. "
                             "Like --draft, greedy output equals plain decoding in --precision f32")
    k = parser.add_mutually_exclusive_group()
    k.add_argument("--k", type=draft_count(0), default=None,
                   help=f"fixed number of draft tokens, at most {MAX_K} (default: adaptive)")
    # No default here: DecodingOptions refuses a --k-max given without a drafter, which it could not tell
    # from a default of 8.
    k.add_argument("--k-max", type=draft_count(1), default=None,
                   help=f"upper bound of adaptive K, at most {MAX_K} (default {DEFAULT_K_MAX})")


def add_prefill_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-chunk", type=non_negative_int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                        help="while other streams run, feed a prompt N tokens a call, between their steps, so a "
                             "long prompt does not stall them for its whole length (default "
                             f"{DEFAULT_PREFILL_CHUNK}; 0: each prompt in one call)")


def compile_settings(args: argparse.Namespace) -> CompileSettings:
    """The target's compile settings from the CLI's --device, --precision, --threads and --kv-cache."""
    from deskfleet.agent.stage import Precision

    return CompileSettings(device=args.device, precision=Precision(args.precision), num_threads=args.threads,
                           kv_cache=args.kv_cache)


def decoding_arguments(args: argparse.Namespace, settings: CompileSettings) -> dict[str, Any]:
    """DecodingOptions' fields from what `add_decoding_options` parsed, and the compile settings."""
    return {"draft": args.draft, "prompt_lookup": args.prompt_lookup, "k": args.k, "k_max": args.k_max,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "prefill_chunk": args.prefill_chunk, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "logit_bias": tuple(args.logit_bias or ()),
            "settings": settings}


def random_seed() -> int:
    """A seed for a run that samples without --seed: any of the 2**31 a --seed can also give."""
    return secrets.randbelow(2**31)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number, 0 or more."""
    return _whole_number(text, minimum=0)


def positive_int(text: str) -> int:
    """argparse type: a whole number, 1 or more."""
    return _whole_number(text, minimum=1)


def count_up_to(maximum: int) -> Callable[[str], int]:
    """argparse type: a whole number from 1 to `maximum`."""
    def parse(text: str) -> int:
        return _whole_number(text, 1, maximum)

    return parse


def draft_count(minimum: int) -> Callable[[str], int]:
    """argparse type: a number of draft tokens a round, from `minimum` to MAX_K."""
    def parse(text: str) -> int:
        return _whole_number(text, minimum, maximum=MAX_K)
    return parse


MAX_THREADS = 1024  # OpenVINO's INFERENCE_NUM_THREADS takes an int32; past this it is a typo, not a CPU


def thread_count(text: str) -> int:
    """argparse type: inference threads, 1 to MAX_THREADS (OpenVINO named a value past int32 "not a non negative
    integer", not the option)."""
    return _whole_number(text, 1, maximum=MAX_THREADS)


def parse_token_ids(text: str) -> list[int]:
    """--prompt-ids' value: comma-separated token ids (spaces around them allowed); an empty value is an empty
    prompt (refused later, as such). ValueError for an empty item: "1,,2" was read as 1,2, a typo's id lost."""
    if not text.strip():
        return []
    try:
        if not text.isascii():  # int() takes other scripts' digits ("１,２"): ids typed so are not what was meant
            raise ValueError
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def byte_count(text: str) -> int:
    """argparse type: a number of bytes, 0 or more, as a whole number or in float notation (4e9)."""
    try:
        value = real_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}") from None
    if not 0 <= value < 2**62:  # NaN and infinities fail this too
        raise argparse.ArgumentTypeError(f"must be a number of bytes from 0 to 2**62, got {text}")
    return int(value)


def _whole_number(text: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
    return value
