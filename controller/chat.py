"""`deskfleet generate --fleet` and `deskfleet chat [--fleet]`: the engine over the deployed chain or locally.

generate --fleet takes the same options as local generate (several prompts as concurrent streams,
--draft with the draft on this controller, --k, sampling); only the chain differs: the stages of the
last `deskfleet fleet deploy` of the model instead of an in-process pipeline.

chat is a terminal conversation: each line read is a user turn; the whole conversation goes through the
model's chat template (controller/tokenizer.py) and the reply streams to the output as it is decoded.
`/reset` forgets the conversation, `/quit` (or end of input) leaves. A conversation that outgrows the
model's context loses its oldest exchanges (the system prompt stays); a message too long to answer even
alone is refused and the conversation kept.

Each reply leaves its KV state on the chain (the engine's keep_kv), and the next turn resumes it: the new
prompt repeats the conversation so far, so only what follows the prefix the two share (the reply as the
template writes it back, and the new message) is fed, not the whole conversation again. Over the fleet a
state older than half the agents' idle limit is not resumed (the agents may have freed it).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.arguments import FAILOVER_BROWSE_S, browse_seconds, path_argument
from deskfleet.common.console import print_whole
from deskfleet.common.model_spec import Manifest, load_manifest
from deskfleet.common.speculative import AdaptiveK
from deskfleet.common.wire import MICRO_BATCH_IDLE_S

from .bench.interruption import BenchTerminated, say_stopped, signal_name, signals_unwind
from .decoding_options import (
    DecodingOptions,
    add_decoding_options,
    compile_settings,
    decoding_arguments,
    non_negative_int,
    positive_int,
)
from .engine import Engine, KeptKV, StageChain, StreamRequest
from .generation import GenerationError, check_tokenized
from .run import GenerateOptions, GenerationInterrupted, GenerationStopped, run_generate
from .terminal_lines import PROMPT, TerminalLines, terminal_lines

if TYPE_CHECKING:
    # .tokenizer and .text_printer are imported where used: the tokenizers package comes with the controller
    # extra only, and `deskfleet --help` (which builds the chat command's parser here) must work without it.
    from deskfleet.common.stop_signal import StopSignal

    from .fleet_failover import FleetFailover
    from .fleet_pipeline import FleetPipeline
    from .fleet_store import FleetStore
    from .pipeline import LocalPipeline
    from .tokenizer import ChatMessage, ModelTokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_FAILOVERS = 2  # re-plans per run when a PC of the fleet drops out
# A reply's KV state kept on the fleet is resumed by the next turn only within this: the agents free a micro-batch
# idle for MICRO_BATCH_IDLE_S, and a step on a freed one fails (the failover then feeds the turn whole).
FLEET_KEPT_KV_S = MICRO_BATCH_IDLE_S / 2


@dataclass(frozen=True)
class ChatOptions(DecodingOptions):
    model: Path
    fleet_dir: Path | None = None  # the controller data dir: chat over the deployed chain; None: local
    max_failovers: int = DEFAULT_MAX_FAILOVERS  # fleet only: re-plans when a PC drops out mid-reply
    discover_seconds: float | None = None  # fleet only: a re-plan's mDNS browse (None: FAILOVER_BROWSE_S)
    stages: int = 1  # local only
    system: str | None = None
    max_new_tokens: int = 256
    reuse_kv: bool = True  # resume the KV state the last reply left; False: feed the whole conversation each turn

    def __post_init__(self) -> None:
        super().__post_init__()
        # `--system "$SYSTEM"` with SYSTEM unset ran the chat without one, as if no --system had been given
        if self.system is not None and not self.system.strip():
            raise ValueError("--system is empty or blank (an unset variable?): give the system prompt, or leave out "
                             "--system for none")


class InputGone(Exception):
    """The chat's messages could no longer be read (its terminal closed under it)."""


@dataclass(frozen=True)
class ReplyStats:
    """One turn, as run_chat's on_reply hears it."""

    prompt_tokens: int  # the whole conversation, as the template renders it
    reused_tokens: int  # of those, already in the KV state the last reply left (not fed again)
    reply_tokens: int
    render_s: float  # from the message read to the engine's start: the template's rendering, the prompt fitted
    first_token_s: float  # from the engine's start to the reply's first token (what is fed of the prompt, and more)
    wall_s: float  # the whole turn


# Public functions

