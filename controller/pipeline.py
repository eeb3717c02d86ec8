"""A k-stage pipeline in one process: each stage on its own worker thread, connected by queues.

The queues stand where the network will stand: a worker takes a Forward message (the same message the
agents exchange), runs it on its stage executor and hands the Forward with hidden states to the next
worker; the last worker returns the ForwardResult to the driver. Several micro-batches may be in flight
at once; each has its own KV state (session) on every stage.

A single stage runs inline instead, in the driver's thread at submit(): with nothing to overlap, the two
thread hand-offs per step only cost time (measured 0.908 vs 0.922 of GenAI's decode speed, 2 cores); its
results wait in a plain deque, with no lock to take.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from deskfleet.agent.stage import CompileSettings, LayerRange, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.model_spec import Manifest, load_manifest
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.chain_ids import ChainIds

log = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage and the micro-batch."""


@dataclass(frozen=True)
class _Failure:
    batch_id: int
    stage_index: int
    error: BaseException


@dataclass(frozen=True)
class _Release:
    batch_id: int


_STOP = object()
_ID_SPAN = 1 << 32  # engine micro-batch ids stay below this; renumber() moves the stages' ids past them


def _layers(layers: LayerRange) -> str:
    """How an error names a stage's layers: "layers [2:4] of 4", as plans and `fleet ls` write them (not the
    LayerRange's repr)."""
    return f"layers [{layers.start}:{layers.stop}] of {layers.num_layers}"


