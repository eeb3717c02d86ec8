"""OpenVINO GenAI side of `deskfleet bench parity`, run with the python of a venv that has openvino-genai.

Kept free of deskfleet imports (that venv pins other versions of transformers): it speaks JSON lines on
stdin/stdout. The first line configures and loads the pipeline; then each "run" line runs one greedy
generation of exactly `new_tokens` tokens and answers with its timings; "quit" (or EOF) ends it.

    -> {"model": DIR, "device": "CPU", "properties": {...}, "prompt_ids": [...], "new_tokens": N}
    <- {"ready": true, "load_s": ..., "versions": {...}}
    -> "run"
    <- {"tokens": [...], "decode_tok_s": ..., "ttft_s": ..., "tpot_ms": ..., "generate_s": ...}
    -> "warm-up"
    <- the same, for a prompt that shares no cache block with the timed one

LLMPipeline's default (PagedAttention) backend caches prompt prefixes: a second generation from the same
prompt took 53 ms to its first token instead of 131 (1.1B model, 32 tokens), which measures a cache hit,
not a prefill. The warm-up therefore runs the prompt rotated (BOS kept first), so the timed run that follows
in a fresh process prefills for real. deskfleet keeps no prompt cache.
"""

import json
import sys
import time

import numpy as np

# No usage telemetry from the baseline either (see deskfleet/common/no_telemetry.py): before openvino loads.
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]

import openvino as ov  # noqa: E402
import openvino_genai as genai  # noqa: E402


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _run(pipe: "genai.LLMPipeline", inputs: "genai.TokenizedInputs", config: "genai.GenerationConfig") -> dict:
    started = time.perf_counter()
    result = pipe.generate(inputs, config)
    generate_s = time.perf_counter() - started
    tokens = [int(token) for token in result.tokens[0]]
    metrics = result.perf_metrics
    ttft_ms = float(metrics.get_ttft().mean)
    tpot_ms = float(metrics.get_tpot().mean)
    return {
        "tokens": tokens,
        # Same definition as deskfleet's: tokens after the first, over the time after the first.
        "decode_tok_s": 1000.0 / tpot_ms if tpot_ms > 0 else 0.0,
        "wall_decode_tok_s": (len(tokens) - 1) / (generate_s - ttft_ms / 1000.0) if len(tokens) > 1 else 0.0,
        "ttft_s": ttft_ms / 1000.0,
        "tpot_ms": tpot_ms,
        "generate_s": generate_s,
    }


def main() -> int:
    request = json.loads(sys.stdin.readline())
    started = time.perf_counter()
    pipe = genai.LLMPipeline(request["model"], request.get("device", "CPU"), **request.get("properties", {}))
    load_s = time.perf_counter() - started
    ids = np.array([request["prompt_ids"]], dtype=np.int64)
    inputs = genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
    rotated = ids.copy()
    rotated[0, 1:] = np.roll(ids[0, 1:], 1)
    warm_up_inputs = genai.TokenizedInputs(ov.Tensor(rotated), ov.Tensor(np.ones_like(ids)))
    config = pipe.get_generation_config()
    config.max_new_tokens = int(request["new_tokens"])
    config.min_new_tokens = int(request["new_tokens"])
    config.ignore_eos = True
    config.do_sample = False
    config.num_beams = 1
    pipe.set_generation_config(config)
    _reply({"ready": True, "load_s": load_s,
            "versions": {"openvino": ov.get_version(), "openvino_genai": getattr(genai, "__version__", "?")}})
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "run":
            _reply(_run(pipe, inputs, config))
        elif command == "warm-up":
            _reply(_run(pipe, warm_up_inputs, config))
        elif command:
            _reply({"error": f"unknown command {command!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