def add_chat_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
                     add_compile_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """`deskfleet chat`; `add_compile_options(parser)` adds the CLI's shared --precision/--device/--threads."""
    chat = subparsers.add_parser(
        "chat", help="a terminal chat with streaming output (local or --fleet)",
        description="A terminal chat with streaming output (local or --fleet). Type a message a line; each reply "
                    "streams as it is made. /reset forgets the conversation, /quit or /exit (or the end of the input, "
                    "Ctrl-D) leaves; Ctrl-C during a reply stops that reply only. Messages can be piped in, one a "
                    "line.")
    chat.add_argument("--model", type=path_argument, required=True, help="export folder (with its tokenizer)")
    add_fleet_option(chat)
    # None: not given (1), which --fleet needs to tell: there its deployment decides the stages.
    chat.add_argument("--stages", type=positive_int, default=None,
                      help="in-process pipeline stages (default 1; local only)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-new-tokens", "--new-tokens", dest="max_new_tokens", type=positive_int, default=256,
                      help="a reply's limit (default 256; --new-tokens too)")
    chat.add_argument("--json", action="store_true",
                      help="one JSON object per line a message gets (its reply, or why it was not sent) on stdout, "
                           "for scripts: replies of several lines cannot be told apart in plain text")
    chat.add_argument("--no-reuse-kv", dest="reuse_kv", action="store_false",
                      help="feed the whole conversation every turn instead of resuming the KV state the last reply "
                           "left on the stages (for comparison)")
    add_decoding_options(chat)
    add_compile_options(chat)
    chat.set_defaults(handler=_chat_command, extras=("controller",))


def add_fleet_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", action="store_true",
                        help="run on the fleet's deployed chain (`deskfleet fleet deploy --model` first)")
    parser.add_argument("--data-dir", type=path_argument, default=None,
                        help="controller data dir for --fleet (default: $DESKFLEET_CONTROLLER_DIR or the platform's)")
    # None: not given (DEFAULT_MAX_FAILOVERS), which check_fleet_options needs to tell without --fleet.
    parser.add_argument("--max-failovers", type=non_negative_int, default=None,
                        help="--fleet: when a PC drops out mid-generation, re-plan over the others and resume, "
                             f"at most this many times per run (0: fail at once; default {DEFAULT_MAX_FAILOVERS})")
    # None: not given (FAILOVER_BROWSE_S), likewise
    parser.add_argument("--discover-seconds", type=browse_seconds, default=None,
                        help="--fleet: how long a re-plan browses mDNS for the PCs left (0: none, where multicast "
                             f"is unwanted: registrations and the deployment's addresses only; default "
                             f"{FAILOVER_BROWSE_S:g})")


def check_fleet_options(args: argparse.Namespace) -> None:
    """Refuse (ValueError), naming it, an option of generate or chat that the run would ignore: --stages with
    --fleet (the deployment decides the stages), the compile options with --fleet but no --draft (they compile
    only a draft model here), --data-dir, --max-failovers and --discover-seconds without --fleet."""
    if args.fleet:
        if args.stages is not None:
            raise ValueError(f"--stages {args.stages} with --fleet: the fleet's deployed plan decides the stages "
                             "(`deskfleet fleet deploy`); leave out --stages")
        compiled_here = sorted(option for option in getattr(args, "given", ())
                               if option in ("--precision", "--kv-cache", "--device", "--threads"))
        if compiled_here and args.draft is None:  # they compile only a draft model, on this PC
            deployed = [option for option in compiled_here if option != "--threads"]
            how = ", ".join(
                ([f"as the model was deployed (`deskfleet fleet deploy {' '.join(deployed)}`)"] if deployed else [])
                + (["each with its device's own thread count"] if "--threads" in compiled_here else []))
            raise ValueError(f"{', '.join(compiled_here)} with --fleet and no --draft: the PCs compile their stages "
                             f"{how}; leave {'it' if len(compiled_here) == 1 else 'them'} out")
        return
    for name, option in (("data_dir", "--data-dir"), ("max_failovers", "--max-failovers"),
                         ("discover_seconds", "--discover-seconds")):
        if getattr(args, name) is not None:
            raise ValueError(f"{option} without --fleet: it applies to runs on the fleet only; give --fleet or "
                             f"leave out {option}")


def fleet_max_failovers(args: argparse.Namespace) -> int:
    """add_fleet_option's --max-failovers, or its default when not given."""
    return DEFAULT_MAX_FAILOVERS if args.max_failovers is None else int(args.max_failovers)


def generate_on_fleet(options: GenerateOptions, data_dir: Path | None, stream_text: bool = False,
                      max_failovers: int = DEFAULT_MAX_FAILOVERS, discover_seconds: float | None = None,
                      peers: tuple[str, ...] = ()) -> dict[str, object]:
    """`deskfleet generate --fleet`: run_generate over the deployed chain of `options.model`, re-planned
    (at most `max_failovers` times, each browsing mDNS for `discover_seconds` and dialling `peers` too) when a
    PC drops out."""
    store = controller_store(data_dir)
    with open_fleet_chain(store, options.model, max_failovers, discover_seconds, peers,
                           drafting=options.draft is not None or options.prompt_lookup) as (chain, failover):
        try:
            report = run_generate(options, stream_text, chain=chain, chain_stages=chain.num_stages, recover=failover)
        except (GenerationStopped, GenerationInterrupted) as stopped:  # the runs whose re-plans matter most
            stopped.report.update({"fleet": True, "replans": failover.replans, "rejoined": failover.rejoined})
            raise
    report["fleet"] = True
    report["replans"] = failover.replans
    report["rejoined"] = failover.rejoined
    return report


