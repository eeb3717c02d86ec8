"""`deskfleet generate`: prompts in, streams through a local k-stage pipeline, a JSON-able report out."""

from __future__ import annotations

import re
import signal
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deskfleet.common.arguments import STDIN_PATH
from deskfleet.common.logprobs import MAX_TOP_LOGPROBS
from deskfleet.common.model_spec import load_manifest

from .bench.interruption import stopping_signal
from .decoding_options import DecodingOptions
from .engine import Engine, Recover, StageChain, StreamRequest, StreamResult
from .generation import GenerationError, check_request, check_tokenized
from .pipeline import LocalPipeline, split_layers

if TYPE_CHECKING:  # imported where used: the tokenizers package comes with the controller extra only
    from .tokenizer import ModelTokenizer

# The escapes of a --prompts-file line: \n a newline, \t a tab, \\ a backslash (others stay as written).
_PROMPT_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
_PROMPT_ESCAPE = re.compile(r"\\(.)")
# A --prompts-file line ends at \r\n, \n or \r only. str.splitlines() also splits at \v, \f, \x1c-\x1e, \x85,
# U+2028 and U+2029, which a prompt may hold (a form feed in code, a line separator in text): one line read
# as several prompts.
_LINE_END = re.compile(r"\r\n|\r|\n")
# The largest prompts file read: far past any list of prompts a run could take (each fits the model's context), and
# what /dev/zero given as one fills at once instead of the memory (it read without end, deaf to SIGTERM)
MAX_PROMPTS_FILE_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class GenerateOptions(DecodingOptions):
    model: Path
    stages: int = 1
    prompts: list[str] | None = None
    prompts_files: tuple[Path, ...] = ()  # each read as read_prompts_file reads it, in turn
    prompt_ids: list[list[int]] | None = None
    chat: bool = False
    max_new_tokens: int = 64
    ignore_eos: bool = False
    max_rows: int = 8
    micro_batches: int | None = None
    logprobs: int | None = None  # each generated token's log-probability and the N most likely tokens' (the JSON's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"--logprobs must be 0 to {MAX_TOP_LOGPROBS} most likely tokens, not {self.logprobs}")
        if self.chat and self.prompt_ids is not None:
            raise ValueError("--chat wraps text prompts in the chat template; --prompt-ids are used as given: "
                             "give text prompts with --chat, or leave out --chat")


def encode_prompts(options: GenerateOptions, tokenizer: ModelTokenizer) -> list[tuple[str, list[int]]]:
    """Each prompt's token ids, with the label that an error about it starts with: "--prompt", "--prompt #2"
    (the second of several), "line 37 of --prompts-file F" or "--prompt-ids #1"."""
    from .tokenizer import ChatMessage, ChatTemplateError, check_utf8

    if options.prompt_ids is not None:
        return list(zip(_option_labels("--prompt-ids", len(options.prompt_ids)), options.prompt_ids, strict=True))
    prompts = options.prompts or []
    texts = list(zip(_option_labels("--prompt", len(prompts)), prompts, strict=True))
    for index, path in enumerate(options.prompts_files):
        # standard input twice read nothing the second time; a file twice, by two names, ran every prompt twice
        earlier = next((before for before in options.prompts_files[:index] if _same_file(before, path)), None)
        if earlier is not None:
            named = f"--prompts-file {path}" if earlier == path else f"--prompts-file {earlier} and {path}"
            raise GenerationError(f"{named} {'is' if earlier == path else 'are'} given twice: give each file once")
    for path in options.prompts_files:
        lines = read_numbered_prompts(path)
        if not lines:
            raise GenerationError(f"--prompts-file {path} holds no prompt: every line is empty or blank")
        texts += [(f"line {number} of --prompts-file {path}", text) for number, text in lines]
    if not texts:
        raise GenerationError("no prompt given")
    for what, text in texts:
        if not text:  # `--prompt "$P"` with P unset: a run from BOS alone, of text nobody asked for
            raise GenerationError(f"{what}: the prompt is empty")
        check_utf8(text, what)
    if options.chat:
        tokenizer.require_chat_template(f"--chat: {options.model} has no chat template; leave out --chat to give "
                                        "it the prompts as written")
        try:
            rendered = tokenizer.render_chats([[ChatMessage("user", text)] for _, text in texts])  # one child process
        except ChatTemplateError as error:  # of 10,000 lines, which one the template refused
            if error.conversation is None:
                raise
            raise type(error)(f"{texts[error.conversation][0]}: {error}") from None
        return [(what, tokenizer.encode(text, add_special_tokens=False))
                for (what, _), text in zip(texts, rendered, strict=True)]
    return [(what, tokenizer.encode(text)) for what, text in texts]


