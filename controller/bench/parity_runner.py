"""deskfleet side of `deskfleet bench parity --isolation process`: one variant in a process of its own.

Speaks the same JSON lines as genai_runner.py, so that deskfleet and GenAI are measured the same way:
each in a fresh process that holds only its own model. The first line configures and loads the variant;
each "run" generates exactly `new_tokens` greedy tokens and answers with its timings; "quit" (or EOF)
ends it.

    -> {"variant": "deskfleet"|"fused-direct"|"whole-direct", "stages": K, "model": DIR,
        "whole_model_xml": XML (whole-direct), "settings": {"device", "precision", "num_threads", "kv_cache"},
        "prompt_ids": [...], "new_tokens": N}
    <- {"ready": true, "load_s": ..., "compiled_properties": {...} (fused-direct, deskfleet with 1 stage)}
    -> "run" or "warm-up" (the same work: deskfleet keeps no prompt cache; see genai_runner.py)
    <- {"tokens": [...], "decode_tok_s": ..., "prefill_s": ...}
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.bench.parity import FusedDirectVariant, PipelineVariant, Variant, WholeDirectVariant


def load_variant(request: dict[str, Any]) -> tuple[Variant, dict[str, Any]]:
    """The variant a configuration line asks for, loaded, and what its ready answer adds."""
    model = Path(request["model"])
    manifest = load_manifest(model)
    raw = request.get("settings", {})
    settings = CompileSettings(device=raw.get("device", "CPU"), precision=Precision(raw.get("precision", "fast")),
                               num_threads=raw.get("num_threads"), kv_cache=raw.get("kv_cache"))
    prompt = [int(token) for token in request["prompt_ids"]]
    new_tokens = int(request["new_tokens"])
    kind = request.get("variant")
    if kind == "deskfleet":
        pipeline = PipelineVariant(model, int(request.get("stages", 1)), settings, manifest, prompt, new_tokens)
        return pipeline, {"compiled_properties": pipeline.compiled_properties()}
    if kind == "fused-direct":
        fused = FusedDirectVariant(model, manifest, settings, prompt, new_tokens)
        return fused, {"compiled_properties": fused.compiled_properties}
    if kind == "whole-direct":
        return WholeDirectVariant(Path(request["whole_model_xml"]), settings, prompt, new_tokens), {}
    raise ValueError(f"unknown variant {kind!r} (deskfleet, fused-direct, whole-direct)")


def serve(lines: TextIO, reply: TextIO) -> int:
    def answer(message: dict[str, Any]) -> None:
        reply.write(json.dumps(message) + "\n")
        reply.flush()

    try:
        started = time.perf_counter()
        variant, extra = load_variant(json.loads(lines.readline()))
        answer({"ready": True, "load_s": time.perf_counter() - started, **extra})
    except Exception as error:  # reported to the bench, which raises it with this text
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    try:
        for line in lines:
            command = line.strip()
            if command == "quit":
                break
            if command in {"run", "warm-up"}:
                record = variant.run()
                answer({"tokens": list(record.tokens), "decode_tok_s": record.decode_tok_s,
                        "prefill_s": record.prefill_s})
            elif command:
                answer({"error": f"unknown command {command!r}"})
    finally:
        variant.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.stdin, sys.stdout))