def run_chat(options: ChatOptions, lines: TextIO | TerminalLines, out: TextIO, prompt_out: TextIO | None = None,
             notes: TextIO | None = None, on_reply: Callable[[ReplyStats], None] | None = None,
             chain: StageChain | None = None, as_json: bool = False, ctrl_c_ends_chat: bool = False) -> int:
    """Converse until `lines` ends or says /quit; returns the number of replies given. `prompt_out` shows the
    `you> ` prompt, where `lines` (a TerminalLines) does not show it itself.

    `as_json`: instead of streaming each reply's text, write one JSON object a line for every message sent:
    {"reply", "stopped" ("end", "max_new_tokens" or "interrupted"), "reply_tokens", "prompt_tokens",
    "reused_tokens", "seconds", "failovers", and over the fleet "replans": the re-plans since the reply before,
    the chain's opening's among the first reply's, and in the first reply "rejoined" where the chain's opening
    re-planned for PCs that were back (FleetFailover.rejoin)}, or {"error"} for a message that was not sent.

    Raises before reading a line when no message could ever fit the model's context (--max-new-tokens,
    --system). A conversation that outgrows the context loses its oldest exchanges (the system turn stays);
    a message that cannot be sent is refused and the conversation kept. Those notes go to `notes` (stderr).
    `on_reply` hears each finished reply's figures (benchmarks). `chain`: run on this chain (the caller's, left
    open) instead of opening the fleet's or local stages from `options`; nothing re-plans when it breaks.
    `ctrl_c_ends_chat`: a Ctrl-C anywhere raises KeyboardInterrupt (a scripted conversation being timed, as
    `bench chat` runs, stops); by default it stops the reply or cancels the message at hand, and the chat goes on.
    """
    from .chat_template import TemplateRenderer
    from .tokenizer import ModelTokenizer

    manifest = load_manifest(options.model)
    tokenizer = ModelTokenizer(options.model)
    tokenizer.require_chat_template(f"{options.model} has no chat template, so it cannot chat: use "
                                    "`deskfleet generate --prompt TEXT` with it instead")
    with TemplateRenderer() as renderer:  # one child renders every turn
        tokenizer.renderer = renderer
        return _converse(options, tokenizer, manifest, lines, out, prompt_out, notes, on_reply, chain, as_json,
                         ctrl_c_ends_chat)


def check_room(tokenizer: ModelTokenizer, system: list[ChatMessage], max_new_tokens: int, max_context: int,
               option: str = "--max-new-tokens") -> None:
    """Raise GenerationError, naming `option` (the reply's length, as the command calls it), when not even a
    one-token message could get a reply."""
    from .tokenizer import ChatMessage, ChatTemplateError, check_utf8

    if max_new_tokens < 1:
        raise GenerationError(f"{option} must be at least 1, got {max_new_tokens}")
    if system:
        check_utf8(system[0].content, "--system")
    try:
        template = len(tokenizer.encode_chat([*system, ChatMessage("user", "")]))  # the template's own tokens
    except ChatTemplateError as error:
        if not system:
            raise
        try:  # the first turns do not even render: a template refusing --system ("roles must alternate")?
            tokenizer.render_chat([ChatMessage("user", "")])
        except ChatTemplateError:
            raise error from None
        raise ChatTemplateError(f"{error} (it takes the conversation without --system: this template takes no "
                                "system turn; leave out --system, or put it in your first message)") from None
    if template + 1 + max_new_tokens <= max_context:
        return
    largest = max_context - template - 1  # the reply length that leaves room for a one-token message
    if system:
        excess = template + 1 + max_new_tokens - max_context  # what --system must lose to keep the reply length
        remedy = f"shorten --system by at least {excess} tokens" + (
            f", or give {option} {largest} or less" if largest >= 1 else "")
        raise GenerationError(
            f"--system takes {template} tokens with the chat template; with {option} {max_new_tokens} "
            f"that leaves no room for a message in the model's context of {max_context} tokens ({remedy})")
    remedy = (f"give {option} {largest} or less" if largest >= 1 else
              "the template alone leaves no room for a reply: export with a larger --max-context")
    raise GenerationError(
        f"{option} {max_new_tokens} and the chat template's {template} tokens leave no room for a "
        f"message in the model's context of {max_context} tokens ({remedy})")


