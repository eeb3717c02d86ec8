"""EngineService: streams submitted from other threads while others run are exact, cancellable, and a failed run
costs only its own streams."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from deskfleet.common.logprobs import TokenLogprob
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.stop_signal import Stopped, StopSignal
from deskfleet.controller import engine_service
from deskfleet.controller.engine import ChainBroken, EngineOptions, StreamRequest
from deskfleet.controller.engine_service import (
    ChainOpener,
    EngineService,
    OpenedChain,
    ServiceBusy,
    ServiceClosed,
    StreamEnd,
)
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import PromptLookupDraft
from tests.log_records import records_of

from .test_engine import F32, run_streams

PROMPTS = [[1, 5, 9, 2, 7], [1, 3, 3, 3, 3, 3, 3, 3], [1, 8], [1, 4, 6, 4, 6, 4, 6], [1, 2, 11, 13, 17, 19, 23],
           [1, 30, 31]]
WAIT_S = 120


class Sink:
    def __init__(self, first_tokens: int = 0) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob | None] = []
        self.ended = threading.Event()
        self.end_of: StreamEnd | None = None
        self.got_tokens = threading.Event()
        self._first_tokens = first_tokens

    def token(self, token: int, logprob: TokenLogprob | None) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if len(self.tokens) >= self._first_tokens:
            self.got_tokens.set()

    def end(self, end: StreamEnd) -> None:
        self.end_of = end
        self.ended.set()

    def wait(self) -> StreamEnd:
        assert self.ended.wait(WAIT_S), "the stream did not end"
        assert self.end_of is not None
        return self.end_of


def _local(model: Path, stages: int, opened: list[int] | None = None):  # type: ignore[no-untyped-def]
    manifest = load_manifest(model)

    @contextmanager
    def open_chain() -> Iterator[OpenedChain]:
        if opened is not None:
            opened.append(1)
        with LocalPipeline(model, stages, F32, manifest) as pipeline:
            yield OpenedChain(pipeline)

    return open_chain


def _wrapped(model: Path, stages: int, wrap: Callable[[LocalPipeline], Any]) -> tuple[ChainOpener, list[Any]]:
    """An opener of local stages whose chain is `wrap(pipeline)`, and the list of the chains it opened."""
    manifest = load_manifest(model)
    chains: list[Any] = []

    @contextmanager
    def open_chain() -> Iterator[OpenedChain]:
        with LocalPipeline(model, stages, F32, manifest) as pipeline:
            chains.append(wrap(pipeline))
            yield OpenedChain(chains[-1])

    return open_chain, chains


def _service(model: Path, stages: int = 2, max_streams: int = 64, draft: PromptLookupDraft | None = None,
             opener=None) -> EngineService:  # type: ignore[no-untyped-def]
    return EngineService(opener or _local(model, stages), load_manifest(model).spec, draft,
                         lambda chain: EngineOptions(max_rows=3, micro_batches=2), max_streams=max_streams)


def _solo(model: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    return run_streams(model, [StreamRequest(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)])[0]


def test_streams_that_arrive_while_others_run_give_their_solo_tokens(target: Path) -> None:
    # every request is a stream of the one running engine: admitted between the others' steps, batched with them,
    # some drafted by prompt lookup and some not; each must give what it gives alone on one stage
    lengths = [24, 40, 8, 30, 16, 12]
    with _service(target, draft=PromptLookupDraft()) as service:
        sinks = [Sink(first_tokens=3) for _ in PROMPTS]
        for index, (prompt, sink) in enumerate(zip(PROMPTS, sinks, strict=True)):
            service.submit(StreamRequest(prompt, max_new_tokens=lengths[index], ignore_eos=True,
                                         speculative=index % 2 == 0), sink)
            if index in (1, 3):  # the next ones arrive once the earlier ones run
                assert sink.got_tokens.wait(WAIT_S)
        ends = [sink.wait() for sink in sinks]
        assert service.live_streams == 0
    for index, (prompt, sink, end) in enumerate(zip(PROMPTS, sinks, ends, strict=True)):
        assert end.error is None and not end.cancelled and end.result is not None
        assert end.result.tokens == sink.tokens == _solo(target, prompt, lengths[index]), index


def test_a_cancelled_stream_ends_with_what_it_made_and_the_others_go_on(target: Path) -> None:
    with _service(target) as service:
        long, short = Sink(first_tokens=5), Sink()
        ticket = service.submit(StreamRequest(PROMPTS[0], max_new_tokens=400, ignore_eos=True), long)
        service.submit(StreamRequest(PROMPTS[1], max_new_tokens=30, ignore_eos=True), short)
        assert long.got_tokens.wait(WAIT_S)
        service.cancel(ticket)
        end = long.wait()
        assert end.cancelled and end.error is None and end.result is not None
        made = end.result.tokens
        assert 5 <= len(made) < 400 and made == long.tokens
        assert made == _solo(target, PROMPTS[0], len(made))
        assert short.wait().result.tokens == _solo(target, PROMPTS[1], 30)  # type: ignore[union-attr]
        # the cancelled row is gone from the chain: a newcomer runs as it does alone
        later = Sink()
        service.submit(StreamRequest(PROMPTS[2], max_new_tokens=20, ignore_eos=True), later)
        assert later.wait().result.tokens == _solo(target, PROMPTS[2], 20)  # type: ignore[union-attr]
        service.cancel(ticket)  # ended already: nothing
        assert service.live_streams == 0


def test_a_request_the_engine_refuses_ends_with_its_error_and_busy_and_closed_are_refused(target: Path) -> None:
    context = load_manifest(target).spec.max_context
    with _service(target, max_streams=2) as service:
        refused = Sink()
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=context), refused)
        end = refused.wait()
        assert end.result is None and end.error is not None and "context" in end.error
        first, second = Sink(first_tokens=1), Sink()
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=300, ignore_eos=True), first)
        service.submit(StreamRequest(PROMPTS[1], max_new_tokens=300, ignore_eos=True), second)
        with pytest.raises(ServiceBusy, match="--max-streams 2"):
            service.submit(StreamRequest(PROMPTS[2], max_new_tokens=4), Sink())
        assert first.got_tokens.wait(WAIT_S)
    # closed under two running streams: both end, saying so
    for sink in (first, second):
        assert sink.wait().error == "the server stopped"
    with pytest.raises(ServiceClosed):
        service.submit(StreamRequest(PROMPTS[2], max_new_tokens=4), Sink())


class BreakingChain:
    """A local chain whose collect() breaks once `breaks` is set, and takes `delay` seconds more a step."""

    def __init__(self, pipeline: LocalPipeline, delay: float = 0.0) -> None:
        self.pipeline = pipeline
        self.breaks = threading.Event()
        self.delay = delay

    def submit(self, message: object) -> None:
        self.pipeline.submit(message)  # type: ignore[arg-type]

    def collect(self, timeout: float | None = None) -> object:
        time.sleep(self.delay)
        result = self.pipeline.collect(timeout)
        if self.breaks.is_set():
            raise ChainBroken("a stage went away")
        return result

    def release(self, batch_id: int) -> None:
        self.pipeline.release(batch_id)

    def renumber(self) -> None:
        self.pipeline.renumber()

    @property
    def num_stages(self) -> int:
        return self.pipeline.num_stages


def test_a_failed_run_ends_its_streams_and_the_next_request_opens_the_chain_again(target: Path) -> None:
    open_chain, chains = _wrapped(target, 2, BreakingChain)
    with _service(target, opener=open_chain) as service:
        broken = Sink(first_tokens=3)
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=300, ignore_eos=True), broken)
        assert broken.got_tokens.wait(WAIT_S)
        chains[0].breaks.set()
        end = broken.wait()
        assert end.error is not None and "a stage went away" in end.error
        after = Sink()
        service.submit(StreamRequest(PROMPTS[3], max_new_tokens=20, ignore_eos=True), after)
        assert after.wait().result.tokens == _solo(target, PROMPTS[3], 20)  # type: ignore[union-attr]
        assert len(chains) == 2 and service.runs_failed == 1


def test_a_chain_that_does_not_open_fails_the_start(target: Path) -> None:
    @contextmanager
    def no_chain() -> Iterator[OpenedChain]:
        raise RuntimeError("the model was never deployed")
        yield  # type: ignore[unreachable]

    service = _service(target, opener=no_chain)
    with pytest.raises(ServiceClosed, match="the chain could not be opened: the model was never deployed"):
        service.start()


def test_a_stream_prefilled_and_waiting_for_a_row_is_dropped_at_once_when_cancelled(target: Path) -> None:
    # one row a micro-batch, one micro-batch: a newcomer is prefilled and then waits for the running stream's row.
    # Cancelled there, it waited (holding its KV and a place under max_streams) until that long stream ended.
    manifest = load_manifest(target)
    service = EngineService(_local(target, 1), manifest.spec, None,
                            lambda chain: EngineOptions(max_rows=1, micro_batches=1))
    with service:
        running, waiting = Sink(first_tokens=3), Sink()
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=manifest.spec.max_context - 10, ignore_eos=True),
                       running)
        assert running.got_tokens.wait(WAIT_S)
        ticket = service.submit(StreamRequest(PROMPTS[1], max_new_tokens=50, ignore_eos=True), waiting)
        deadline = time.monotonic() + WAIT_S
        while not waiting.tokens and time.monotonic() < deadline:  # its prefill gives it its first token
            time.sleep(0.005)
        service.cancel(ticket)
        end = waiting.wait()
        assert end.cancelled and end.result is not None and end.result.tokens == waiting.tokens[:1]
        assert not running.ended.is_set(), "the cancelled stream waited for the running one to end"
        assert service.live_streams == 1


class FailingOpener:
    """Opens `target`'s chain the first time, which then breaks; every later open fails."""

    def __init__(self, target: Path, fail_options: bool = False) -> None:
        self.manifest = load_manifest(target)
        self.target = target
        self.opens = 0
        self.chain: BreakingChain | None = None
        self.fail_options = fail_options

    @contextmanager
    def __call__(self) -> Iterator[OpenedChain]:
        self.opens += 1
        if self.opens > 1 and not self.fail_options:
            raise RuntimeError("no PC answers")
        with LocalPipeline(self.target, 1, F32, self.manifest) as pipeline:
            self.chain = BreakingChain(pipeline)
            yield OpenedChain(self.chain)  # type: ignore[arg-type]

    def options(self, chain: object) -> EngineOptions:
        if self.opens > 1 and self.fail_options:
            raise RuntimeError("the engine cannot be set up")
        return EngineOptions()