def split_layers(num_layers: int, num_stages: int) -> list[LayerRange]:
    """Contiguous ranges whose sizes differ by at most one."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages "
                         f"(--stages must be between 1 and the number of layers)")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for index in range(num_stages):
        stop = start + base + (1 if index < extra else 0)
        ranges.append(LayerRange(start, stop, num_layers))
        start = stop
    return ranges


class _StageWorker(threading.Thread):
    def __init__(self, index: int, executor: StageExecutor, inbox: queue.Queue[object],
                 outbox: queue.Queue[object]) -> None:
        super().__init__(name=f"stage-{index}", daemon=True)
        self.index = index
        self.executor = executor
        self.inbox = inbox
        self.outbox = outbox

    def run(self) -> None:
        while (message := self.inbox.get()) is not _STOP:
            if isinstance(message, _Release):
                self._release(message)
            elif isinstance(message, _Failure):
                self.outbox.put(message)
            elif isinstance(message, Forward):
                self._step(message)
        self.outbox.put(_STOP)

    def _release(self, message: _Release) -> None:
        """Free the micro-batch's state. A failure is logged, never raised: it would end this worker, and
        every later step of every micro-batch would wait for it forever."""
        try:
            self.executor.release(message.batch_id)
        except Exception:
            log.exception("stage %d could not release micro-batch %d", self.index, message.batch_id)
        self.outbox.put(message)

    def _step(self, message: Forward) -> None:
        try:
            self.outbox.put(self.executor.run(message))
        except Exception as error:  # handed to the driver, which raises it with the stage named (and this
            # traceback as its cause): logged at debug only, or every failure printed a traceback before its error
            log.debug("stage %d failed on micro-batch %d", self.index, message.micro_batch_id, exc_info=True)
            self.outbox.put(_Failure(message.micro_batch_id, self.index, error))


class LocalPipeline:
    """k stages of an exported model in this process. Use as a context manager or call close()."""

    def __init__(self, model_dir: Path, num_stages: int = 1, settings: CompileSettings | None = None,
                 manifest: Manifest | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = manifest or load_manifest(self.model_dir)
        self.ranges = split_layers(self.manifest.spec.num_layers, num_stages)
        settings = settings or CompileSettings()
        context = self.manifest.spec.max_context
        executors = [StageExecutor(Stage(self.model_dir, self.manifest, layers, settings), context)
                     for layers in self.ranges]
        self.stages = tuple(executor.stage for executor in executors)  # compiled, in chain order
        self._executors = tuple(executors)
        self._queues: list[queue.Queue[object]] = [queue.Queue() for _ in range(len(executors) + 1)]
        self._inline = executors[0] if len(executors) == 1 else None
        self._done: deque[ForwardResult | _Failure] = deque()  # the inline stage's results, in order
        self._ids = ChainIds(_ID_SPAN, itertools.count(0, _ID_SPAN).__next__)  # the first run keeps its ids
        self._workers = [] if self._inline else [
            _StageWorker(index, executor, self._queues[index], self._queues[index + 1])
            for index, executor in enumerate(executors)]
        self._closed = False
        try:
            for worker in self._workers:
                worker.start()
        except BaseException:  # a Ctrl-C as Thread.start waits for its thread to run: stop those started
            self.close()
            raise

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def micro_batches(self) -> tuple[int, ...]:
        """How many micro-batches each stage holds KV state for. With worker threads, read it after close()
        (or with no step or release in flight) for a settled answer."""
        return tuple(executor.micro_batches for executor in self._executors)

    # Public methods

    def submit(self, message: Forward) -> None:
        """Queue a step; its result comes out of collect() in submission order per micro-batch."""
        if self._closed:
            raise PipelineError("the pipeline is closed")
        message = self._ids.send(message)
        if self._inline is None:
            self._queues[0].put(message)
            return
        try:
            result = self._inline.run(message)
        except Exception as error:  # raised by collect(), as a worker's failure would be
            log.debug("stage 0 failed on micro-batch %d", message.micro_batch_id, exc_info=True)
            self._done.append(_Failure(message.micro_batch_id, 0, error))
            return
        assert isinstance(result, ForwardResult)  # a lone stage is the last stage
        self._done.append(result)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        """The next finished step. Raises PipelineError if a stage failed on it. The result or failure of a
        step nobody awaits any more (its micro-batch was released while it ran) is dropped."""
        while True:
            message: object
            if self._inline is not None:
                if not self._done:  # a lone stage ran every submitted step already
                    raise PipelineError("the pipeline stopped" if self._closed else "no step in flight to collect")
                message = self._done.popleft()
            else:
                message = self._queues[-1].get(timeout=timeout)
            if isinstance(message, ForwardResult):
                if (result := self._ids.receive(message)) is None:
                    continue
                return result
            if isinstance(message, _Failure):
                if not self._ids.fail(message.batch_id):
                    continue
                stage = message.stage_index
                raise PipelineError(f"stage {stage} ({_layers(self.ranges[stage])}) failed on micro-batch "
                                    f"{self._ids.engine_id(message.batch_id)}: {message.error}") from message.error
            if message is _STOP:
                raise PipelineError("the pipeline stopped")

    def step(self, message: Forward) -> ForwardResult:
        """submit() then collect(); only for callers with one step in flight."""
        self.submit(message)
        return self.collect()

    def release(self, batch_id: int) -> None:
        """Drop a micro-batch's KV state on every stage (after its step in flight, if any, whose result is then
        dropped: nobody awaits it)."""
        batch_id = self._ids.release(batch_id)
        if self._inline is not None:
            self._inline.release(batch_id)
        else:
            self._queues[0].put(_Release(batch_id))

    def renumber(self) -> None:
        """Give the stages fresh micro-batch ids from now on: a new engine on this pipeline starts its ids at 1
        again, and the steps of a run stopped early may still be in flight under the old ones: their results
        are dropped."""
        self._ids.renumber()

    def close(self) -> None:
        """Stop the stage workers and wait for them. A worker left running holds its stage, and a compiled model
        still alive as the interpreter exits is torn down by the CPU plugin's threads with "terminate called without
        an active exception" (exit 134): a second Ctrl-C during the join (`timeout -s INT` sends one to the process
        and one to its group) abandoned the workers of an 8-stage run so. So the join goes on through a Ctrl-C
        (a worker ends once its step is done), and the Ctrl-C is raised after it."""
        if self._closed:
            return
        self._closed = True
        if self._inline is None:
            self._queues[0].put(_STOP)
        interrupted: KeyboardInterrupt | None = None
        for worker in self._workers:
            while worker.ident is not None and worker.is_alive():
                try:
                    worker.join()
                except KeyboardInterrupt as error:
                    interrupted = interrupted or error
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        try:
            self.close()
        except KeyboardInterrupt:
            if exc is None:
                raise
            # a second Ctrl-C as the stages stop: the run's own exception goes on (a first Ctrl-C's carries what
            # the streams had made)