def _converse(options: ChatOptions, tokenizer: ModelTokenizer, manifest: Manifest, lines: TextIO | TerminalLines,
              out: TextIO,
              prompt_out: TextIO | None, notes: TextIO | None, on_reply: Callable[[ReplyStats], None] | None,
              chain: StageChain | None, as_json: bool, ctrl_c_ends_chat: bool) -> int:
    """run_chat's conversation, once the tokenizer renders in a child kept for the chat."""
    from .chat_template import MAX_RENDERED_CHARS
    from .fleet_failover import FailoverError
    from .text_printer import TextPrinter
    from .tokenizer import ChatMessage, ChatTemplateError, NotUtf8Error, check_utf8

    system = [ChatMessage("system", options.system)] if options.system else []
    check_room(tokenizer, system, options.max_new_tokens, manifest.spec.max_context)
    options.check_model(manifest.spec)
    end_of_turn = tokenizer.end_of_turn_ids()  # a reply ends there, whatever the generation config lists
    settings = options.target_settings()
    # a draft that cannot draft for the target is refused now, before anything compiles
    draft = options.open_drafter(settings, options.model, over_fleet=options.fleet_dir is not None)
    sampling = options.sampling()
    turns: list[ChatMessage] = []  # user and assistant messages, alternating
    replies = 0
    kept = _KeptReply(options.fleet_dir is not None)
    learned_k: AdaptiveK | None = None  # adaptive K goes on from turn to turn (the same drafter and chain)
    opened = _without_failover(chain) if chain is not None else _open_chain(options, settings)
    # between replies, a PC a re-plan left out that has called in since is taken back, as the chat's start does
    take_back = _take_back_look(options) if chain is None else None
    with ExitStack() as chain_held, kept:
        chain, failover = chain_held.enter_context(opened)
        replans_told = 0  # of failover.replans, those a reply's JSON gave (a re-plan as the chain opened: the first)
        rejoined_told = False  # whether a reply's JSON gave what the chain's opening rejoined (the first reply's)
        closed = False  # the chain was closed to take a PC back, and is not open again yet
        micro_batches = getattr(chain, "num_stages", 1)
        engine_options = options.engine_options(micro_batches)
        if options.seed_drawn:  # the replies can be had again only with the seed: say it where a person reads
            _note(notes, f"[sampling with seed {options.seed}, drawn at random: --seed {options.seed} gives these "
                         "replies again]")
        while True:
            if prompt_out is not None and not isinstance(lines, TerminalLines):
                prompt_out.write(PROMPT)
                prompt_out.flush()
            try:
                line = lines.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt leaves the chat
                _end_prompt_line(prompt_out)
                raise
            except OSError as error:  # EIO: the terminal went away (a closed window or SSH session, no SIGHUP)
                with suppress(OSError):  # the prompt's line may be on that terminal too
                    _end_prompt_line(prompt_out)
                raise InputGone(f"standard input could not be read ({error.strerror or error}): the terminal or pipe "
                                "the messages came from is gone; the chat ended there") from error
            if not line.endswith("\n"):  # Ctrl-D: the cursor stayed on the prompt's line
                with suppress(OSError):  # readline reads a terminal that went away (EIO) as the end of input
                    _end_prompt_line(prompt_out)
            # a file saved by a Windows editor starts with a BOM, as --prompts-file may, and two joined by `cat a b`
            # have one at the start of a later line too
            line = line.removeprefix("\ufeff")
            if not line or line.strip().replace("\0", "") in ("/quit", "/exit"):  # UTF-16's "/quit" too
                break
            # the message as typed but for its line ending: a pasted line of code keeps its indentation (it was
            # stripped, "    return x" sent as "return x"); blank lines and commands are told apart by what is left
            text = line.rstrip("\r\n")
            command = text.strip()
            if not command:
                continue
            if command == "/reset":
                turns = []
                continue
            if re.fullmatch(r"/[A-Za-z]+", command):  # a mistyped command (/rest) would go to the model as a message
                unknown = f"{command} is no command (/reset, /quit, /exit): not sent; the conversation is unchanged"
                _note(notes, f"[{unknown}]")
                _write_json(out, as_json, {"error": unknown})
                continue
            message = ChatMessage("user", text)
            if not closed and take_back is not None and _looked(take_back):
                kept.hold(None)  # the last reply's KV state is on the chain that closes
                chain_held.close()
                closed = True  # the chain opens again now: its opening re-plans to take the PC back
            if closed:
                try:
                    chain, failover = chain_held.enter_context(_open_chain(options, settings))
                except KeyboardInterrupt as stopping:
                    if isinstance(stopping, BenchTerminated) or ctrl_c_ends_chat:
                        raise
                    _end_prompt_line(prompt_out)
                    unsent = "interrupted while the chain opened again: not sent; the conversation is unchanged"
                    _note(notes, f"[{unsent}]")
                    _write_json(out, as_json, {"error": unsent})
                    continue
                except Exception as error:  # a chain that worked was closed for the PC back: the chat goes on
                    unsent = (f"the chain could not be opened again ({error}): not sent; the conversation is "
                              "unchanged, and the next message tries again")
                    _note(notes, f"[{unsent}]")
                    _write_json(out, as_json, {"error": unsent})
                    continue
                closed = False
                replans_told, rejoined_told, learned_k = 0, False, None
                micro_batches = getattr(chain, "num_stages", 1)
                engine_options = options.engine_options(micro_batches)
            try:
                check_utf8(text, "this message")
                if len(text) > MAX_RENDERED_CHARS:  # the render's cap, said of the message, not of the template file
                    raise GenerationError(f"this message is {len(text):,} characters, more than the "
                                          f"{MAX_RENDERED_CHARS:,} a chat template may render")
                if "\0" in text:  # UTF-16 input read as UTF-8: a NUL between every character, sent as such
                    raise NotUtf8Error("this message holds NUL characters (UTF-16 input?): send UTF-8 text")
                started = time.perf_counter()
                prompt, dropped = _fit_prompt(tokenizer, system, turns, message, options.max_new_tokens,
                                               manifest.spec.max_context)
                check_tokenized(manifest.spec, prompt)
                resume = kept.resumable(chain)
                if resume is None:  # a kept state's id must stay valid: fresh ids only when none is resumed
                    renumber = getattr(chain, "renumber", None)
                    if callable(renumber):
                        renumber()
                engine = Engine(chain, manifest.spec, draft, engine_options, learned_k)
                engine.add(StreamRequest(prompt, options.max_new_tokens, sampling=sampling,
                                         seed=options.base_seed + replies, stop_token_ids=end_of_turn,
                                         keep_kv=options.reuse_kv, resume=resume,
                                         presence_penalty=options.presence_penalty,
                                         frequency_penalty=options.frequency_penalty,
                                         logit_bias=options.logit_bias))
            except (GenerationError, NotUtf8Error, ChatTemplateError) as error:
                # ChatTemplateError: the template refused this conversation (its raise_exception) or rendered
                # it too long; the conversation before this message may still be fine to go on with.
                _note(notes, f"[{error}: not sent; the conversation is unchanged]")
                _write_json(out, as_json, {"error": f"{error}: not sent; the conversation is unchanged"})
                continue
            except KeyboardInterrupt as stopping:  # Ctrl-C while the prompt was made (a long render): this one only
                if isinstance(stopping, BenchTerminated):  # SIGTERM / SIGHUP: the chat ends, said to a script
                    _write_json(out, as_json, {"error": f"stopped by {signal_name(stopping)} before the reply began: "
                                                        "not sent"})
                    raise
                if ctrl_c_ends_chat:
                    raise
                _end_prompt_line(prompt_out)  # the terminal's ^C echo; a reply's Ctrl-C ends its own line
                _note(notes, "[interrupted before the reply began: not sent; the conversation is unchanged]")
                _write_json(out, as_json, {"error": "interrupted before the reply began: not sent; the conversation "
                                                    "is unchanged"})
                continue
            # as JSON, the text is gathered and written whole, unchanged, with the reply's figures
            printer = TextPrinter(tokenizer, io.StringIO(), show_controls=False) if as_json \
                else TextPrinter(tokenizer, out)
            on_token: Callable[[int, int], None] = printer.push
            if dropped:  # said as the reply begins: a Ctrl-C before it cancels the message, and drops nothing
                exchanges = "exchange" if dropped == 2 else f"{dropped // 2} exchanges"
                on_token = _first_saying(printer.push, functools.partial(
                    _note, notes, f"[the conversation outgrew the model's context of {manifest.spec.max_context} "
                                  f"tokens: dropped its oldest {exchanges}]"))
            interrupted = False
            ending: BenchTerminated | None = None  # SIGTERM / SIGHUP: the chat ends once this reply is written out
            try:
                if failover is not None:
                    failover.start_run()
                run_started = time.perf_counter()
                engine.run(on_token=on_token, recover=failover)
            except KeyboardInterrupt as stopping:  # Ctrl-C stops this reply (its batches freed), not the chat
                if ctrl_c_ends_chat and not isinstance(stopping, BenchTerminated):
                    raise
                interrupted = True
                ending = stopping if isinstance(stopping, BenchTerminated) else None
            except FailoverError as error:
                # the chain broke past what re-planning mends (PCs gone, --max-failovers spent): this reply fails, not
                # the chat (it ended with a usage error's status 2, the reply's JSON line unwritten)
                kept.hold(None)
                with suppress(OSError, ValueError):
                    printer.finish()
                    if not as_json:
                        out.write("\n")
                        out.flush()
                failed = (f"the reply failed: {error}; what it made is dropped and the conversation is unchanged; the "
                          "next message opens the chain again, re-planning over the PCs that answer where "
                          "--max-failovers allows (with 0, only once the lost PCs are back)")
                _note(notes, f"[{failed}]")
                _write_json(out, as_json, {"error": failed, "reply": printer.text, "failovers": len(engine.failovers),
                                           **({"replans": failover.replans[replans_told:]} if failover is not None
                                              else {})})
                chain_held.close()  # the broken chain's links and stages go now
                closed = True
                continue
            if engine.failovers:
                chain = engine.chain  # the next turns run on the chain this one ended on
            # adaptive K goes on with the same drafter and chain; a failover's new chain has costs of its own
            learned_k = engine.k_policy if draft is not None and not engine.failovers else None
            kept.hold(engine.kept_kv(0))  # None when interrupted (the engine freed what it had taken)
            with suppress(*((OSError, ValueError) if ending is not None else ())):  # a hung-up terminal (SIGHUP)
                printer.finish()
            result = engine.results()[0]
            if interrupted and ending is None and not result.tokens:
                # no token of the reply came: the message is cancelled, as a Ctrl-C before the reply begins is (kept,
                # it went to the model with an empty reply and took its share of the context). Counted in tokens, not
                # in text shown, as the note of dropped exchanges is said at the first token (one that is part of a
                # character shows nothing yet: cancelled, the note would have been followed by "unchanged")
                if not as_json:
                    with suppress(OSError, ValueError):
                        out.write("\n")
                        out.flush()
                unsent = "interrupted before the reply began: not sent; the conversation is unchanged"
                _note(notes, f"[{unsent}]")
                _write_json(out, as_json, {"error": unsent})
                continue
            if as_json:
                stopped = "interrupted" if interrupted else "end" if result.stopped_by_eos else "max_new_tokens"
                _write_json(out, True, {"reply": printer.text, "stopped": stopped, "reply_tokens": len(result.tokens),
                                        "prompt_tokens": len(prompt), "reused_tokens": result.reused_tokens,
                                        "seconds": round(time.perf_counter() - started, 3),
                                        "failovers": len(engine.failovers), "dropped_exchanges": dropped // 2,
                                        **({"seed": options.base_seed + replies} if options.seed is not None else {}),
                                        **({"replans": failover.replans[replans_told:]} if failover is not None
                                           else {}),
                                        **({"rejoined": failover.rejoined} if failover is not None and not rejoined_told
                                           and failover.rejoined else {})})
                replans_told = len(failover.replans) if failover is not None else 0
                rejoined_told = True
            else:
                with suppress(OSError, ValueError):  # a terminal that hung up (SIGHUP) takes no more
                    out.write("\n")
                    out.flush()
            if ending is not None:
                raise ending
            if interrupted:
                _note(notes, "[interrupted: the reply so far stays in the conversation; Ctrl-C at the prompt leaves]")
            elif not result.stopped_by_eos:  # else the reply just stops mid-sentence, unexplained
                longer = ("the model's context leaves no room for a longer one"
                          if len(prompt) + options.max_new_tokens >= manifest.spec.max_context
                          else "a larger --max-new-tokens lets replies run longer")
                _note(notes, f"[the reply reached --max-new-tokens {options.max_new_tokens} and was cut there; "
                             f"{longer}]")
            # The reply as it was shown: a Ctrl-C can stop the engine between taking a token and showing it,
            # and a byte-fallback tokenizer decodes a reply cut inside a character with more U+FFFD than were
            # shown (the bytes of the run before it too); the conversation holds what the user saw.
            turns = [*turns[dropped:], message, ChatMessage("assistant", printer.text)]
            replies += 1
            if on_reply is not None:
                on_reply(ReplyStats(len(prompt), result.reused_tokens, len(result.tokens),
                                    run_started - started, result.first_token_s, time.perf_counter() - started))
    return replies