@pytest.mark.parametrize("fail_options", [False, True])
def test_a_chain_that_does_not_open_again_ends_the_waiting_streams_and_is_not_dialled_in_a_loop(
        target: Path, fail_options: bool) -> None:
    # the waiting stream's ticket stayed in the inbox after it was ended: the chain was opened again 196 times in
    # 2 s, and (where the failure came after the open) the stream never ended
    opener = FailingOpener(target, fail_options)
    service = EngineService(opener, load_manifest(target).spec, None, opener.options)
    with service:
        first = Sink(first_tokens=2)
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=300, ignore_eos=True), first)
        assert first.got_tokens.wait(WAIT_S)
        assert opener.chain is not None
        opener.chain.breaks.set()
        assert first.wait().error is not None
        waiting = Sink()
        service.submit(StreamRequest(PROMPTS[1], max_new_tokens=5), waiting)
        end = waiting.wait()
        assert end.error is not None and "could not be opened" in end.error
        opens = opener.opens
        time.sleep(0.5)
        assert opener.opens == opens, "the chain was opened again with nothing to run"
        assert service.live_streams == 0


class RecordingChain(BreakingChain):
    """Records how many rows each step it is given carries."""

    def __init__(self, pipeline: LocalPipeline) -> None:
        super().__init__(pipeline)
        self.rows: list[int] = []

    def submit(self, message: object) -> None:
        self.rows.append(len(message.stream_ids))  # type: ignore[attr-defined]
        super().submit(message)


