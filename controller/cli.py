"""`deskfleet`: the controller's command line. Parsing and dispatch only; the work lives in the modules."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from deskfleet.agent.allocator import run_on_jemalloc
from deskfleet.common.arguments import (
    KeepsDashDashValues,
    describe_commands,
    option_arity,
    path_argument,
    program_argument,
    prompts_file_argument,
    unknown_options,
    verbose_anywhere,
    whole_number,
)
from deskfleet.common.console import (
    WatchedStream,
    ctrl_c_held,
    flush_stdout,
    forgiving_stderr,
    open_missing_stderr,
    print_whole,
    silence_stdout,
    tolerate_unencodable,
    watched_stdout,
)
from deskfleet.common.launch import interruption, restore_default_signals
from deskfleet.common.logprobs import MAX_TOP_LOGPROBS
from deskfleet.common.model_spec import MAX_SPEC_VALUE, ManifestError, WeightFormat
from deskfleet.common.os_error_text import os_error_text
from deskfleet.common.wire_messages import KV_CACHE_PRECISIONS
from deskfleet.controller.bench.arguments import MAX_BENCH_USERS
from deskfleet.controller.bench.interruption import (
    BenchTerminated,
    exit_status,
    run_bench,
    say_stopped,
    signal_name,
    signals_unwind,
)
from deskfleet.controller.chat import add_chat_command, add_fleet_option, check_fleet_options, fleet_max_failovers
from deskfleet.controller.decoding_options import (
    MAX_THREADS,
    add_decoding_options,
    compile_settings,
    count_up_to,
    decoding_arguments,
    draft_count,
    non_negative_int,
    parse_token_ids,
    positive_int,
    thread_count,
)
from deskfleet.controller.fleet_cli import add_fleet_commands
from deskfleet.controller.serve_cli import add_serve_command
from deskfleet.controller.window_cli import add_window_command

if TYPE_CHECKING:
    from deskfleet.controller.run import GenerationInterrupted

log = logging.getLogger("deskfleet")

# The optional extras of pyproject.toml and the modules each brings (an agent-only `pip install .` has none):
# a command that needs one that is missing names the extra to install, not a ModuleNotFoundError's traceback.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "controller": ("tokenizers", "jinja2", "aiohttp"),
    "export": ("torch", "transformers", "safetensors", "nncf"),
}


class MissingExtraError(Exception):
    """A command needs an optional extra (pyproject.toml) that is not installed."""

    def __init__(self, extra: str, module: str) -> None:
        super().__init__(f'this command needs the {extra} extra: pip install "deskfleet[{extra}]" '
                         f"(the {module} package is not installed)")
        self.extra = extra
        self.module = module


# Errors whose message is the whole story for the user: printed without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ManifestError, FileNotFoundError, ValueError, RuntimeError,
                                                MissingExtraError)
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a program whose reader closed the pipe


# Public methods

def log_format(with_times: bool) -> str:
    """The log lines' format: a command that runs for days (`fleet serve`) starts each with the time, as agents do."""
    return ("%(asctime)s " if with_times else "") + "%(levelname)s %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> int:
    open_missing_stderr()
    tolerate_unencodable(sys.stdout, sys.stderr)  # a reply or a table on a Windows code page
    with forgiving_stderr(), watched_stdout() as stdout:
        return _main(argv, stdout)


ROUNDS_HELP = "timed rounds, each running every configuration once (after an untimed warm-up)"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that gives each option's default as "(default X)" where its text does not already say it (the benches:
    their many counts and lists are what a user reproducing a figure must match)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if not action.option_strings or action.nargs == 0 or "default" in text or default in (None, [], ()) \
                or default is argparse.SUPPRESS or text == argparse.SUPPRESS:  # nargs 0: a flag, on or off
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default {shown.replace('%', '%%')})".lstrip()