class _KeptReply:
    """The KV state the last reply left on the chain, until the next turn resumes it (or the chat ends: a context
    manager that releases it). Over the fleet a state older than FLEET_KEPT_KV_S is released, not resumed."""

    def __init__(self, fleet: bool) -> None:
        self.fleet = fleet
        self.kept: KeptKV | None = None
        self.since = 0.0

    def __enter__(self) -> _KeptReply:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.hold(None)

    def resumable(self, chain: StageChain) -> KeptKV | None:
        """The kept state when the next turn on `chain` may resume it; else None (a stale one is released)."""
        if self.kept is None:
            return None
        if self.kept.chain is chain and not (self.fleet and time.monotonic() - self.since > FLEET_KEPT_KV_S):
            return self.kept
        self.hold(None)
        return None

    def hold(self, kept: KeptKV | None) -> None:
        """Keep `kept` for the next turn, releasing the one held before: a no-op where the turn's engine took it
        (its run started), else (a Ctrl-C before that) the state is freed here."""
        if self.kept is not None and self.kept is not kept:
            self.kept.release()
        self.kept, self.since = kept, time.monotonic()


# Private functions

def _fit_prompt(tokenizer: ModelTokenizer, system: list[ChatMessage], turns: list[ChatMessage],
                message: ChatMessage, max_new_tokens: int, max_context: int) -> tuple[list[int], int]:
    """The prompt of the system turn, the latest `turns` and `message` that leaves room for a reply of
    `max_new_tokens` in `max_context`, and how many of the oldest turns it leaves out (whole exchanges: a
    user message and its reply). Raises GenerationError when `message` does not fit even alone.

    Each render call starts a child process (~50 ms, controller/chat_template.py), so the candidates go in
    at most two calls, not one per exchange dropped: first an even sample of about sqrt(n) of the n + 1
    (the whole conversation and the message alone among them), then every candidate between the sampled one
    that fits with the fewest exchanges dropped and the sampled one before it. A conversation takes fewer
    tokens the more exchanges it drops, so the prompt is the one with the fewest dropped that fits."""
    room = max_context - max_new_tokens
    drops = list(range(0, len(turns) + 1, 2))  # the last drops every exchange: the message alone
    sampled = sorted({*drops[::max(1, math.isqrt(len(drops)))], drops[-1]})
    rendered = _render(tokenizer, system, turns, message, sampled)
    alone = tokenizer.encode(rendered[drops[-1]], add_special_tokens=False)
    if len(alone) > room:
        # how much to cut, of the message: "makes a prompt of 1052 tokens" read as the message's own size where a
        # long --system prompt took most of it
        with_system = " with the --system prompt" if system else ""
        raise GenerationError(
            f"this message alone{with_system} makes a prompt of {len(alone)} tokens; with --max-new-tokens "
            f"{max_new_tokens} the model's context of {max_context} tokens leaves room for {room}: shorten it by "
            f"{len(alone) - room} token{'s' if len(alone) - room != 1 else ''} or more")
    found, prompt = drops[-1], alone
    for dropped in sampled[:-1]:  # encoded one by one: usually the whole conversation fits, the first
        candidate = tokenizer.encode(rendered[dropped], add_special_tokens=False)
        if len(candidate) <= room:
            found, prompt = dropped, candidate
            break
    position = sampled.index(found)
    between = [dropped for dropped in drops if position > 0 and sampled[position - 1] < dropped < found]
    if between:
        rendered = _render(tokenizer, system, turns, message, between)
        for dropped in between:
            candidate = tokenizer.encode(rendered[dropped], add_special_tokens=False)
            if len(candidate) <= room:
                return candidate, dropped
    return prompt, found