def test_a_burst_of_requests_to_an_idle_engine_starts_as_one_prefill_group(target: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # requests sent at once reach the engine a little apart (a server handles them one after the other): the first
    # started alone, and the rest were prefilled one at a time and admitted one at a time into its micro-batch
    from deskfleet.controller import engine_service

    monkeypatch.setattr(engine_service, "GATHER_S", 0.05)  # the 1 ms gaps below stay under it on a loaded host
    monkeypatch.setattr(engine_service, "GATHER_MAX_S", 1.0)
    manifest = load_manifest(target)
    open_chain, chains = _wrapped(target, 1, RecordingChain)
    with EngineService(open_chain, manifest.spec, None, lambda chain: EngineOptions(max_rows=8)) as service:
        sinks = [Sink() for _ in range(4)]
        for prompt, sink in zip(PROMPTS, sinks, strict=False):
            service.submit(StreamRequest(prompt, max_new_tokens=8, ignore_eos=True), sink)
            time.sleep(0.001)
        ends = [sink.wait() for sink in sinks]
    assert chains[0].rows[0] == 4, chains[0].rows
    for prompt, end in zip(PROMPTS, ends, strict=False):
        assert end.result is not None and end.result.tokens == _solo(target, prompt, 8)


def _taking_back(target: Path, take_back: Callable[[], bool], opened: list[int]) -> EngineService:
    return EngineService(_local(target, 2, opened), load_manifest(target).spec, None,
                         lambda chain: EngineOptions(max_rows=3, micro_batches=2), take_back=take_back)


def _wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class GatedSink(Sink):
    """A sink whose first token holds the engine's thread until `go` is set: a stream that runs as long as a test
    needs."""

    def __init__(self) -> None:
        super().__init__(first_tokens=1)
        self.go = threading.Event()

    def token(self, token: int, logprob: TokenLogprob | None) -> None:
        super().token(token, logprob)
        assert self.go.wait(WAIT_S)


def test_an_idle_service_opens_its_chain_again_when_a_pc_can_be_taken_back(
        target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `serve --fleet` took back a PC that a re-plan left out only when the server started: a PC its user paused
    # and resumed, or one restarted, stayed out of the chain for as long as the server ran
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.05)
    opened: list[int] = []
    running_at_looks: list[int] = []
    back = threading.Event()

    def take_back() -> bool:
        running_at_looks.append(len(service._by_stream))  # the engine's own streams, on its own thread
        if not back.is_set():
            return False
        back.clear()  # taken back: a PC calls in once (kept set, every look reopened, and 2 could go unseen)
        return True

    service = _taking_back(target, take_back, opened)
    with service:
        _wait_until(lambda: len(running_at_looks) >= 3, "three looks")
        assert len(opened) == 1  # nothing back: the chain stays as it opened
        sink = GatedSink()
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=8, ignore_eos=True), sink)
        assert sink.got_tokens.wait(WAIT_S)
        back.set()  # a PC called in while the stream runs: nothing is opened under it
        time.sleep(0.3)
        assert len(opened) == 1
        sink.go.set()
        assert sink.wait().result is not None
        _wait_until(lambda: len(opened) >= 2, "the chain to open again")
        again = Sink()
        service.submit(StreamRequest(PROMPTS[1], max_new_tokens=12, ignore_eos=True), again)
        end = again.wait()
        assert end.error is None and end.result is not None and end.result.tokens == _solo(target, PROMPTS[1], 12)
        looks = len(running_at_looks)
        _wait_until(lambda: len(running_at_looks) >= looks + 2, "two more looks")
        assert len(opened) == 2 and service.chains_reopened == 1  # taken back once
        assert service.chain_stages == 2


