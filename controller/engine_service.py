"""One engine that runs streams as they come, on a thread of its own: what `deskfleet serve` puts its requests on.

Every request is a stream of the same running engine (Engine.run with a feed), so streams that arrive while
others run are admitted between their steps and batched with them, as `generate`'s prompts are; a stream whose
client went away is cancelled and its row dropped. The chain (local stages, or the fleet's, which re-plans when
a PC drops out) opens at start(). If a run fails past what it can mend, every stream it held ends with the
error and the chain opens again for the next request. When its take-back check says so (a fleet's: a PC that a
re-plan left out has called in since), the service takes the PC back: at its next idle moment by opening the chain
again, or, where streams keep running for TAKE_BACK_BUSY_S, by moving them onto the chain the opener's `take_back`
makes (Engine.switch_chain), as after a failover.

Sinks are called on the engine's thread: they must return at once and not raise (a server hands the tokens to
its event loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Protocol

from deskfleet.common.logprobs import TokenLogprob
from deskfleet.common.model_spec import ModelSpec
from deskfleet.common.stop_signal import Stopped, StopSignal

from .draft import Drafter
from .engine import ChainSwitch, Engine, EngineOptions, Recover, StageChain, StreamRequest, StreamResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedChain:
    """What a chain opener gives: the chain, the failover that replaces it when it breaks (None: none), and what
    makes a chain that takes back the PCs the take-back check found while streams run (a fleet's
    FleetFailover.rejoin: None where nothing could be taken back; the opener closes the chains it made)."""

    chain: StageChain
    recover: Recover | None = None
    take_back: ChainSwitch | None = None


ChainOpener = Callable[[], AbstractContextManager[OpenedChain]]
# The engine's options for the chain opened (a fleet's number of stages is known once its chain is open)
OptionsFor = Callable[[StageChain], EngineOptions]


# An engine with nothing to run that is woken by a request waits this long for the next one, and again while they
# keep coming (at most GATHER_MAX_S), so that a burst of requests starts as one prefill group: newcomers that come
# while streams run are prefilled one at a time and each admitted with a copy of its micro-batch's KV state, which
# cost 8 users sent at once through the API half their tokens a second over 64 tokens (`bench serve`)
GATHER_S = 0.003
GATHER_MAX_S = 0.02
# A service with a take-back check (a fleet's: a PC a re-plan left out has called in since) asks it this often;
# where it says so, an idle service opens its chain again (the opening takes the PC back)
TAKE_BACK_POLL_S = 10.0
# ... and one whose streams keep running this long after it said so moves them onto a chain that takes the PC back
# (OpenedChain.take_back): every stream waits for that re-plan and is prefilled again on the new chain, as after a
# failover, a cost a server busy for a minute repays many times over the hours it would otherwise run short of a PC
TAKE_BACK_BUSY_S = 60.0


class ServiceBusy(RuntimeError):
    """As many streams as the service takes are running or waiting."""


class ServiceClosed(RuntimeError):
    """The service is stopping or stopped, or its chain could not be opened."""


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended: `result` (its tokens; None where it never started), `error` (why it failed), and
    whether it was cancelled."""

    result: StreamResult | None
    error: str | None = None
    cancelled: bool = False


class StreamSink(Protocol):
    """Where a stream's tokens and end go. A sink with a `prompt_scored(entries)` method is also given, before the
    first token, the prompt's log-probabilities where the request asked (StreamRequest.prompt_logprobs)."""

    def token(self, token: int, logprob: TokenLogprob | None) -> None:
        """A generated token, and its log-probabilities where the request asked (StreamRequest.logprobs)."""

    def end(self, end: StreamEnd) -> None: ...


@dataclass
class _Ticket:
    ticket_id: int
    request: StreamRequest
    sink: StreamSink
    stream_id: int | None = None  # once the engine took it
    cancel_asked: bool = False
    ended: bool = False
    tokens_told: int = 0  # tokens handed to the sink


@dataclass
class _Inbox:
    """What the engine's thread takes before its next step; guarded by EngineService._lock."""

    new: list[_Ticket] = field(default_factory=list)
    cancelled: list[_Ticket] = field(default_factory=list)