class CommandParser(KeepsDashDashValues):
    """The parser of `deskfleet` and, through add_subparsers, of each of its commands.

    Unlike argparse's own, it takes no abbreviation of an option (`--weight` is not `--weights`), and a
    command reports arguments it does not know itself, with its own usage, before any other error (argparse
    reports a missing required argument first, and unknown arguments only from the top-level parser).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # A command whose module needs an extra that is not installed: parsing it says so (exit 2).
        self.missing_extra: MissingExtraError | None = None
        self._parsing: list[str] | None = None  # the arguments being parsed, for error()
        self._relaxed = False  # parsing again with nothing required, to find the unknown arguments

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self.missing_extra is not None:
            self.exit(2, f"deskfleet: error: {self.missing_extra}\n")
        arguments = list(sys.argv[1:] if args is None else args)
        if not self._relaxed and (before := self._unknown_before_command(arguments)):
            self.error(_unrecognized(before))  # the command would say only that its own --model is missing
        outer, self._parsing = self._parsing, arguments
        try:
            parsed, unknown = super().parse_known_args(arguments, namespace)
        finally:
            self._parsing = outer
        if unknown and not self._relaxed:
            self.error(_unrecognized(unknown))
        return parsed, unknown

    def error(self, message: str) -> NoReturn:
        if self._relaxed:
            raise _NotParsed(message)
        if self._parsing is not None:
            unknown = self._unknown_arguments(self._parsing)
            if unknown:
                message = _unrecognized(unknown)
        super().error(message)

    def _unknown_before_command(self, arguments: list[str]) -> list[str]:
        """The options before the command's name (`deskfleet --verb generate`) that this parser does not know; none
        where it has no commands."""
        commands = next((action.choices for action in self._actions
                         if isinstance(action, argparse._SubParsersAction)), None)
        return unknown_options(arguments, option_arity(self), commands) if commands else []

    def _unknown_arguments(self, arguments: list[str]) -> list[str]:
        """The arguments among `arguments` that this parser does not know, found by parsing them again with
        nothing required; none where that parse fails too (the error at hand is then not a missing argument)."""
        required = [(action, action.required) for action in self._actions]
        groups = [(group, group.required) for group in self._mutually_exclusive_groups]
        self._relaxed = True
        try:
            for action, _ in required:
                action.required = False
            for group, _ in groups:
                group.required = False
            return self.parse_known_args(arguments)[1]
        except _NotParsed:
            return []
        finally:
            self._relaxed = False
            for action, was in required:
                action.required = was
            for group, was in groups:
                group.required = was


class _NotParsed(Exception):
    """CommandParser's relaxed parse failed."""


def _unrecognized(arguments: list[str]) -> str:
    return f"unrecognized arguments: {' '.join(arguments)}"


