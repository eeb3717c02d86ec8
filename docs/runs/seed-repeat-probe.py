"""How often a seeded, sampled reply changes with the batch it runs in (stop 54): for 20 seeds, a request alone,
then as choice 0 of n=3 (beside two other rows), then alone again; demo target, `serve --threads 1` on loopback,
48 tokens at temperature 1, with top_p 1 and 0.95; prints JSON.

    .venv/bin/python docs/runs/seed-repeat-probe.py PORT [serve options, e.g. --precision f32]
"""
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT = int(sys.argv[1])
extra = sys.argv[2:]
LOG = Path(tempfile.gettempdir()) / f"seed-repeat-probe-{PORT}.log"
server = subprocess.Popen([str(ROOT / ".venv/bin/deskfleet"), "serve", "--model", str(ROOT / "out/demo/target-int4"),
                           "--listen", f"127.0.0.1:{PORT}", "--no-api-key", "--threads", "1", *extra],
                          cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL, stderr=LOG.open("w"))


def post(body):
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


try:
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2) as response:
                model = json.load(response)["data"][0]["id"]
            break
        except OSError:
            time.sleep(0.5)
    else:
        raise SystemExit(f"the server did not answer: {LOG.read_text()[-2000:]}")
    prompts = ["def parse_args(argv):", "class Cache:\n    def __init__(self", "import json\n\ndef load(path):"]
    results = {}
    for top_p in (1.0, 0.95):
        differ_batch = differ_repeat = 0
        runs = 0
        for seed in range(1, 21):
            body = {"model": model, "prompt": prompts[seed % 3], "max_tokens": 48, "temperature": 1.0, "seed": seed,
                    "top_p": top_p, "ignore_eos": True}
            alone = post(body)["choices"][0]["text"]
            batched = post({**body, "n": 3})["choices"][0]["text"]
            again = post(body)["choices"][0]["text"]
            differ_batch += alone != batched
            differ_repeat += alone != again
            runs += 1
        results[f"top_p={top_p}"] = {"requests": runs, "alone_vs_choice0_of_n3_differ": differ_batch,
                                     "alone_vs_alone_again_differ": differ_repeat}
    print(json.dumps({"serve_options": extra, "max_tokens": 48, **results}))
finally:
    server.terminate()
    server.wait()