def _same_file(first: Path, second: Path) -> bool:
    """Whether two --prompts-file paths name one file (standard input, `-`, only itself; a missing file, by its
    resolved path: reading it names it)."""
    if STDIN_PATH in (str(first), str(second)):
        return str(first) == str(second)
    try:
        return first.samefile(second)
    except OSError:
        return first.resolve() == second.resolve()


def read_prompts_file(path: Path, option: str = "--prompts-file") -> list[str]:
    """One prompt per non-empty line of a UTF-8 file (a BOM is skipped; a line ends at \\r\\n, \\n or \\r),
    with escapes for what a line cannot hold: `\\n` a newline, `\\t` a tab, `\\\\` a backslash; any other
    backslash stays as it is. `deskfleet generate --prompts-file`, `deskfleet bench speculative
    --prompts-file` and `deskfleet bench chat --messages-file` (`option`, which errors name) read it."""
    return [text for _, text in read_numbered_prompts(path, option)]


def _looks_utf16(head: bytes) -> bool:
    """Whether text without a byte order mark is UTF-16: the start decodes as UTF-16 (either byte order) to text
    that is almost all printable characters. A NUL every other byte was the test before, and text outside ASCII
    (Cyrillic, Japanese) was then called a binary file."""
    # (UTF-16 of ASCII text is half NULs: a quarter is no UTF-16 text's; a tenth misread a short line with one NUL)
    if head.count(0) < 0.25 * len(head) and _utf8_but_nuls(head):  # UTF-8 text with a stray NUL: a few bytes of it
        return False  # read as UTF-16 are printable CJK too, and it was told to "save the file as UTF-8"
    head = head[:len(head) - len(head) % 2]
    for encoding in ("utf-16-le", "utf-16-be"):
        try:
            text = head.decode(encoding)
        except UnicodeDecodeError:  # a lone surrogate: not this byte order (a cut at the end is left out above)
            continue
        readable = sum(1 for char in text if char.isprintable() or char in "\t\r\n")
        if text and readable >= 0.95 * len(text):
            return True
    return False