def build_parser() -> argparse.ArgumentParser:
    # Typed as the base class, as the commands' modules take it; add_subparsers makes each command's parser a
    # CommandParser too (and each of theirs).
    parser: argparse.ArgumentParser = CommandParser(prog="deskfleet",
                                                    description="Run LLMs across the office's idle PCs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    # Whether this process itself runs models (on --device, else the CPU; drafts included): main() then
    # picks the memory allocator (deskfleet/agent/allocator.py).
    parser.set_defaults(runs_models=False)
    # The extras (EXTRA_MODULES) a command needs: main() checks that they are installed before it runs.
    parser.set_defaults(extras=())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    export = commands.add_parser("export", help="export a Hugging Face checkpoint to per-layer OpenVINO IR")
    export.add_argument("model_dir", type=path_argument, help="checkpoint folder (config.json, safetensors, tokenizer)")
    export.add_argument("-o", "--output", type=path_argument, required=True, help="export folder to write")
    export.add_argument("--weights", choices=[f.value for f in WeightFormat], default=WeightFormat.INT4.value,
                        help="the layers' weights: int4 (the default; groups of 128, the embedding and head int8), "
                             "f16 or f32")
    export.add_argument("--max-context", type=_max_context, default=None,
                        help="RoPE table length (default: min(config's max positions, 8192))")
    export.add_argument("--overwrite", action="store_true", help="replace an existing export folder")
    export.set_defaults(handler=_export, extras=("export",))

    generate = commands.add_parser("generate", help="generate text with an exported model")
    generate.add_argument("--model", type=path_argument, required=True, help="export folder")
    # None: not given (1), which --fleet needs to tell: there its deployment decides the stages.
    generate.add_argument("--stages", type=positive_int, default=None,
                          help="in-process pipeline stages (default 1; not with --fleet)")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text; repeat for concurrent streams")
    prompt.add_argument("--prompts-file", type=prompts_file_argument, action="append",
                        help="UTF-8 file, one prompt per line, run as concurrent streams (repeatable; - reads "
                             "standard input); in a line \\n is a newline, \\t a tab, \\\\ a backslash")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated token ids, e.g. 1,2,3; repeatable")
    generate.add_argument("--chat", action="store_true",
                          help="wrap each text prompt in the model's chat template (not with --prompt-ids)")
    generate.add_argument("--max-new-tokens", "--new-tokens", dest="max_new_tokens", type=positive_int, default=64,
                          help="each stream's limit (default 64; --new-tokens, as the benches name it, too)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    add_decoding_options(generate)
    generate.add_argument("--max-rows", type=positive_int, default=8, help="streams per micro-batch (default 8)")
    generate.add_argument("--micro-batches", type=positive_int, default=None,
                          help="micro-batches in flight (default: the number of stages)")
    _add_compile_options(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    generate.add_argument("--logprobs", type=_logprobs_count, default=None, metavar="N",
                          help="with --json: each generated token's log-probability and the N (0-20) most likely "
                               "tokens' at its position, computed on the last stage")
    add_fleet_option(generate)
    generate.set_defaults(handler=_generate, extras=("controller",))
    add_chat_command(commands, _add_compile_options)
    add_serve_command(commands, _add_compile_options)
    add_window_command(commands)

    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    parity = benches.add_parser("parity", help="1-stage deskfleet vs OpenVINO GenAI, and k stages vs 1")
    parity.add_argument("--model", type=path_argument, required=True, help="export folder (deskfleet)")
    parity.add_argument("--genai-model", type=path_argument, default=None,
                        help="the same checkpoint exported by optimum-intel (omit to skip GenAI)")
    parity.add_argument("--genai-python", type=program_argument, default=None,
                        help="python of a venv with openvino-genai (it pins other versions)")
    parity.add_argument("--prompt-tokens", type=positive_int, default=32, help="random prompt length")
    parity.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=positive_int, default=64,
                              help="tokens each run generates")
    parity.add_argument("--rounds", type=positive_int, default=3, help=ROUNDS_HELP)
    parity.add_argument("--genai-backends", nargs="+", choices=["default", "SDPA", "PA"], default=None,
                        help="the ATTENTION_BACKEND values of GenAI's LLMPipeline to run, one variant each (default: "
                             "two variants, the pipeline's own default and SDPA; needs --genai-model)")
    parity.add_argument("--stages", type=positive_int, nargs="*", default=[2, 3, 4],
                        help="stage counts to compare with 1 (each at most the model's layers)")
    parity.add_argument("--isolation", choices=["process", "shared"], default="process",
                        help="process: every variant in a fresh process of its own each round (default); "
                             "shared: deskfleet's variants loaded once into this process (quicker, noisier)")
    parity.add_argument("--huge-pages-ablation", action="store_true",
                        help="also run deskfleet-1 with DESKFLEET_HUGE_PAGES=0 (process isolation)")
    _add_compile_options(parity)
    parity.set_defaults(handler=_bench_parity)
    rollback = benches.add_parser("rollback", help="mask rollback vs physical trim, and dead slots in a decode step")
    rollback.add_argument("--model", type=path_argument, required=True,
                          help="export folder (its context must hold the longest --contexts plus --rounds x 6 + the "
                               "most --dead-slots + --rejected + 1 slots: 2159 with the defaults)")
    rollback.add_argument("--contexts", type=positive_int, nargs="+", default=[256, 1024, 2048],
                          help="prompt lengths (slots) to time a rollback and a decode step at")
    rollback.add_argument("--rejected", type=positive_int, default=4, help="draft tokens rejected per rollback")
    rollback.add_argument("--dead-slots", type=positive_int, nargs="+", default=[4, 64],
                          help="dead slots per row to time a decode step with (1 up to the shortest context)")
    rollback.add_argument("--rounds", type=positive_int, default=7, help="timed rounds of decode steps (6 steps each)")
    _add_compile_options(rollback)
    rollback.set_defaults(handler=_bench_rollback)
    speculative = benches.add_parser("speculative", help="one stage, code completion with and without a draft")
    speculative.add_argument("--model", type=path_argument, required=True, help="target export folder")
    speculative.add_argument("--draft", type=path_argument, default=None, help="draft export folder")
    speculative.add_argument("--no-lookup", action="store_true",
                             help="skip the prompt-lookup (and lookup-first) variants")
    speculative.add_argument("--k", type=draft_count(1), nargs="*", default=[2, 4, 6],
                             help="fixed K values (1 or more) to time")
    speculative.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-K variant")
    speculative.add_argument("--k-max", type=draft_count(1), default=8, help="upper bound of adaptive K")
    speculative.add_argument("--prompts-file", type=prompts_file_argument, default=None,
                             help="one prompt per line, read as generate's --prompts-file (\\n a newline, "
                                  "\\t a tab, \\\\ a backslash); default: the demo eval set")
    speculative.add_argument("--eval-dir", type=path_argument, default=None,
                             help="folder of the demo model's held-out prompts (heldout_prompts.json, or its "
                                  "evaluate.py; default: the ones shipped with deskfleet, assets/models/train)")
    speculative.add_argument("--prompts", type=positive_int, default=None,
                             help="how many prompts (default: 12 of the held-out set, or all of --prompts-file)")
    speculative.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=positive_int, default=64,
                                   help="tokens generated per prompt")
    speculative.add_argument("--rounds", type=positive_int, default=3, help=ROUNDS_HELP)
    _add_compile_options(speculative)
    speculative.set_defaults(handler=_bench_speculative, extras=("controller",))  # tokenizers
    streams = benches.add_parser("streams", help="1..N users on one core: deskfleet vs GenAI continuous batching")
    streams.add_argument("--model", type=path_argument, required=True, help="export folder (deskfleet)")
    streams.add_argument("--genai-model", type=path_argument, default=None,
                         help="the same checkpoint exported by optimum-intel (omit to skip GenAI)")
    streams.add_argument("--genai-python", type=program_argument, default=None, help="python of the GenAI venv")
    streams.add_argument("--users", type=count_up_to(MAX_BENCH_USERS), nargs="+", default=[1, 2, 4, 8],
                         help="user counts to compare")
    streams.add_argument("--prompt-tokens", type=positive_int, default=32, help="each user's random prompt length")
    streams.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=positive_int, default=64,
                               help="tokens each user generates")
    streams.add_argument("--rounds", type=positive_int, default=3, help=ROUNDS_HELP)
    streams.add_argument("--core", type=non_negative_int, default=None,
                         help="the CPU core to pin to (default: the last)")
    _add_compile_options(streams, threads_help="inference threads: this bench compares one thread on one core with "
                                               "GenAI's on the same core, so 1 is the only value it takes")
    streams.set_defaults(handler=_bench_streams)
    serve = benches.add_parser("serve", help="what the OpenAI-compatible API costs over the engine, 1..N users")
    serve.add_argument("--model", type=path_argument, required=True, help="export folder")
    serve.add_argument("--users", type=count_up_to(MAX_BENCH_USERS), nargs="+", default=[1, 4, 8],
                       help="user counts to compare")
    serve.add_argument("--prompt-tokens", type=positive_int, default=32, help="each user's random prompt length")
    serve.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=positive_int, default=64,
                       help="tokens each user generates")
    serve.add_argument("--rounds", type=positive_int, default=3, help=ROUNDS_HELP)
    serve.add_argument("--stages", type=positive_int, default=1, help="in-process pipeline stages (default 1)")
    _add_compile_options(serve)
    serve.set_defaults(handler=_bench_serve, extras=("controller",))  # tokenizers, aiohttp
    admission = benches.add_parser("admission", help="a long prompt arriving mid-run: what it stalls, chunked or not")
    admission.add_argument("--model", type=path_argument, required=True, help="export folder")
    admission.add_argument("--prompt-tokens", type=positive_int, default=1024, help="the newcomer's prompt")
    admission.add_argument("--chunks", type=non_negative_int, nargs="+", default=None,
                           help="prefill chunk sizes to compare (0: the whole prompt in one call; default: those of "
                                "0 64 256 under --prompt-tokens)")
    admission.add_argument("--running", type=count_up_to(MAX_BENCH_USERS), default=2,
                           help="streams decoding when it arrives")
    admission.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=positive_int, default=96,
                                 help="tokens each running stream makes")
    admission.add_argument("--rounds", type=positive_int, default=3, help=ROUNDS_HELP)
    _add_compile_options(admission)
    admission.set_defaults(handler=_bench_admission)
    chat_bench = benches.add_parser("chat", help="a chat's turns resuming the last reply's KV state vs fed whole")
    chat_bench.add_argument("--model", type=path_argument, required=True, help="export folder (with its chat template)")
    chat_bench.add_argument("--turns", type=positive_int, default=8, help="user messages in the conversation")
    chat_bench.add_argument("--reply-tokens", type=positive_int, default=64, help="each reply's limit")
    chat_bench.add_argument("--messages-file", type=prompts_file_argument, default=None,
                            help="one message per line, read as generate's --prompts-file (a BOM skipped, blank "
                                 "lines left out; chat takes a message a line, so each is sent as one line); "
                                 "default: the demo eval set's code prompts")
    chat_bench.add_argument("--stages", type=positive_int, default=1, help="in-process pipeline stages")
    chat_bench.add_argument("--rounds", type=positive_int, default=3, help=ROUNDS_HELP)
    _add_compile_options(chat_bench)
    chat_bench.set_defaults(handler=_bench_chat, extras=("controller",))  # tokenizers, jinja2
    _add_fleet_bench_command(benches)
    for bench_parser in benches.choices.values():
        bench_parser.formatter_class = DefaultsHelpFormatter
    add_fleet_commands(commands)
    describe_commands(parser)
    verbose_anywhere(parser)
    return parser


