"""`deskfleet bench serve`: what the OpenAI-compatible API costs over the engine it drives, at 1..N users.

One EngineService on local stages serves both variants, round by round in turn (bench/rounds.py):
- `api`: N clients, each a thread with its own HTTP connection, send their streamed completion at once to the
  server (`deskfleet serve`'s app, on loopback, in this process); the clients run in a process of their own
  (api_clients.py), as a server's clients do;
- `direct`: the same N requests submitted to the service itself, no HTTP.
Each request is a pseudo-random prompt of token ids (`bench streams`' prompts) with `ignore_eos`, so every user
makes the same number of tokens. Reported per user count: the aggregate tok/s of each variant and their ratio, and
each variant's median time to a user's first token, and whether the two variants' texts were the same (in f32 they
must be; in `fast` a burst that reaches the engine as two groups may round differently).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.logprobs import TokenLogprob
from deskfleet.common.model_spec import load_manifest

from ..engine import EngineOptions, StreamRequest
from ..engine_service import EngineService, OpenedChain, StreamEnd
from ..pipeline import LocalPipeline
from ..tokenizer import ModelTokenizer
from .host import host_report
from .parity import summarize
from .rounds import round_order
from .runner_process import RunnerProcess
from .streams import user_prompts

MODEL_NAME = "bench"


@dataclass
class _Timed:
    """One user's request: when it was sent, its first token came and it ended, its tokens (ids where known) and
    its text."""

    sent: float = 0.0
    first: float = 0.0
    ended: float = 0.0
    made: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""


class _DirectSink:
    def __init__(self, timed: _Timed) -> None:
        self.timed = timed
        self.done = threading.Event()
        self.error: str | None = None

    def token(self, token: int, logprob: TokenLogprob | None) -> None:
        if not self.timed.tokens:
            self.timed.first = time.perf_counter()
        self.timed.tokens.append(token)
        self.timed.made += 1

    def end(self, end: StreamEnd) -> None:
        self.timed.ended = time.perf_counter()
        self.error = end.error
        self.done.set()


def run_serve_bench(model: Path, users: list[int] | None = None, prompt_tokens: int = 32, new_tokens: int = 64,
                    rounds: int = 3, stages: int = 1, settings: CompileSettings | None = None,
                    progress: bool = True) -> dict[str, Any]:
    users = list(dict.fromkeys(users or [1, 4, 8]))
    if min([prompt_tokens, new_tokens, rounds, stages, *users]) < 1:
        raise ValueError("users, prompt_tokens, new_tokens, rounds and stages must be at least 1")
    model = Path(model)
    manifest = load_manifest(model)
    spec = manifest.spec
    if prompt_tokens + new_tokens > spec.max_context:
        raise ValueError(f"{prompt_tokens} prompt tokens and {new_tokens} new ones do not fit the model's context of "
                         f"{spec.max_context}: give fewer --new-tokens or --prompt-tokens")
    prompts = user_prompts(spec.vocab_size, max(users), prompt_tokens, spec.bos_token_id)  # as `bench streams`'
    chosen = settings or CompileSettings()

    @contextmanager
    def open_chain() -> Iterator[OpenedChain]:
        with LocalPipeline(model, stages, chosen, manifest) as pipeline:
            yield OpenedChain(pipeline)

    service = EngineService(open_chain, spec, None,
                            lambda chain: EngineOptions(max_rows=max(users), micro_batches=stages),
                            max_streams=max(users))
    started = time.perf_counter()
    samples: dict[str, dict[str, list[float]]] = {}
    texts: dict[str, list[str]] = {}
    configs = [(variant, count) for count in users for variant in ("api", "direct")]
    tokenizer = ModelTokenizer(model)
    with service, _Server(service, tokenizer, spec) as port, closing(_Clients(port)) as clients:
        for index in range(rounds + 1):  # round 0 warms up, untimed
            for variant, count in round_order(configs, index):
                timed = (clients if variant == "api" else _direct)(service, port, prompts[:count], new_tokens)
                key = f"{variant}/{count}"
                texts.setdefault(key, [one.text or tokenizer.decode(one.tokens) for one in timed])
                if index == 0:
                    continue
                wall = max(one.ended for one in timed) - min(one.sent for one in timed)
                made = sum(one.made for one in timed)
                measures = samples.setdefault(key, {})
                measures.setdefault("tok_s", []).append(made / wall)
                measures.setdefault("first_token_ms", []).append(
                    statistics.median((one.first - one.sent) * 1000 for one in timed))
            if index and progress:
                print(f"round {index}/{rounds}: " + ", ".join(
                    f"{count} user(s) api {samples[f'api/{count}']['tok_s'][-1]:.1f} / direct "
                    f"{samples[f'direct/{count}']['tok_s'][-1]:.1f} tok/s" for count in users),
                    file=sys.stderr, flush=True)
    return {
        "model": str(model), "layers": spec.num_layers, "hidden": spec.hidden_size, "host": host_report(),
        "stages": stages, "precision": chosen.precision.value, "rounds": rounds, "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "users": {str(count): {
            "api": {name: summarize(values) for name, values in samples[f"api/{count}"].items()},
            "direct": {name: summarize(values) for name, values in samples[f"direct/{count}"].items()},
            "api_vs_direct_tok_s": round(statistics.median(samples[f"api/{count}"]["tok_s"])
                                         / statistics.median(samples[f"direct/{count}"]["tok_s"]), 3),
            "texts_identical": texts[f"api/{count}"] == texts[f"direct/{count}"],
        } for count in users},
        "bench_s": round(time.perf_counter() - started, 1),
    }


def _direct(service: EngineService, port: int, prompts: list[list[int]], new_tokens: int) -> list[_Timed]:
    timed = [_Timed() for _ in prompts]
    sinks = [_DirectSink(one) for one in timed]
    for prompt, one, sink in zip(prompts, timed, sinks, strict=True):
        one.sent = time.perf_counter()
        service.submit(StreamRequest(prompt, max_new_tokens=new_tokens, ignore_eos=True), sink)
    for sink in sinks:
        if not sink.done.wait(600) or sink.error is not None:
            raise RuntimeError(f"a stream of the direct variant failed: {sink.error or 'no end in 600 s'}")
    return timed


class _Clients:
    """The `api` variant's clients, in a process of their own (api_clients.py)."""

    def __init__(self, port: int) -> None:
        from . import api_clients

        self._runner = RunnerProcess(Path(api_clients.__file__), None)
        self._runner.start(json.dumps({"port": port, "model": MODEL_NAME}))

    def __call__(self, service: EngineService, port: int, prompts: list[list[int]],
                 new_tokens: int) -> list[_Timed]:
        self._runner.send_line(json.dumps({"run": prompts, "new_tokens": new_tokens}))
        return [_Timed(sent=user["sent"], first=user["first"], ended=user["ended"], made=user["made"],
                       text=user["text"]) for user in self._runner.receive()["users"]]

    def close(self) -> None:
        self._runner.close(json.dumps("quit"))


class _Server:
    """`deskfleet serve`'s app over `service` on 127.0.0.1 at a free port, its event loop on a thread of its own."""

    def __init__(self, service: EngineService, tokenizer: ModelTokenizer, spec: Any) -> None:
        from ..openai_api import OpenAiApi

        self.api = OpenAiApi(service, tokenizer, spec, MODEL_NAME)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._port = 0
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),), daemon=True)

    def __enter__(self) -> int:
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("the bench's API server did not start")
        return self._port

    def __exit__(self, *exc_info: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _run(self) -> None:
        from aiohttp import web

        runner = self.api.runner()  # as `deskfleet serve` runs it
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._port = runner.addresses[0][1]
        self._stop = asyncio.Event()
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()