def _moving(target: Path, take_back: Callable[[], bool], moves: list[int], gives_chain: bool | None = True,
            busy_s: float = engine_service.TAKE_BACK_BUSY_S) -> tuple[EngineService, list[int]]:
    """A service on 2 local stages slowed to 10 ms a step (streams that outlast the polls), whose opener's
    take_back gives a 1-stage chain (or, `gives_chain` False, none; None, raises as a re-plan that failed), noting
    the live streams at each call; and the list of the chains it opened."""
    manifest = load_manifest(target)
    opened: list[int] = []

    @contextmanager
    def open_chain() -> Iterator[OpenedChain]:
        with ExitStack() as pipelines:
            opened.append(1)
            chain = BreakingChain(pipelines.enter_context(LocalPipeline(target, 2, F32, manifest)), delay=0.01)

            def take_back_now() -> LocalPipeline | None:
                moves.append(len(service._by_stream))
                engine = service._engine
                assert engine is not None and not any(engine.is_done(stream) for stream in service._by_stream), \
                    "a stream the steps collected before the move ended waits for the re-plan"
                if gives_chain is None:
                    raise RuntimeError("the new chain did not open, and no failover was left")
                return pipelines.enter_context(LocalPipeline(target, 1, F32, manifest)) if gives_chain else None

            yield OpenedChain(chain, None, take_back_now)  # type: ignore[arg-type]

    service = EngineService(open_chain, manifest.spec, None,
                            lambda chain: EngineOptions(max_rows=3, micro_batches=chain.num_stages),  # type: ignore[attr-defined]
                            take_back=take_back, take_back_busy_s=busy_s)
    return service, opened