def _render(tokenizer: ModelTokenizer, system: list[ChatMessage], turns: list[ChatMessage], message: ChatMessage,
            drops: list[int]) -> dict[int, str]:
    """The conversation without its oldest `dropped` turns, for each of `drops`, rendered in one child."""
    texts = tokenizer.render_chats([[*system, *turns[dropped:], message] for dropped in drops])
    return dict(zip(drops, texts, strict=True))


def _end_prompt_line(prompt_out: TextIO | None) -> None:
    """End the line of `you> ` where the terminal did not (Ctrl-D, Ctrl-C), so what follows, the shell's
    prompt included, starts on a line of its own."""
    if prompt_out is not None:
        prompt_out.write("\n")
        prompt_out.flush()


def _write_json(out: TextIO, as_json: bool, body: dict[str, object]) -> None:
    """One line of `chat --json` (nothing without it), flushed: a script reads it before sending the next message."""
    if as_json:
        print_whole(json.dumps(body), file=out)


def _first_saying(push: Callable[[int, int], None], say: Callable[[], None]) -> Callable[[int, int], None]:
    """`push` (an engine's on_token), after `say` once, at the first token."""
    said = False

    def first_saying(stream_id: int, token: int) -> None:
        nonlocal said
        if not said:
            said = True
            say()
        push(stream_id, token)

    return first_saying