def missing_extra(error: ModuleNotFoundError) -> MissingExtraError | None:
    """The extra to install for `error`, or None when its module is not one that an extra brings."""
    module = (error.name or "").partition(".")[0]
    for extra, modules in EXTRA_MODULES.items():
        if module in modules:
            return MissingExtraError(extra, module)
    return None


def check_extras(extras: Sequence[str]) -> None:
    """Raise MissingExtraError naming the first of `extras` (EXTRA_MODULES' keys) with a module not installed."""
    for extra in extras:
        for module in EXTRA_MODULES[extra]:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a broken installation: its import will say what is wrong
                found = True
            if not found:
                raise MissingExtraError(extra, module)


# Private methods

def _main(argv: Sequence[str] | None, stdout: WatchedStream | None) -> int:
    try:
        parser = build_parser()  # imports the commands' modules: a second or two in which Ctrl-C may come
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as error:  # a command's module needs an extra: no command can be parsed
        missing = missing_extra(error)
        if missing is None:
            raise
        print(f"deskfleet: error: {missing}", file=sys.stderr)
        return 2
    except ImportError as error:  # OpenVINO's, of a Ctrl-C that landed in its import
        if interruption(error) is None:
            raise
        return 130
    args = parser.parse_args(argv)
    restore_default_signals()  # SIGTERM / SIGHUP: the launcher's while the modules loaded, each command's from here
    if sys.stdout is None:  # started with standard output closed (`>&-`): every command's text or JSON goes there
        print("deskfleet: error: standard output is closed, and every command writes its result there: run it "
              "with standard output open (to discard it: > /dev/null)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format=log_format(getattr(args, "log_times", False)))
    try:
        os.getcwd()
    except FileNotFoundError:  # `export -o . --overwrite` replaced the folder the shell is in: the next command
        # died importing torch ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"), or called `.` no export
        print("deskfleet: error: the working directory no longer exists (an export with --overwrite replaced it, "
              "or it was removed): cd into it again (cd \"$PWD\") and run the command again", file=sys.stderr)
        return 2
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        try:
            check_extras(args.extras)  # before anything runs, and before run_on_jemalloc re-executes
            if argv is None and args.runs_models:  # this process's own command line: it may re-execute
                run_on_jemalloc(getattr(args, "device", "CPU"))
            status = handler(args)
            flush_stdout()  # inside the handlers below: a result still in the buffer meets a full disk here
            return status
        except ModuleNotFoundError as error:  # an import of a command that needs an extra it does not declare
            missing = missing_extra(error)
            if missing is None:
                raise
            raise missing from error
    except KeyboardInterrupt as stopped:  # Ctrl-C: 130; SIGTERM / SIGHUP where a command unwinds on them: 143 / 129
        return exit_status(stopped)
    except ImportError as error:  # a module a command imports as it runs (OpenVINO) wrapped a Ctrl-C in its own
        wrapped = interruption(error)
        if wrapped is None:
            raise
        return exit_status(wrapped)
    except BrokenPipeError:  # the reader of our output left (e.g. `| head`): stop quietly, as `yes | head` does
        silence_stdout()
        return BROKEN_PIPE_EXIT
    except USER_ERRORS as error:
        if args.verbose:
            raise
        print(f"deskfleet: error: {os_error_text(error) if isinstance(error, OSError) else error}", file=sys.stderr)
        return 2
    except OSError as error:  # after USER_ERRORS, which holds FileNotFoundError
        if args.verbose:
            raise
        if stdout is None or error is not stdout.failure:
            # a read-only data dir, a full disk, a path too long: a traceback said nothing more, and no way out
            print(f"deskfleet: error: {os_error_text(error)}", file=sys.stderr)
            return 2
        silence_stdout()  # or the flush at exit fails again
        print(f"deskfleet: error: could not write the result to standard output: {error.strerror or error}",
              file=sys.stderr)
        return 1


def _add_fleet_bench_command(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`deskfleet bench fleet`; without the controller extra, which its module imports, a stand-in that says
    so when run, so that the other commands and `--help` still work."""
    try:
        from deskfleet.controller.bench.fleet import add_fleet_bench_command
    except ModuleNotFoundError as error:
        missing = missing_extra(error)
        if missing is None:
            raise
        stand_in = benches.add_parser("fleet", help=f"the fleet's throughput table (1-4 PCs, streams, drafting, WAN "
                                                    f"hops) on simulated PCs (needs the "
                                                    f"{missing.extra} extra)", add_help=False)
        assert isinstance(stand_in, CommandParser)
        stand_in.missing_extra = missing  # refuses any arguments, --help included
        return
    add_fleet_bench_command(benches)


def _drafting_figures(report: dict[str, object]) -> str:
    """The closing line's words on drafting: the mean accepted, or that no round drafted; none without a drafter."""
    if "mean_accepted" not in report:
        return ""
    mean = report["mean_accepted"]
    return f", mean accepted {mean:.2f}" if isinstance(mean, float) else ", no drafted round"


def _end_interrupted_line(interrupted: KeyboardInterrupt, as_json: bool) -> None:
    """End the line a Ctrl-C left: the streamed text's (mid-line), as a finished run does, and the terminal's, where
    it echoed ^C, so that the shell's prompt starts on its own. --json has written nothing to stdout, where nothing
    but the report may go (not a stray line where a JSON object is expected): the terminal's line ends on stderr.
    Nothing is written where nobody sees a ^C: stdout to a file or pipe that got no text began with a blank line
    (several prompts) or held nothing but one (a Ctrl-C before the first token)."""
    from deskfleet.controller.run import GenerationInterrupted
    from deskfleet.controller.text_printer import is_terminal

    text = str(interrupted.report.get("text", "")) \
        if isinstance(interrupted, GenerationInterrupted) and interrupted.streamed else ""
    if not as_json and ((text and not text.endswith("\n")) or is_terminal(sys.stdout)):
        _end_line(sys.stdout)
    elif is_terminal(sys.stderr):
        _end_line(sys.stderr)


def _end_line(stream: TextIO) -> None:
    try:
        stream.write("\n")
        stream.flush()
    except (OSError, ValueError):  # a closed pipe or file: nobody to show the line to
        pass


class _Given(argparse.Action):
    """Store the option's value and note that the command line gave it (`namespace.given`, option strings): a
    run can then refuse an option it would ignore without mistaking its default for a choice."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), option_string or self.dest}


def _add_compile_options(parser: argparse.ArgumentParser, threads_help: str | None = None) -> None:
    parser.add_argument("--precision", choices=["f32", "fast"], default="fast", action=_Given,
                        help="f32: exact (f32 compute and KV cache); fast (the default): on a CPU f32 compute "
                             "with int8 dynamic quantization and a u8 KV cache, elsewhere the device's default")
    parser.add_argument("--device", default="CPU", action=_Given,
                        help="OpenVINO device: CPU (the default), GPU, NPU, AUTO, or a list such as AUTO:GPU,CPU")
    parser.add_argument("--threads", type=thread_count, default=None, action=_Given,
                        help=threads_help or f"inference threads per stage (1 to {MAX_THREADS}; default: the "
                                             "device's own choice)")
    parser.set_defaults(runs_models=True)
    parser.add_argument("--kv-cache", choices=KV_CACHE_PRECISIONS, default=None, action=_Given,
                        help="KV cache precision (default: f32 under --precision f32; under fast the device's "
                             "own, u8 on a CPU, except f32 on a CPU when drafting with --draft/--prompt-lookup)")


def _max_context(text: str) -> int:
    """argparse type: an export's context, as export_checkpoint takes it (0 was refused here as "must be 1 or more",
    and 1 then by the export as "must be from 2")."""
    from deskfleet.controller.export.hf_config import MIN_MAX_CONTEXT

    try:
        value = whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not MIN_MAX_CONTEXT <= value <= MAX_SPEC_VALUE:
        raise argparse.ArgumentTypeError(f"must be from {MIN_MAX_CONTEXT} (a prompt token and a new one) to "
                                         f"{MAX_SPEC_VALUE:,}, got {value}")
    return value


def _logprobs_count(text: str) -> int:
    """argparse type: --logprobs N, the most likely tokens listed beside each generated one."""
    try:
        value = whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_TOP_LOGPROBS}, got {value}")
    return value


def _export(args: argparse.Namespace) -> int:
    from deskfleet.controller.export.exporter import export_checkpoint

    def progress(done: int, total: int, name: str) -> None:
        print(f"[{done}/{total}] {name}", file=sys.stderr, flush=True)

    manifest = export_checkpoint(args.model_dir, args.output, WeightFormat(args.weights), args.max_context,
                                 overwrite=args.overwrite, progress=progress)
    spec = manifest.spec
    total = sum(entry.size for entry in manifest.files.values())
    print(f"exported {manifest.model_name}: {spec.num_layers} layers, {manifest.weight_format.value}, "
          f"context {spec.max_context}, {total / 1e6:.1f} MB -> {args.output}")
    return 0


def _stream_done(stream: dict[str, object], max_new_tokens: int) -> bool:
    tokens = stream["tokens"]
    assert isinstance(tokens, list)
    return bool(stream["stopped_by_eos"]) or len(tokens) >= max_new_tokens


def _seed_note(report: dict[str, object]) -> str:
    """"; seed N" for a note on a sampled run that ended early: the seed to sample the same again; "" for greedy."""
    return f"; seed {report['seed']}" if "seed" in report else ""


def _print_interrupted(interrupted: GenerationInterrupted, args: argparse.Namespace) -> None:
    """What a generate run interrupted by Ctrl-C had made (run.GenerationInterrupted): under --json the report
    with each stream's tokens so far and "stopped": "interrupted"; else each stream's text so far, where it was
    not streamed as it came (several prompts), and on stderr how many streams had finished."""
    from deskfleet.controller.run import print_stream_texts

    report = interrupted.report
    streams = report["streams"]
    assert isinstance(streams, list)
    with ctrl_c_held():  # a second Ctrl-C: after the report (exit 130 all the same), not in the middle of it
        try:
            if args.json:
                print(json.dumps(report), flush=True)
            elif not interrupted.streamed:
                print_stream_texts(streams, interrupted.labels)
                sys.stdout.flush()
        except (OSError, ValueError):  # a closed pipe or file: nobody to show it to
            return
        seed = _seed_note(report)
        by_ctrl_c = interrupted.signum == signal.SIGINT
        how = "interrupted" if by_ctrl_c else f"stopped by {signal_name(interrupted)}"
        with suppress(OSError, ValueError):  # a terminal that hung up (SIGHUP): the exit status says it
            if args.json or not interrupted.streamed:
                done = sum(1 for stream in streams if _stream_done(stream, args.max_new_tokens))
                print(f"deskfleet: {how} ({done} of {len(streams)} stream(s) had finished; "
                      f"{report['generated_tokens']} tokens in all, "
                      + ("in the JSON on standard output" if args.json else "above") + f"{seed})", file=sys.stderr)
            elif seed:
                print(f"deskfleet: {how} ({seed.removeprefix('; ')})", file=sys.stderr)
            elif not by_ctrl_c:  # a Ctrl-C shows on the terminal that typed it; a SIGTERM from elsewhere does not
                print(f"deskfleet: {how}", file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    from deskfleet.controller.chat import generate_on_fleet
    from deskfleet.controller.fleet_failover import FailoverError
    from deskfleet.controller.run import GenerateOptions, GenerationInterrupted, GenerationStopped, run_generate

    try:
        # SIGTERM (kill, systemd, a CI runner's cancel) and SIGHUP (a closed terminal) stop the run as Ctrl-C does:
        # the chain's links closed, its micro-batches freed, what the streams made kept; they ended the process on
        # the spot, the streamed line cut and the agents left to notice a dropped connection
        with signals_unwind(ctrl_c=False):
            check_fleet_options(args)
            if args.logprobs is not None and not args.json:
                raise ValueError(f"--logprobs {args.logprobs} reports the log-probabilities in the JSON: add --json")
            options = GenerateOptions(
                model=args.model, stages=args.stages or 1, prompts=args.prompt,
                prompts_files=tuple(args.prompts_file or ()),
                prompt_ids=[parse_token_ids(text) for text in args.prompt_ids] if args.prompt_ids else None,
                chat=args.chat, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                max_rows=args.max_rows, micro_batches=args.micro_batches, logprobs=args.logprobs,
                **decoding_arguments(args, compile_settings(args)))
            if args.fleet:
                report = generate_on_fleet(options, args.data_dir, stream_text=not args.json,
                                           max_failovers=fleet_max_failovers(args),
                                           discover_seconds=args.discover_seconds)
            else:
                report = run_generate(options, stream_text=not args.json)
    except KeyboardInterrupt as interrupted:
        _end_interrupted_line(interrupted, args.json)
        if isinstance(interrupted, GenerationInterrupted):  # the streams had begun: what they made is kept
            _print_interrupted(interrupted, args)
        elif isinstance(interrupted, BenchTerminated):  # before they began (compiling, opening the chain)
            say_stopped(f"deskfleet: stopped by {signal_name(interrupted)}")
        raise
    except FailoverError as error:  # the chain could not be opened nor re-planned: a failed run, not a usage error
        print(f"deskfleet: error: {error}", file=sys.stderr)
        return 1
    except GenerationStopped as stopped:
        # The run broke after it began (a fleet run that gave up re-planning): exit status 1, not a usage
        # error's 2, and what the streams had made is not lost: the text streamed or printed above, and under
        # --json the report of tokens so far with "stopped" saying why.
        if args.json:
            print_whole(json.dumps(stopped.report))
        streams = stopped.report["streams"]
        assert isinstance(streams, list)
        done = sum(1 for stream in streams if _stream_done(stream, args.max_new_tokens))
        seed = _seed_note(stopped.report)
        print(f"deskfleet: error: {stopped} ({done} of {len(streams)} stream(s) had finished; "
              f"{stopped.report['generated_tokens']} tokens in all, "
              + ("in the JSON on standard output" if args.json else "above") + f"{seed})", file=sys.stderr)
        return 1
    if args.json:
        print_whole(json.dumps(report))
    else:
        print()
        tokens, tok_s = report["generated_tokens"], report["tok_s"]
        assert isinstance(tokens, int) and (tok_s is None or isinstance(tok_s, float))
        # one stream's speed is its decoding's, after the first token: none to show for a 1-token run (null)
        print(f"[{tokens} token{'' if tokens == 1 else 's'}" + (f", {tok_s:.1f} tok/s" if tok_s else "")
              + f", {report['stages']} stage(s)"
              + _drafting_figures(report)
              + (f", seed {report['seed']}" if "seed" in report else "") + "]",
              file=sys.stderr)
    return 0


def _bench_parity(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.parity import run_parity_bench

    backends = _genai_backends(args)
    return _run_bench("parity", lambda: run_parity_bench(
        args.model, genai_model=args.genai_model, genai_python=args.genai_python, prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens, rounds=args.rounds, stage_counts=args.stages, settings=compile_settings(args),
        genai_backends=backends, isolation=args.isolation, huge_pages_ablation=args.huge_pages_ablation))


def _genai_backends(args: argparse.Namespace) -> list[str]:
    """--genai-backends, or the default pair; refused without --genai-model (the bench ran without GenAI, unsaid)."""
    if args.genai_backends is not None and args.genai_model is None:
        raise ValueError("--genai-backends needs --genai-model (without it no GenAI variant runs)")
    return args.genai_backends or ["default", "SDPA"]


def _bench_rollback(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.rollback import run_rollback_bench

    return _run_bench("rollback", lambda: run_rollback_bench(
        args.model, contexts=args.contexts, rejected=args.rejected, dead_slots=args.dead_slots, rounds=args.rounds,
        settings=compile_settings(args)))


def _bench_speculative(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.speculative import run_speculative_bench
    from deskfleet.controller.run import read_prompts_file

    prompts = read_prompts_file(args.prompts_file) if args.prompts_file else None
    if prompts == []:  # the bench said only "no prompts"
        raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt: every line is empty or blank")
    return _run_bench("speculative", lambda: run_speculative_bench(
        args.model, args.draft, ks=args.k, adaptive=not args.no_adaptive, lookup=not args.no_lookup, k_max=args.k_max,
        prompts=prompts, eval_dir=args.eval_dir,
        num_prompts=args.prompts, new_tokens=args.new_tokens, rounds=args.rounds, settings=compile_settings(args)))


def _bench_admission(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.admission import run_admission_bench

    return _run_bench("admission", lambda: run_admission_bench(
        args.model, prompt_tokens=args.prompt_tokens, chunks=args.chunks, running=args.running,
        new_tokens=args.new_tokens, rounds=args.rounds, settings=compile_settings(args)))


def _bench_serve(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.serve import run_serve_bench

    return _run_bench("serve", lambda: run_serve_bench(
        args.model, users=args.users, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
        rounds=args.rounds, stages=args.stages, settings=compile_settings(args)))


def _bench_chat(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.chat_turns import run_chat_bench
    from deskfleet.controller.run import read_prompts_file

    messages = None if args.messages_file is None else read_prompts_file(args.messages_file, "--messages-file")
    return _run_bench("chat", lambda: run_chat_bench(
        args.model, turns=args.turns, reply_tokens=args.reply_tokens, rounds=args.rounds, stages=args.stages,
        messages=messages, settings=compile_settings(args)))


def _bench_streams(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.streams import run_streams_bench

    return _run_bench("streams", lambda: run_streams_bench(
        args.model, genai_model=args.genai_model, genai_python=args.genai_python, users=args.users,
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, rounds=args.rounds, core=args.core,
        settings=compile_settings(args)))


def _run_bench(name: str, run: Callable[[], dict[str, Any]]) -> int:
    """Run a bench (not `bench fleet`, which writes files too) and print its report as JSON; a signal unwinds it
    (its runner processes stopped) with one line and exit status 128 + the signal's (bench/interruption.py)."""
    return run_bench(name, run, lambda report: print_whole(json.dumps(report, indent=2)))


if __name__ == "__main__":
    sys.exit(main())