def _once(back: threading.Event) -> Callable[[], bool]:
    """A take-back check that says True once after `back` is set (a PC calls in once)."""
    def take_back() -> bool:
        if not back.is_set():
            return False
        back.clear()
        return True

    return take_back


@pytest.mark.parametrize("gives_chain", [True, False, None])
def test_a_busy_service_moves_its_streams_onto_a_chain_that_takes_the_pc_back(
        target: Path, monkeypatch: pytest.MonkeyPatch, gives_chain: bool | None) -> None:
    # a server whose streams never all ended at once never took back a PC a re-plan left out: it ran short of a PC
    # for as long as it stayed busy
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.05)
    back = threading.Event()
    moves: list[int] = []
    service, opened = _moving(target, _once(back), moves, gives_chain, busy_s=0.3)
    with service:
        sinks = [Sink(first_tokens=3) for _ in range(2)]
        for prompt, sink in zip(PROMPTS, sinks, strict=False):
            service.submit(StreamRequest(prompt, max_new_tokens=90, ignore_eos=True), sink)
        assert sinks[0].got_tokens.wait(WAIT_S)
        back.set()
        ends = [sink.wait() for sink in sinks]
        for prompt, sink, end in zip(PROMPTS, sinks, ends, strict=False):
            assert end.error is None and end.result is not None
            assert end.result.tokens == sink.tokens == _solo(target, prompt, 90)
        assert moves == [2]  # asked once, while both streams ran
        if gives_chain:
            time.sleep(0.3)  # idle: the PC taken back while busy is not taken back again
            assert len(opened) == 1 and service.chains_switched == 1 and service.chains_reopened == 0
            assert service.chain_stages == 1
            assert service._engine is not None and service._engine.options.micro_batches == 1  # set for the new chain
        else:  # the move took no PC back (a PC the run lost itself, a failed re-plan): the idle moment reopens
            _wait_until(lambda: service.chains_reopened == 1, "the idle moment to open the chain again")
            assert len(opened) == 2 and service.chains_switched == 0 and service.runs_failed == 0
        later = Sink()
        service.submit(StreamRequest(PROMPTS[2], max_new_tokens=12, ignore_eos=True), later)
        assert later.wait().result.tokens == _solo(target, PROMPTS[2], 12)  # type: ignore[union-attr]


def test_a_busy_service_asks_its_busy_look_while_streams_run_and_its_whole_look_when_idle(
        target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the whole look may dial a PC (TakeBackLook's stages_gone): asked between two steps, every stream waited on it
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.05)
    asked: dict[str, list[bool]] = {"whole": [], "busy": []}

    def whole() -> bool:
        asked["whole"].append(bool(service._by_stream))
        return False

    def busy() -> bool:
        asked["busy"].append(bool(service._by_stream))
        return False

    slow = _wrapped(target, 2, lambda pipeline: BreakingChain(pipeline, delay=0.01))[0]  # 60 tokens outlast polls
    service = EngineService(slow, load_manifest(target).spec, None,
                            lambda chain: EngineOptions(max_rows=3, micro_batches=2), take_back=whole,
                            take_back_while_busy=busy)
    with service:
        _wait_until(lambda: len(asked["whole"]) >= 2, "two idle looks")
        sink = Sink(first_tokens=3)
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=60, ignore_eos=True), sink)
        assert sink.wait().result is not None
    assert asked["busy"] and all(asked["busy"]) and not any(asked["whole"])