class EngineService:
    def __init__(self, open_chain: ChainOpener, spec: ModelSpec, draft: Drafter | None, options: OptionsFor,
                 max_streams: int = 64, take_back: Callable[[], bool] | None = None,
                 take_back_busy_s: float = TAKE_BACK_BUSY_S,
                 take_back_while_busy: Callable[[], bool] | None = None, stop: StopSignal | None = None) -> None:
        """`take_back`: asked every TAKE_BACK_POLL_S; where it says True, the service opens the chain again at its
        next idle moment (a fleet's opening takes back a PC that a re-plan left out: open_fleet_chain), or, where
        streams run for `take_back_busy_s` meanwhile, moves them onto the chain its opener's take_back makes. None:
        the chain stays as it opened. `take_back_while_busy`: the check asked while streams run instead (one that
        never waits on the network: TakeBackLook.left_out_back); None: `take_back`. `stop`: set by close(), and given
        to the opener's chain and failover (a fleet's), so that a re-plan under way or a step waiting for a stalled PC
        gives up as the service closes, rather than hold its close for up to 30 s and then be left half done."""
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        self._open_chain = open_chain
        self._stop = stop
        self._take_back = take_back
        self._take_back_while_busy = take_back_while_busy or take_back
        self._reopening = False  # the feed ended the run to open the chain again (take_back said so)
        self._last_look = time.monotonic()  # when take_back (the whole look, at idle moments) was last asked
        self._last_busy_look = self._last_look  # when take_back_while_busy was last asked (a whole look counts too)
        self._back_since: float | None = None  # when take_back last said True, not acted on yet
        self._reopen_at_idle = False  # a move while streams ran took no PC back: the next idle moment reopens
        self.take_back_busy_s = take_back_busy_s
        self.spec = spec
        self.draft = draft
        self.options = options
        self.max_streams = max_streams
        self._lock = threading.Condition()
        self._inbox = _Inbox()
        self._live: dict[int, _Ticket] = {}  # every stream submitted and not ended, by ticket id
        self._by_stream: dict[int, _Ticket] = {}  # the running engine's streams (its thread's own)
        self._next_ticket = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._chain_open = threading.Event()
        self._open_error: BaseException | None = None
        self.runs_failed = 0  # runs that failed past what their chain could mend (the chain was opened again)
        self.last_failure: str | None = None  # why the last run failed or the chain did not open; None once it opens
        # "opening" (the chain opens: at start, or again), "ok" (a chain is open), "unavailable" (the last run failed,
        # or its chain did not open: last_failure says why; the next request opens it again)
        self.state = "opening"
        self.streams_cancelled = 0  # streams that ended cancelled (their client went away, a stop sequence met)
        self.chains_reopened = 0  # times an idle service opened its chain again to take a PC back (take_back)
        self.chains_switched = 0  # times running streams moved onto a chain that took a PC back (take_back)
        self._engine: Engine | None = None  # the running engine (its chain is the one a failover went on on)
        self._fed = False  # the current run has taken its inbox at least once (a failure then ends only its streams)

    # Public methods

    def start(self, timeout: float | None = None) -> None:
        """Open the chain (compile the local stages, or open the fleet's) and start taking streams; raises
        ServiceClosed naming why the chain did not open."""
        if self._thread is not None:
            raise RuntimeError("the service was started already")
        self._thread = threading.Thread(target=self._main, name="deskfleet-engine", daemon=True)
        self._thread.start()
        if not self._chain_open.wait(timeout):
            self.close()
            raise ServiceClosed(f"the chain did not open in {timeout:g} s")
        if self._open_error is not None:
            self.close()
            if isinstance(self._open_error, Stopped):
                raise ServiceClosed("the server stopped while the chain opened") from self._open_error
            raise ServiceClosed(f"the chain could not be opened: {self._open_error}") from self._open_error

    def submit(self, request: StreamRequest, sink: StreamSink) -> int:
        """Queue a stream; its tokens and its end go to `sink`. Returns its ticket (for cancel). ServiceBusy where
        max_streams are live, ServiceClosed once close() began. A request the engine refuses (a prompt past the
        context) ends at once with the error."""
        return self.submit_all([(request, sink)])[0]

    def submit_all(self, streams: Sequence[tuple[StreamRequest, StreamSink]]) -> list[int]:
        """Queue several streams at once, all or none (an API request's choices): ServiceBusy where they would pass
        max_streams with those live, and none is queued. Their tickets, in order."""
        with self._lock:
            if self._closing:
                raise ServiceClosed("the server is stopping")
            if len(self._live) + len(streams) > self.max_streams:
                if len(streams) > 1:
                    raise ServiceBusy(f"{len(self._live)} streams are running or waiting: {len(streams)} more would "
                                      f"pass what this server takes (--max-streams {self.max_streams})")
                raise ServiceBusy(f"{len(self._live)} streams are running or waiting, as many as this server takes "
                                  f"(--max-streams {self.max_streams})")
            tickets = []
            for request, sink in streams:
                ticket_id = self._next_ticket
                self._next_ticket += 1
                ticket = self._live[ticket_id] = _Ticket(ticket_id, request, sink)
                self._inbox.new.append(ticket)
                tickets.append(ticket_id)
            self._lock.notify_all()
        return tickets

    def cancel(self, ticket_id: int) -> None:
        """End a stream early (its client went away); its sink hears the end, with what it made. No-op for a
        stream that ended."""
        with self._lock:
            ticket = self._live.get(ticket_id)
            if ticket is not None and not ticket.cancel_asked:
                ticket.cancel_asked = True
                self._inbox.cancelled.append(ticket)
                self._lock.notify_all()

    @property
    def chain_stages(self) -> int | None:
        """The stages of the chain the service runs on now (after any failover); None while none is open."""
        engine = self._engine
        return getattr(engine.chain, "num_stages", None) if engine is not None else None

    @property
    def live_streams(self) -> int:
        with self._lock:
            return len(self._live)

    def close(self, timeout: float = 30.0) -> None:
        """Stop: streams still running end with an error, the chain closes. Safe to call more than once."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._end_all("the server stopped")

    def __enter__(self) -> EngineService:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Private methods

    def _main(self) -> None:
        first = True
        while True:
            reopening, self._reopening = self._reopening, False
            if reopening and self._closing:  # close() came as the run ended: nothing is opened for no one
                return
            if not first and not reopening and not self._wait_for_work():
                return
            self._fed = False
            self.state = "opening"
            try:
                with self._open_chain() as opened:
                    self.last_failure, self.state = None, "ok"
                    self.chains_reopened += reopening
                    # the opening took back what there was (the next look finds the rest)
                    self._back_since, self._reopen_at_idle = None, False
                    if first:
                        self._chain_open.set()
                        first = False
                    self._run(Engine(opened.chain, self.spec, self.draft, self.options(opened.chain)), opened)
                if not self._reopening:
                    return  # the feed ended the run: closing
                log.info("no stream runs and the chain can take a PC back: it opens again")
            except Exception as error:  # a run's failure ends its streams, not the server
                if isinstance(error, Stopped) and not first:  # close() cut the run or the opening short
                    return
                if first:
                    self._open_error = error
                    self._chain_open.set()
                    return
                self.runs_failed += 1
                self.last_failure, self.state = str(error), "unavailable"
                if self._fed:
                    log.warning("a run failed; its streams end with the error, and the chain opens again for the "
                                "next request: %s", error)
                    self._end_all(f"the run failed: {error}", only_started=True)
                else:  # the chain did not open, or no run began on it: the streams waiting would wait for ever
                    log.warning("the chain could not be opened again: %s", error)
                    self._end_all(f"the chain could not be opened: {error}")

    def _run(self, engine: Engine, opened: OpenedChain) -> None:
        self._by_stream.clear()
        self._engine = engine
        try:
            engine.run(on_token=lambda stream_id, token: self._on_token(engine, stream_id, token),
                       recover=opened.recover, feed=lambda idle: self._feed(engine, idle, opened.take_back))
            self._reap(engine)
        except Exception as error:  # said at once: the chain's close, which may take seconds, comes after
            self.last_failure, self.state = str(error), "unavailable"
            raise
        finally:
            self._engine = None

    def _wait_for_work(self) -> bool:
        """After a failed run: wait for a stream to run (True) or for close() (False). The chain opens again only
        for a stream that waits: a chain that does not open is not dialled again and again meanwhile."""
        with self._lock:
            while not any(not ticket.ended for ticket in self._inbox.new) and not self._closing:
                self._lock.wait()
            return not self._closing

    def _feed(self, engine: Engine, idle: bool, take_back: ChainSwitch | None) -> bool:
        """Engine.run's feed: end the streams that finished, take the new and the cancelled; with nothing to run,
        wait for work. False (ends the run) once close() began. While streams run, look for a PC to take back
        (_look_while_busy)."""
        self._fed = True
        self._reap(engine)
        if idle and self._idle_until_work(engine):
            self._reopening = True
            return False
        if not idle and self._take_back is not None:
            self._look_while_busy(engine, take_back)
        with self._lock:
            if idle and self._inbox.new:  # a burst's first request: let the rest of it come (GATHER_S)
                deadline = time.monotonic() + GATHER_MAX_S
                arrived = len(self._inbox.new)
                while not self._closing and time.monotonic() < deadline:
                    self._lock.wait(min(GATHER_S, max(deadline - time.monotonic(), 0.0)))
                    if len(self._inbox.new) == arrived:
                        break
                    arrived = len(self._inbox.new)
            if self._closing:
                return False
            inbox, self._inbox = self._inbox, _Inbox()
        for ticket in inbox.new:
            if ticket.ended:  # close() ended it meanwhile
                continue
            try:
                ticket.stream_id = engine.add(ticket.request)
            except ValueError as error:  # GenerationError: a prompt past the context, a bad id
                self._end(ticket, StreamEnd(None, str(error)))
                continue
            self._by_stream[ticket.stream_id] = ticket
        if inbox.cancelled:  # a cancelled stream with no step in flight is done at once: it ends now, not a step on
            for ticket in inbox.cancelled:
                if ticket.stream_id is not None:
                    engine.cancel(ticket.stream_id)
            self._reap(engine)
        return True

    def _look_while_busy(self, engine: Engine, take_back: ChainSwitch | None) -> None:
        """Between steps while streams run: ask the take-back check once TAKE_BACK_POLL_S passed since it was last
        asked, and remember a True (the check says so once per call-in); once streams have kept running for
        take_back_busy_s since, move them onto the chain `take_back` makes (Engine.switch_chain: before the next
        step). An idle moment meanwhile opens the chain again instead (_idle_until_work)."""
        now = time.monotonic()
        if self._back_since is None:
            # a clock of its own: the busy look reads only files, and a server busy but for short gaps would
            # otherwise never ask the whole look (which finds a PC of the chain that lost its stage)
            if now - self._last_busy_look < TAKE_BACK_POLL_S:
                return
            self._last_busy_look = now
            if self._looked(self._take_back_while_busy):
                self._back_since = now
            return
        if take_back is not None and now - self._back_since >= self.take_back_busy_s:
            log.info("streams have run for %.0f s since a PC could be taken back: they move onto a chain that "
                     "takes it", now - self._back_since)
            self._back_since = None
            engine.switch_chain(lambda: self._switched(engine, take_back), "a PC was taken back while streams ran")

    def _switched(self, engine: Engine, take_back: ChainSwitch) -> StageChain | None:
        """switch_chain's opener, once the steps in flight are collected: the streams they ended end now (not after
        the re-plan), then the chain `take_back` makes, counted, with the engine's micro-batches set for its
        stages. Where it makes none, or fails (its re-plan's failure is the run's own only where the old chain broke,
        which that chain's next step says), the streams go on on the old chain, and the chain opens again at the
        next idle moment, with a failover that has lost no PC yet."""
        self._reap(engine)
        try:
            chain = take_back()
        except Stopped:  # close() cut the re-plan short: the run ends at the next step
            return None
        except Exception:
            log.warning("the streams running could not move onto a chain taking a PC back; they go on where they "
                        "ran", exc_info=True)
            chain = None
        if chain is None:
            self._reopen_at_idle = True
            return None
        self.chains_switched += 1
        engine.options = replace(engine.options, micro_batches=self.options(chain).micro_batches)
        return chain

    def _looked(self, look: Callable[[], bool] | None = None) -> bool:
        """What the take-back check (or `look`) says; False where it failed (a file being written: the next poll asks
        again)."""
        try:
            look = look or self._take_back
            assert look is not None
            return look()
        except Exception:
            log.debug("the look for a PC to take back failed", exc_info=True)
            return False

    def _idle_until_work(self, engine: Engine) -> bool:
        """With no stream running: wait for one to come, a cancel, or close() (False); True where take_back says,
        meanwhile or while streams ran (_look_while_busy), that the chain should open again. It is asked once
        TAKE_BACK_POLL_S passed since it was last asked, counted across idle spells (requests that come more often
        than that would otherwise keep it from ever being asked), and its True is acted on where no work and no
        close() came while it looked (else at the next idle moment, or by a move while busy). Meanwhile the engine's
        prefix cache gives up its entries as they pass their age (their KV state freed on the stages)."""
        cache = engine.prefix_cache
        while True:
            with self._lock:
                while not self._has_work():
                    look = self._last_look + TAKE_BACK_POLL_S - time.monotonic() if self._take_back else None
                    if self._back_since is not None or self._reopen_at_idle:
                        look = 0.0  # a PC to take back was found while streams ran
                    waits = [wait for wait in (look, cache.seconds_to_expiry()) if wait is not None]
                    if not waits:
                        self._lock.wait()
                        continue
                    if min(waits) <= 0:
                        break
                    self._lock.wait(min(waits))
                else:
                    return False
            if (expiry := cache.seconds_to_expiry()) is not None and expiry <= 0:
                cache.expire()  # on the engine's thread, as every release of its micro-batches
                continue
            if self._back_since is None and not self._reopen_at_idle:
                self._last_look = self._last_busy_look = time.monotonic()
                if self._looked():
                    self._back_since = self._last_look
            if self._back_since is not None or self._reopen_at_idle:
                with self._lock:  # work that came while it looked goes first: the PC is taken back after it
                    if not self._has_work():
                        return True

    def _has_work(self) -> bool:
        """Whether a stream, a cancel or close() waits; under self._lock."""
        return bool(self._inbox.new or self._inbox.cancelled or self._closing)

    def _on_token(self, engine: Engine, stream_id: int, token: int) -> None:
        ticket = self._by_stream.get(stream_id)
        if ticket is not None:
            scored = getattr(ticket.sink, "prompt_scored", None)
            if not ticket.tokens_told and ticket.request.prompt_logprobs and scored is not None:
                try:  # the prompt is fed: every token of it is scored
                    scored(engine.prompt_logprobs(stream_id) or ())
                except Exception:  # a sink's fault must not stop the other streams, nor lose this one its token
                    log.exception("a stream's sink failed on its prompt's log-probabilities")
            ticket.tokens_told += 1
            try:
                ticket.sink.token(token, engine.latest_logprob(stream_id))
            except Exception:
                log.exception("a stream's sink failed on a token")

    def _reap(self, engine: Engine) -> None:
        """End every stream the engine has finished, and forget it there."""
        for stream_id, ticket in list(self._by_stream.items()):
            if engine.is_done(stream_id):
                del self._by_stream[stream_id]
                result = engine.forget(stream_id)
                # cancelled: asked, and ended before its last token (a cancel that came too late changes nothing)
                cancelled = ticket.cancel_asked and len(result.tokens) < ticket.request.max_new_tokens \
                    and not result.stopped_by_eos
                self.streams_cancelled += cancelled
                self._end(ticket, StreamEnd(result, cancelled=cancelled))

    def _end(self, ticket: _Ticket, end: StreamEnd) -> None:
        with self._lock:
            if ticket.ended:
                return
            ticket.ended = True
            self._live.pop(ticket.ticket_id, None)
        try:
            ticket.sink.end(end)
        except Exception:
            log.exception("a stream's sink failed on its end")

    def _end_all(self, error: str, only_started: bool = False) -> None:
        """End every live stream with `error` (only those the failed engine had taken, with `only_started`: those
        still in the inbox run on the next chain)."""
        with self._lock:
            tickets = [ticket for ticket in self._live.values() if not only_started or ticket.stream_id is not None]
        for ticket in tickets:
            self._end(ticket, StreamEnd(None, error))
        with self._lock:  # an ended ticket is no work: left in the inbox, it would open the chain again for nothing
            self._inbox.new = [ticket for ticket in self._inbox.new if not ticket.ended]
            self._inbox.cancelled = [ticket for ticket in self._inbox.cancelled if not ticket.ended]