def _note(notes: TextIO | None, text: str) -> None:
    """A line on stderr; its text may quote the model folder's template (its raise_exception), so on a
    terminal its control characters are shown as escapes, not obeyed."""
    from .text_printer import is_terminal, visible_controls

    stream = notes or sys.stderr
    stream.write((visible_controls(text) if is_terminal(stream) else text) + "\n")
    stream.flush()


def controller_store(data_dir: Path | None) -> FleetStore:
    from .fleet_store import FleetStore, default_data_dir

    store = FleetStore(data_dir or default_data_dir())
    store.require_initialised()
    return store


@contextmanager
def open_fleet_chain(store: FleetStore, model: Path, max_failovers: int, discover_seconds: float | None = None,
                      peers: tuple[str, ...] = (), drafting: bool = False, stop: StopSignal | None = None
                      ) -> Iterator[tuple[FleetPipeline, FleetFailover]]:
    """The deployed chain of `model` and the failover that replaces it when a PC drops out, its re-plans browsing
    mDNS for `discover_seconds` (None: FAILOVER_BROWSE_S) and dialling `peers` too. A PC that is already gone
    when the chain opens counts as the first failover. `drafting`: the run will verify drafts (warned of when the
    deployment's KV cache makes that inexact, and again when a re-plan goes on on one that does). `stop` (a server's,
    set as it stops from another thread): the opening, its re-plans and its chains' steps give up with Stopped."""
    from .fleet_failover import FleetFailover
    from .fleet_pipeline import ChainError, FleetPipeline
    from .fleet_runs import driving
    from .fleet_survey import SurveyOptions
    from .own_network import shared_watch

    browse = FAILOVER_BROWSE_S if discover_seconds is None else discover_seconds
    with ExitStack() as stack:
        options = SurveyOptions(peers=peers, discover_seconds=browse)
        failover = stack.enter_context(FleetFailover(store, model, max_failovers, survey_options=options,
                                                     drafting=drafting, stop=stop, own_network=shared_watch()))
        failover.check_cache()
        if failover.model_id is not None:  # none: no export there, which opening the chain says
            # counted while the chain is open: a run's start does not re-plan under another's streams (rejoin)
            stack.enter_context(driving(store, failover.model_id))
        # a PC a run's re-plan left out that has called in since is taken back first (none: the deployed chain)
        rejoined = failover.rejoin()
        if rejoined is not None:
            yield rejoined, failover
            return
        try:
            chain = failover.opened = stack.enter_context(FleetPipeline.from_store(
                store, model, stop=stop, own_network=failover.own_network))
        except ChainError as error:
            if error.agent_id is None:
                raise  # not an agent's fault (e.g. never deployed): nothing to re-plan around
            chain = failover(error, opening=True)  # with --max-failovers 0 this gives up at once, naming the agent
        yield chain, failover