def test_a_pc_found_while_busy_is_taken_back_at_the_next_idle_moment_before_the_busy_limit(
        target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.05)  # the busy limit stays a minute
    back = threading.Event()
    looks_while_busy: list[bool] = []
    once = _once(back)

    def take_back() -> bool:
        said = once()
        if service._by_stream:
            looks_while_busy.append(said)
            if said:  # the idle moment must not wait for a next look
                monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 30.0)
        return said

    moves: list[int] = []
    service, opened = _moving(target, take_back, moves)
    with service:
        sink = Sink(first_tokens=3)
        service.submit(StreamRequest(PROMPTS[0], max_new_tokens=60, ignore_eos=True), sink)
        assert sink.got_tokens.wait(WAIT_S)
        back.set()
        end = sink.wait()
        assert end.result is not None and end.result.tokens == _solo(target, PROMPTS[0], 60)
        assert True in looks_while_busy  # found while the stream ran
        deadline = time.monotonic() + 10
        while service.chains_reopened < 1:
            assert time.monotonic() < deadline, "the idle moment waited for the next look"
            time.sleep(0.01)
        assert moves == [] and len(opened) == 2 and service.chains_switched == 0


def test_a_request_that_comes_while_the_service_looks_goes_first(target: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # the look said "take a PC back" as a request arrived: the request waited for the whole re-plan (and, where
    # the new chain did not open, failed on a server that worked)
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.05)
    opened: list[int] = []
    sink = Sink()
    opened_when_served: list[int] = []
    end_of = sink.end

    def served(end: StreamEnd) -> None:
        opened_when_served.append(len(opened))
        end_of(end)

    sink.end = served  # type: ignore[method-assign]
    looks = 0

    def take_back() -> bool:
        nonlocal looks
        looks += 1
        if looks == 1:
            service.submit(StreamRequest(PROMPTS[2], max_new_tokens=6, ignore_eos=True), sink)
        return looks == 1  # a PC calls in once: its True is acted on after the request (always True reopened
        # every look)

    service = _taking_back(target, take_back, opened)
    with service:
        end = sink.wait()
        assert end.error is None and end.result is not None and end.result.tokens == _solo(target, PROMPTS[2], 6)
        assert opened_when_served == [1]  # served on the chain it came to
        _wait_until(lambda: len(opened) >= 2, "the next idle moment's look to open the chain again")
        time.sleep(0.3)
        assert len(opened) == 2


def test_a_close_that_comes_while_the_service_looks_opens_nothing(target: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM as the look read its files: the server re-planned the fleet (a survey, pushes) on its way out
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.05)
    opened: list[int] = []
    looking = threading.Event()
    closing = threading.Event()

    def take_back() -> bool:
        looking.set()
        assert closing.wait(WAIT_S)
        _wait_until(lambda: service._closing, "close() to begin")
        return True

    service = _taking_back(target, take_back, opened)
    service.start()
    assert looking.wait(WAIT_S)
    closer = threading.Thread(target=service.close)
    closer.start()
    closing.set()
    closer.join(WAIT_S)
    assert not closer.is_alive() and len(opened) == 1


def test_a_server_whose_requests_keep_coming_still_looks(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the poll's clock started again at every idle spell: requests that came more often than it kept a server
    # from ever looking, however idle it was between them
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.3)
    looks: list[float] = []

    def take_back() -> bool:
        looks.append(time.monotonic())
        return False

    service = _taking_back(target, take_back, [])
    with service:
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            sink = Sink()
            service.submit(StreamRequest(PROMPTS[2], max_new_tokens=2, ignore_eos=True), sink)
            sink.wait()
            time.sleep(0.05)
    assert len(looks) >= 2, looks  # none before: every idle spell started the 0.3 s anew


