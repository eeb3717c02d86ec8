"""`deskfleet`: the controller's command line. Parsing and dispatch only; the work lives in the modules."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from deskfleet.common.model_spec import ManifestError, WeightFormat

if TYPE_CHECKING:
    from deskfleet.agent.stage import CompileSettings
    from deskfleet.controller.tokenizer import ModelTokenizer

log = logging.getLogger("deskfleet")

# Errors whose message is the whole story for the user: printed without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ManifestError, FileNotFoundError, ValueError, RuntimeError)


# Public methods

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as error:
        if args.verbose:
            raise
        print(f"deskfleet: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deskfleet", description="Run LLMs across the office's idle PCs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    export = commands.add_parser("export", help="export a Hugging Face checkpoint to per-layer OpenVINO IR")
    export.add_argument("model_dir", type=Path, help="checkpoint folder (config.json, safetensors, tokenizer)")
    export.add_argument("-o", "--output", type=Path, required=True, help="export folder to write")
    export.add_argument("--weights", choices=[f.value for f in WeightFormat], default=WeightFormat.INT4.value)
    export.add_argument("--max-context", type=int, default=None,
                        help="RoPE table length (default: min(config's max positions, 8192))")
    export.add_argument("--overwrite", action="store_true", help="replace an existing export folder")
    export.set_defaults(handler=_export)

    generate = commands.add_parser("generate", help="generate text with an exported model")
    generate.add_argument("--model", type=Path, required=True, help="export folder")
    generate.add_argument("--stages", type=int, default=1, help="in-process pipeline stages")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (a completion; see --chat)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    generate.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    _add_compile_options(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    generate.set_defaults(handler=_generate)

    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    parity = benches.add_parser("parity", help="1-stage deskfleet vs OpenVINO GenAI, and k stages vs 1")
    parity.add_argument("--model", type=Path, required=True, help="export folder (deskfleet)")
    parity.add_argument("--genai-model", type=Path, default=None,
                        help="the same checkpoint exported by optimum-intel (omit to skip GenAI)")
    parity.add_argument("--genai-python", type=Path, default=None,
                        help="python of a venv with openvino-genai (it pins other versions)")
    parity.add_argument("--prompt-tokens", type=int, default=32)
    parity.add_argument("--new-tokens", type=int, default=64)
    parity.add_argument("--rounds", type=int, default=3)
    parity.add_argument("--stages", type=int, nargs="*", default=[2, 3, 4])
    _add_compile_options(parity)
    parity.set_defaults(handler=_bench_parity)
    return parser


# Private methods

def _add_compile_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precision", choices=["f32", "fast"], default="fast",
                        help="f32: exact (f32 compute and KV cache); fast: the device's default")
    parser.add_argument("--device", default="CPU", help="OpenVINO device: CPU, GPU, NPU, AUTO")
    parser.add_argument("--threads", type=int, default=None, help="inference threads per stage")


def _compile_settings(args: argparse.Namespace) -> CompileSettings:
    from deskfleet.agent.stage import CompileSettings, Precision

    return CompileSettings(device=args.device, precision=Precision(args.precision), num_threads=args.threads)


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


def _parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from error


def _generate(args: argparse.Namespace) -> int:
    from deskfleet.common.model_spec import load_manifest
    from deskfleet.controller.generation import generate_greedy
    from deskfleet.controller.pipeline import LocalPipeline
    from deskfleet.controller.tokenizer import ChatMessage, ModelTokenizer

    manifest = load_manifest(args.model)
    tokenizer = ModelTokenizer(args.model)
    if args.prompt_ids is not None:
        prompt_ids = _parse_prompt_ids(args.prompt_ids)
    elif args.chat:
        prompt_ids = tokenizer.encode_chat([ChatMessage("user", args.prompt)])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    streamed = _TextStream(tokenizer, enabled=not args.json)
    with LocalPipeline(args.model, args.stages, _compile_settings(args), manifest) as pipeline:
        result = generate_greedy(pipeline, prompt_ids, args.max_new_tokens, ignore_eos=args.ignore_eos,
                                 on_token=streamed.push)
    text = tokenizer.decode(result.tokens)
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": text, "tok_s": round(result.decode_tok_s, 3),
                          "stages": args.stages, "prompt_tokens": result.prompt_tokens,
                          "prefill_s": round(result.prefill_s, 4), "stopped_by_eos": result.stopped_by_eos}))
    else:
        print()
        print(f"[{len(result.tokens)} tokens, {result.decode_tok_s:.1f} tok/s, {args.stages} stage(s)]",
              file=sys.stderr)
    return 0


class _TextStream:
    """Prints decoded text as tokens arrive (decoding the whole tail keeps multi-byte characters whole)."""

    def __init__(self, tokenizer: ModelTokenizer, enabled: bool) -> None:
        self.tokenizer = tokenizer
        self.enabled = enabled
        self.tokens: list[int] = []
        self.printed = ""

    def push(self, token: int) -> None:
        if not self.enabled:
            return
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text


def _bench_parity(args: argparse.Namespace) -> int:
    from deskfleet.controller.bench.parity import run_parity_bench

    report = run_parity_bench(args.model, genai_model=args.genai_model, genai_python=args.genai_python,
                              prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                              rounds=args.rounds, stage_counts=args.stages,
                              settings=_compile_settings(args))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