def _looked(take_back: Callable[[], bool]) -> bool:
    """What a take-back look says; False where it failed (a file being written): the next message looks again."""
    try:
        return take_back()
    except Exception:
        log.debug("the look for a PC to take back failed", exc_info=True)
        return False


def _take_back_look(options: ChatOptions) -> Callable[[], bool] | None:
    """The fleet chat's look for a PC to take back between replies (TakeBackLook); None for local stages, or a
    model that is no export (opening the chain says so)."""
    if options.fleet_dir is None:
        return None
    from deskfleet.common.model_spec import ManifestError

    from .fleet_failover import TakeBackLook

    try:
        return TakeBackLook(controller_store(options.fleet_dir), options.model)
    except (ManifestError, OSError):
        return None


def _open_chain(options: ChatOptions, settings: CompileSettings
                ) -> AbstractContextManager[tuple[StageChain, FleetFailover | None]]:
    """The fleet's chain, or local stages compiled with `settings` (the run's target settings)."""
    if options.fleet_dir is not None:
        return open_fleet_chain(controller_store(options.fleet_dir), options.model, options.max_failovers,
                                 options.discover_seconds,
                                 drafting=options.draft is not None or options.prompt_lookup)
    from .pipeline import LocalPipeline

    return _closing(LocalPipeline(options.model, options.stages, settings))


@contextmanager
def _closing(pipeline: LocalPipeline) -> Iterator[tuple[StageChain, None]]:
    with pipeline:
        yield pipeline, None


@contextmanager
def _without_failover(chain: StageChain) -> Iterator[tuple[StageChain, None]]:
    yield chain, None


def _chat_command(args: argparse.Namespace) -> int:
    from .fleet_store import default_data_dir

    check_fleet_options(args)
    if sys.stdin is None:  # started with standard input closed (`<&-`): Python has no stream to read from
        raise ValueError("standard input is closed, and chat reads its messages from it: run it in a terminal "
                         "or give it the messages on standard input (a pipe or a file)")
    options = ChatOptions(model=args.model, fleet_dir=(args.data_dir or default_data_dir()) if args.fleet else None,
                          max_failovers=fleet_max_failovers(args), discover_seconds=args.discover_seconds,
                          stages=args.stages or 1, system=args.system,
                          max_new_tokens=args.max_new_tokens, reuse_kv=args.reuse_kv,
                          **decoding_arguments(args, compile_settings(args)))
    if isinstance(sys.stdin, io.TextIOWrapper):  # a line that is not UTF-8 reaches run_chat, which refuses it alone
        # read as UTF-8 whatever the locale: under LC_ALL=C valid UTF-8 was refused as not UTF-8, and a Windows
        # code page read it as other characters, sent as such
        sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
    interactive = sys.stdin.isatty()
    lines: TextIO | TerminalLines = sys.stdin
    prompt_out = sys.stderr if interactive else None  # a terminal's prompt, kept out of redirected replies
    edited = terminal_lines(interactive, sys.stdout.isatty())
    if edited is not None:  # line editing and history: the prompt goes where input() shows it, the terminal
        lines, prompt_out = edited, sys.stdout
    try:
        # SIGTERM and SIGHUP (a closed terminal) end the chat as Ctrl-C at its prompt does: the reply under way
        # stopped, its micro-batches freed and the chain's links closed (they ended the process on the spot)
        with signals_unwind(ctrl_c=False):
            run_chat(options, lines, sys.stdout, prompt_out=prompt_out, as_json=args.json)
    except BenchTerminated as stopped:
        say_stopped(f"deskfleet: chat stopped by {signal_name(stopped)}")
        raise
    except InputGone as error:
        if args.verbose:
            raise
        print(f"deskfleet: error: {error}", file=sys.stderr)
        return 1
    return 0