def test_a_server_busy_but_for_short_gaps_still_asks_its_whole_look(target: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the busy look (files only) restarted the whole look's clock: a server whose streams ran all along but for
    # gaps of a few ms never asked the whole look, which alone finds a PC of its chain that lost its stage
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.2)
    asked: dict[str, int] = {"whole": 0, "busy": 0}

    def look(kind: str) -> Callable[[], bool]:
        def counted() -> bool:
            asked[kind] += 1
            return False
        return counted

    slow = _wrapped(target, 2, lambda pipeline: BreakingChain(pipeline, delay=0.01))[0]
    service = EngineService(slow, load_manifest(target).spec, None,
                            lambda chain: EngineOptions(max_rows=3, micro_batches=2), take_back=look("whole"),
                            take_back_while_busy=look("busy"))
    with service:
        time.sleep(0.3)  # the first idle look
        whole_before = asked["whole"]
        started = time.monotonic()
        while time.monotonic() - started < 2.0:  # each stream runs past a poll; the next comes at once
            sink = Sink()
            service.submit(StreamRequest(PROMPTS[0], max_new_tokens=30, ignore_eos=True), sink)
            assert sink.wait().result is not None
    assert asked["busy"] >= 2, asked
    assert asked["whole"] - whole_before >= 2, asked


class StallingChain:
    """A local chain whose collect(), once `stall` is set, waits as a step to a stalled PC does, until the service's
    stop wakes it with Stopped (as FleetPipeline's collect does)."""

    def __init__(self, pipeline: LocalPipeline, stop: StopSignal) -> None:
        self._pipeline = pipeline
        self._stop = stop
        self.stall = threading.Event()
        self.stalled = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def collect(self, timeout: float | None = None) -> Any:
        if self.stall.is_set():
            self.stalled.set()
            if not self._stop.wait(WAIT_S):
                raise ChainBroken("no result (the test's stall outlasted its wait)")
            raise Stopped("the chain was stopped")
        return self._pipeline.collect(timeout)


def test_a_close_cuts_short_a_step_waiting_for_a_stalled_pc_and_logs_no_failure(target: Path) -> None:
    # serve --fleet's SIGTERM waited for the engine's thread 30 s, twice, while a step waited for a stalled PC
    stop = StopSignal()
    opener, chains = _wrapped(target, 2, lambda pipeline: StallingChain(pipeline, stop))
    service = EngineService(opener, load_manifest(target).spec, None,
                            lambda chain: EngineOptions(max_rows=3, micro_batches=2), stop=stop)
    service.start()
    sink = Sink(first_tokens=2)
    service.submit(StreamRequest(PROMPTS[0], max_new_tokens=400, ignore_eos=True), sink)
    assert sink.got_tokens.wait(WAIT_S)
    chains[0].stall.set()
    assert chains[0].stalled.wait(WAIT_S)
    started = time.monotonic()
    with records_of(engine_service.__name__, logging.WARNING) as logged:
        service.close()
    assert time.monotonic() - started < 5 and stop.is_set()
    end = sink.wait()
    assert end.error == "the server stopped"
    assert logged.messages() == []
    assert service.runs_failed == 0


def test_a_close_cuts_short_an_opening_that_waits_for_a_re_plan(target: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # a take-back's re-plan at an idle moment (a survey, a deploy waiting for a PC to compile) held the close
    monkeypatch.setattr(engine_service, "TAKE_BACK_POLL_S", 0.05)
    stop = StopSignal()
    manifest = load_manifest(target)
    openings: list[str] = []

    @contextmanager
    def open_chain() -> Iterator[OpenedChain]:
        if openings:  # the re-opening's re-plan, which waits on a PC
            openings.append("re-plan")
            stop.wait(WAIT_S)
            stop.check("the re-plan")
        openings.append("opened")
        with LocalPipeline(target, 2, F32, manifest) as pipeline:
            yield OpenedChain(pipeline)

    service = EngineService(open_chain, manifest.spec, None, lambda chain: EngineOptions(max_rows=3),
                            take_back=lambda: True, stop=stop)
    service.start()
    _wait_until(lambda: "re-plan" in openings, "the idle moment's re-opening")
    started = time.monotonic()
    service.close()
    assert time.monotonic() - started < 5 and openings == ["opened", "re-plan"]
    assert service.runs_failed == 0
