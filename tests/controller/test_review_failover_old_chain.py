"""A chain that breaks while it still works (the fleet's step timeout: "no result within 120 s ... an agent may be
stuck", its links all open): the run resumes on the new chain and frees what it held on the old one. It freed
nothing there, so every micro-batch of the run kept its KV state on every PC of the old chain for the agents'
10-minute idle limit, and a re-plan onto the same PCs (nobody was blamed) held every stream's cache twice."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.engine import ChainBroken, Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from tests.controller.test_engine_failover import LENGTHS, PROMPTS

F32 = CompileSettings(precision=Precision.F32)


class TimingOutChain:
    """A working local pipeline whose `stall_at`-th collect gives up waiting, as the fleet's step timeout does:
    nothing on it broke, and it still takes releases."""

    def __init__(self, pipeline: LocalPipeline, stall_at: int | None) -> None:
        self.pipeline = pipeline
        self.stall_at = stall_at
        self.collected = 0

    def submit(self, message: Forward) -> None:
        self.pipeline.submit(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        if self.collected == self.stall_at:
            raise ChainBroken(f"no result within 120 s after {self.collected} steps: an agent may be stuck")
        self.collected += 1
        return self.pipeline.collect(timeout)

    def release(self, batch_id: int) -> None:
        self.pipeline.release(batch_id)


def _run(model: Path, stall_at: int | None) -> tuple[list[list[int]], list[LocalPipeline], int]:
    """Tokens of every stream, the pipelines used (closed), and the failovers."""
    manifest = load_manifest(model)
    pipelines: list[LocalPipeline] = []
    with ExitStack() as stack:
        def chain(stall: int | None) -> TimingOutChain:
            pipelines.append(stack.enter_context(LocalPipeline(model, 2, F32, manifest)))
            return TimingOutChain(pipelines[-1], stall)

        engine = Engine(chain(stall_at), manifest.spec, None, EngineOptions(max_rows=2, micro_batches=2))
        for index, prompt in enumerate(PROMPTS):
            engine.add(StreamRequest(prompt, max_new_tokens=LENGTHS[index], ignore_eos=True, arrival_step=2 * index))
        results = engine.run(recover=lambda error: chain(None))
    return [results[index].tokens for index in range(len(PROMPTS))], pipelines, len(engine.failovers)


def test_a_timed_out_chain_is_left_holding_nothing(target: Path) -> None:
    uninterrupted, _, _ = _run(target, None)
    tokens, pipelines, failovers = _run(target, 9)
    assert failovers == 1 and tokens == uninterrupted
    old, new = pipelines
    assert old.micro_batches == (0, 0)  # read after close(): every release it was sent has run
    assert new.micro_batches == (0, 0)