def _utf8_but_nuls(head: bytes) -> bool:
    """Whether `head` is UTF-8 text once its NULs are taken out (a character cut at its end allowed): it decodes, to
    almost all printable characters. UTF-16 text with few NULs (a NUL only in its ASCII characters) seldom decodes,
    and where it does (Cyrillic's bytes are 0x10-0x4F, then 0x04) it decodes to control characters."""
    data = head.replace(b"\x00", b"")
    for cut in range(4):
        try:
            text = data[:len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return sum(1 for char in text if char.isprintable() or char in "\t\r\n") >= 0.95 * len(text)
    return False


def read_numbered_prompts(path: Path, option: str = "--prompts-file") -> list[tuple[int, str]]:
    """read_prompts_file's prompts, each with the number of its line in the file (the first is 1). The path `-`
    reads standard input."""
    if str(path) == STDIN_PATH and sys.stdin is None:  # started with standard input closed (`<&-`)
        raise ValueError(f"{option} -: standard input is closed; give the prompts' file, or pipe them in")
    try:
        if str(path) == STDIN_PATH:
            data = sys.stdin.buffer.read(MAX_PROMPTS_FILE_BYTES + 1)
        else:
            with Path(path).open("rb") as stream:
                data = stream.read(MAX_PROMPTS_FILE_BYTES + 1)
    except OSError as error:
        raise ValueError(f"{option} {path}: {error.strerror or error}") from None
    if len(data) > MAX_PROMPTS_FILE_BYTES:
        raise ValueError(f"{option} {path} holds more than {MAX_PROMPTS_FILE_BYTES // 1024**2} MiB: no list of prompts "
                         "is that long (a device or another file given by mistake?)")
    # a NUL is no UTF-8 text's: UTF-16 (most text has one every other byte there) or a binary file; without
    # any, almost every byte string decodes as UTF-16 to printable CJK, so the test is only made where one is
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or (b"\x00" in data[:4096] and _looks_utf16(data[:4096])):
        # UTF-16 (PowerShell 5's `>` writes it): without a BOM it decodes as UTF-8 with a NUL every other byte
        raise ValueError(f"{option} {path} is UTF-16 text, not UTF-8: save the file as UTF-8")
    if (nul := data.find(0)) >= 0:  # a binary file: called UTF-16 (as any NUL was), it got the wrong fix
        raise ValueError(f"{option} {path} holds NUL bytes at byte {nul}: it is not a text file (a binary file given "
                         "by mistake?)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        # The line, as a prompt's other errors name it: in a file of thousands of prompts a byte alone is
        # not enough to find it. What precedes the byte decoded (error.object is the file without its BOM).
        line = len(_LINE_END.split(error.object[:error.start].decode("utf-8")))
        raise ValueError(f"line {line} of {option} {path}: not UTF-8 text (it holds the byte "
                         f"0x{error.object[error.start]:02x}); save the file as UTF-8") from None
    # a BOM at the start of any line, not only the first: two files saved by a Windows editor, joined by `cat a b`
    # (`removeprefix`: a zero-width no-break space within a line is text, and kept)
    return [(number, _PROMPT_ESCAPE.sub(_unescape, line.removeprefix("\ufeff")))
            for number, line in enumerate(_LINE_END.split(text), start=1) if line.removeprefix("\ufeff").strip()]


def run_generate(options: GenerateOptions, stream_text: bool = False, chain: StageChain | None = None,
                 chain_stages: int | None = None, recover: Recover | None = None) -> dict[str, object]:
    """Run every prompt as a concurrent stream; returns the report `deskfleet generate --json` prints.

    `chain` (e.g. the fleet, with `chain_stages` stages) replaces the local pipeline; the caller closes it.
    `recover` makes a new chain when that one breaks (Engine.run); the report then lists the failovers.
    """
    from .text_printer import TextPrinter
    from .tokenizer import ModelTokenizer

    manifest = load_manifest(options.model)
    tokenizer = ModelTokenizer(options.model)
    prompts = encode_prompts(options, tokenizer)
    stop = tokenizer.end_of_turn_ids() if options.chat else frozenset()  # --chat: the reply's turn ends there
    options.check_model(manifest.spec)
    for what, prompt in prompts:  # before the stages compile, and naming the prompt among several
        try:
            if options.prompt_ids is None:  # the tokenizer's ids: one outside the vocabulary is the export's fault
                check_tokenized(manifest.spec, prompt)
            check_request(manifest.spec, prompt, options.max_new_tokens)
        except GenerationError as error:
            raise GenerationError(f"{what}: {error}") from None
    if chain is None:  # before anything compiles, the draft model included
        split_layers(manifest.spec.num_layers, options.stages)
    sampling = options.sampling()
    settings = options.target_settings()
    draft = options.open_drafter(settings, options.model, over_fleet=chain is not None)
    stages = chain_stages or options.stages
    engine_options = options.engine_options(options.micro_batches or stages, max_rows=options.max_rows)
    printer = TextPrinter(tokenizer, sys.stdout) if stream_text and len(prompts) == 1 else None
    context: AbstractContextManager[StageChain] = (
        nullcontext(chain) if chain is not None
        else LocalPipeline(options.model, options.stages, settings, manifest))
    labels = [what for what, _ in prompts]
    report: dict[str, object] | None = None
    try:
        with context as pipeline:
            engine = Engine(pipeline, manifest.spec, draft, engine_options)
            for index, (_, prompt) in enumerate(prompts):
                engine.add(StreamRequest(prompt_ids=prompt, max_new_tokens=options.max_new_tokens,
                                         ignore_eos=options.ignore_eos, stop_token_ids=stop, sampling=sampling,
                                         seed=options.base_seed + index, logprobs=options.logprobs,
                                         presence_penalty=options.presence_penalty,
                                         frequency_penalty=options.frequency_penalty,
                                         logit_bias=options.logit_bias))
            started = time.perf_counter()
            try:
                results = engine.run(on_token=printer.push if printer else None, recover=recover)
            except Exception as error:
                if printer is not None and printer.text and not printer.text.endswith("\n"):
                    printer.out.write("\n")  # the error that follows starts a line of its own
                    printer.out.flush()
                if not isinstance(error, RuntimeError):
                    raise
                # The chain broke past what recover could mend (a fleet run that gave up re-planning): what the
                # streams had made is not thrown away with the error.
                wall = time.perf_counter() - started
                partial = _report(engine, tokenizer, engine.results(), wall, stages, pipeline, stream_text, labels)
                partial["stopped"] = str(error)
                _add_run_figures(partial, engine, options, draft is not None, recover is not None)
                raise GenerationStopped(str(error), partial) from error
            except KeyboardInterrupt as stopping:
                # Ctrl-C: what the streams had made is not thrown away with it (a long --prompts-file run stopped
                # near its end lost every finished stream); the caller prints it and ends the run as interrupted
                wall = time.perf_counter() - started
                partial = _report(engine, tokenizer, engine.results(), wall, stages, pipeline, False, labels)
                partial["stopped"] = "interrupted"
                _add_run_figures(partial, engine, options, draft is not None, recover is not None)
                raise GenerationInterrupted(partial, labels, streamed=printer is not None,
                                            signum=stopping_signal(stopping)) from None
            wall = time.perf_counter() - started
            if printer is not None:
                printer.finish()
            # made before the chain closes (stages released, over the fleet a round trip each), so that a Ctrl-C
            # meanwhile does not lose a finished run
            report = _report(engine, tokenizer, results, wall, stages, pipeline, stream_text, labels)
            _add_run_figures(report, engine, options, draft is not None, recover is not None)
    except KeyboardInterrupt as interrupted:
        if report is None or isinstance(interrupted, GenerationInterrupted):
            raise
        # the run had finished, its texts printed: the caller prints the report under --json, and ends as interrupted
        raise GenerationInterrupted(report, labels, streamed=True, signum=stopping_signal(interrupted)) from None
    return report


class GenerationStopped(RuntimeError):
    """A run that broke after it began (the chain, past what failover could mend): `report` is the report
    run_generate would have returned, with each stream's tokens so far and `"stopped"`: why."""

    def __init__(self, message: str, report: dict[str, object]) -> None:
        super().__init__(message)
        self.report = report


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM / SIGHUP: `signum`) while the streams ran: `report` is the report run_generate would have
    returned, with each stream's tokens so far and `"stopped": "interrupted"`; `labels` name the streams' prompts
    (print_stream_texts); `streamed`: the one stream's text was printed as it came."""

    def __init__(self, report: dict[str, object], labels: list[str], streamed: bool,
                 signum: int = signal.SIGINT) -> None:
        super().__init__()
        self.report = report
        self.labels = labels
        self.streamed = streamed
        self.signum = signum


def print_stream_texts(streams: list[dict[str, object]], labels: list[str]) -> None:
    """Each stream's text under the label that errors call its prompt by (encode_prompts: "--prompt #2", "line 5
    of --prompts-file F"), in the order the prompts were given; a model's control characters made visible on a
    terminal, not obeyed."""
    from .text_printer import is_terminal, visible_controls

    shown = visible_controls if is_terminal(sys.stdout) else str
    for label, stream in zip(labels, streams, strict=True):
        print(f"--- {label}\n{shown(str(stream['text']))}")


def _report(engine: Engine, tokenizer: ModelTokenizer, results: dict[int, StreamResult], wall: float, stages: int,
            pipeline: StageChain, print_streams: bool, labels: list[str]) -> dict[str, object]:
    """The report; with `print_streams`, each stream's text printed (print_stream_texts) where there are several."""
    streams: list[dict[str, object]] = [
        {"label": label, "tokens": result.tokens, "text": tokenizer.decode(result.tokens),
         "tok_s": _rounded(result.decode_tok_s), "prompt_tokens": result.prompt_tokens,
         # null for a stream a Ctrl-C stopped before its first token: 0.0 read as a token at once
         "first_token_s": round(result.first_token_s, 4) if result.tokens else None,
         "stopped_by_eos": result.stopped_by_eos}
        for label, result in zip(labels, results.values(), strict=True)]
    for stream, result in zip(streams, results.values(), strict=True):
        if result.logprobs is not None:  # --logprobs: one entry a token, the alternatives most likely first
            stream["logprobs"] = [{"token": entry.token, "logprob": entry.logprob,
                                   "top": [[token, logprob] for token, logprob in entry.top]}
                                  for entry in result.logprobs]
    generated = sum(len(result.tokens) for result in results.values())
    # after a failover the run finished on the new chain: its stages, not the first chain's
    finished_on = getattr(engine.chain, "num_stages", stages) if engine.chain is not pipeline else stages
    report: dict[str, object] = {"stages": finished_on, "generated_tokens": generated,
                                 "wall_s": round(wall, 4), "streams": streams}
    if len(streams) == 1:
        report.update({key: streams[0][key] for key in ("tokens", "text", "tok_s")})
    else:
        report["tok_s"] = round(generated / wall, 3) if wall > 0 else None  # as a stream's with nothing to time
        if print_streams:
            print_stream_texts(streams, labels)
    return report


def _rounded(tok_s: float | None) -> float | None:
    return round(tok_s, 3) if tok_s is not None else None


def _add_run_figures(report: dict[str, object], engine: Engine, options: GenerateOptions, drafted: bool,
                     recovered: bool) -> None:
    """The run's seed (a run that samples: the one given or drawn, to run it again with --seed), its failovers (a
    run that could recover) and its drafting figures (a run that drafted); in every report, a stopped one's too."""
    if options.seed is not None:
        report["seed"] = options.seed
    if recovered:
        report["failovers"] = [asdict(failover) for failover in engine.failovers]
    if drafted:
        histogram = engine.accepted_histogram()
        report["accepted_histogram"] = {str(k): v for k, v in histogram.items()}
        # means over no drafted round (a 1-token run, a Ctrl-C before any) are null: 0.0 read as nothing accepted
        report["mean_accepted"] = round(engine.mean_accepted(), 4) if histogram else None
        report["mean_k"] = round(engine.mean_k(), 4) if histogram else None


def _unescape(match: re.Match[str]) -> str:
    return _PROMPT_ESCAPES.get(match[1], match[0])


def _option_labels(option: str, count: int) -> list[str]:
    """How errors name each of `count` repeated options: the option alone when given once, else "#N" after it
    ("--prompt-ids 2" read as the value 2)."""
    return [option] if count == 1 else [f"{option} #{number}" for number in range(1, count + 1)]
