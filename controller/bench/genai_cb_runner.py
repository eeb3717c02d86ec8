"""OpenVINO GenAI side of `deskfleet bench streams`: ContinuousBatchingPipeline with N concurrent users.

Run with the python of a venv that has openvino-genai (scripts/genai_venv.sh); free of deskfleet imports.
Pins itself to the CPU cores in $DESKFLEET_BENCH_CORES (comma-separated) BEFORE loading OpenVINO, so
its thread pool only sees those cores. JSON lines on stdin/stdout, like genai_runner.py:

    -> {"model": DIR, "device": "CPU", "properties": {...}, "scheduler": {...}, "new_tokens": N}
    <- {"ready": true, "load_s": ..., "versions": {...}, "affinity": [...]}
    -> {"run": [[ids of user 0], [ids of user 1], ...]}
    <- {"tokens": [[...], ...], "wall_s": ..., "first_token_s": [...], "peak_rss_bytes": ..., "steps": ...}
    -> "quit"

Each user is a client thread that calls add_request (as a server's request handlers would) and waits
for its handle to finish; one thread calls step() while requests are unfinished. The clock runs from the
first add_request to the last token; peak RSS is this process's VmHWM, reset before each run.
"""

import json
import os
import sys
import threading
import time

if os.environ.get("DESKFLEET_BENCH_CORES"):
    os.sched_setaffinity(0, {int(core) for core in os.environ["DESKFLEET_BENCH_CORES"].split(",")})

import numpy as np

# No usage telemetry from the baseline either (see deskfleet/common/no_telemetry.py): before openvino loads.
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]

import openvino as ov  # noqa: E402
import openvino_genai as genai  # noqa: E402


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="utf-8", errors="replace") as handle:  # its Name: is bytes
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(pipe: "genai.ContinuousBatchingPipeline", prompts: list, config: "genai.GenerationConfig",
         next_id: list) -> dict:
    _reset_peak_rss()
    handles: list = [None] * len(prompts)
    added = threading.Barrier(len(prompts) + 1)
    lock = threading.Lock()

    def client(index: int) -> None:
        ids = np.array([prompts[index]], dtype=np.int64)
        with lock:  # add_request from several client threads; ids come from one counter
            request_id = next_id[0]
            next_id[0] += 1
        handles[index] = pipe.add_request(request_id, ov.Tensor(ids), config)
        added.wait()

    started = time.perf_counter()
    clients = [threading.Thread(target=client, args=(index,)) for index in range(len(prompts))]
    for thread in clients:
        thread.start()
    added.wait()
    steps = 0
    first_token = [0.0] * len(prompts)
    while pipe.has_non_finished_requests():
        pipe.step()
        steps += 1
        now = time.perf_counter() - started
        for index, handle in enumerate(handles):
            if not first_token[index] and handle.can_read():
                first_token[index] = now
    wall = time.perf_counter() - started
    for thread in clients:
        thread.join()
    tokens = []
    for handle in handles:
        outputs = handle.read_all()
        tokens.append([int(token) for token in outputs[0].generated_ids])
    return {"tokens": tokens, "wall_s": wall, "first_token_s": first_token, "steps": steps,
            "peak_rss_bytes": _peak_rss()}


def main() -> int:
    request = json.loads(sys.stdin.readline())
    scheduler = genai.SchedulerConfig()
    for name, value in request.get("scheduler", {}).items():
        setattr(scheduler, name, value)
    started = time.perf_counter()
    pipe = genai.ContinuousBatchingPipeline(request["model"], scheduler, request.get("device", "CPU"),
                                            request.get("properties", {}))
    load_s = time.perf_counter() - started
    config = genai.GenerationConfig()
    config.max_new_tokens = int(request["new_tokens"])
    config.min_new_tokens = int(request["new_tokens"])
    config.ignore_eos = True
    config.do_sample = False
    config.num_beams = 1
    _reply({"ready": True, "load_s": load_s, "affinity": sorted(os.sched_getaffinity(0)),
            "scheduler": scheduler.to_string() if hasattr(scheduler, "to_string") else None,
            "versions": {"openvino": ov.get_version(), "openvino_genai": getattr(genai, "__version__", "?")}})
    next_id = [0]
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == '"quit"' or line == "quit":
            break
        message = json.loads(line)
        if isinstance(message, dict) and "run" in message:
            _reply(_run(pipe, message["run"], config, next_id))
        else:
            _reply({"error": f"unknown command {line!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
