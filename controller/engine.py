"""The generation engine: streams as rows of micro-batches, driven through a chain of stages.

- A newcomer is prefilled alone (a one-row micro-batch), then merged into a running micro-batch with an
  AdmitRow delta, so nobody stalls for its prompt; with fewer micro-batches than wanted it becomes one.
  While streams run, a long prompt is fed in chunks of `prefill_chunk` tokens, one call each, between their
  steps: a stage runs one call at a time, so a prompt fed whole stalls every running stream for its length.
  Streams that arrive together while nothing runs are prefilled together, as the rows of the micro-batch
  they then run as (one weight read for all their prompts). At most twice the micro-batches' rows have started
  at once: the other queued streams wait unprefilled, holding nothing on the stages.
- Every running micro-batch that is not in flight gets its next step at once, so with several
  micro-batches every stage stays busy.
- Speculative rows feed their last token plus K draft tokens; the last stage verifies and returns the
  accepted count and the next token; the rejected slots die by mask (a ledger delta on the next step).
- Finished rows are dropped (beam_idx), dead slots compacted when the policy says it pays.
- When the chain breaks (ChainBroken: a PC of the fleet died) and run() was given `recover`, the engine
  takes the new chain recover() returns and resumes every unfinished stream on it: each is prefilled
  again with its prompt plus the tokens it has generated, so no token is lost or repeated. A feed may ask for
  the same move onto a chain of its choosing (switch_chain: a busy server taking back a PC that came back),
  made between two steps once the steps in flight are collected.
- A stream asked to keep its KV state (`keep_kv`, a chat's reply) leaves its micro-batch on the chain when
  it ends, as a KeptKV; the next request that `resume`s it (the chat's next turn, whose prompt repeats the
  conversation so far) rolls it back by mask to the prefix the two share and is fed only the rest.
- With a prefix cache (`prefix_cache_tokens`, a server's), prompts prefilled alone and streams that end as the
  last row of their micro-batch leave their KV state on the chain, and a newcomer whose prompt begins with the
  same tokens starts from it (controller/prefix_cache.py), then is admitted into a running micro-batch as any.

The chain is anything with submit/collect/release of Forward messages: the local threaded pipeline or
the fleet over TLS websockets.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from deskfleet.common.kv_ledger import CompactionPolicy
from deskfleet.common.logits_adjust import MAX_BIAS, MAX_BIASED_TOKENS, MAX_PENALTY, RowAdjust
from deskfleet.common.logprobs import MAX_TOP_LOGPROBS, SCORED_LOGITS_BYTES, TokenLogprob, entries
from deskfleet.common.model_spec import ModelSpec
from deskfleet.common.speculative import DEFAULT_PRIOR_ACCEPTANCE, MAX_K, AdaptiveK, RoundCost, SamplingParams
from deskfleet.common.wire import MICRO_BATCH_IDLE_S, DraftInfo, Forward, ForwardResult, LogitsAdjust, SamplingInfo

from .batch_track import BatchTrack
from .draft import Drafter, DraftRow, Proposal, mix_seed
from .generation import GenerationError, check_request
from .prefix_cache import PrefixCache, shared_prefix

log = logging.getLogger(__name__)

TokenCallback = Callable[[int, int], None]  # (stream id, token)
# Called by run() on its own thread before every step, with whether every stream is done: it may add() and cancel()
# streams; with nothing left to run it waits for work; False ends the run (a server's feed: EngineService)
Feed = Callable[[bool], bool]

# While streams run, a prompt is fed in calls of at most this many tokens, each between their steps. `bench
# admission`, 1.1B INT4 on 2 cores, a 1024-token prompt arriving while 2 streams decode: their longest wait for a
# token 3.28 s with the prompt whole, 1.55 s in chunks of 256, 0.87 s of 128, 0.20 s of 32; the newcomer's first
# token 28% / 53% / 52% later (u8 KV cache; with an f32 cache 9% / 13% / 42%): chunked, the plugin's attention
# over a cache runs a call query by query, dequantizing a u8 cache for each. 256 halves the stall for a quarter
# more wait; `--prefill-chunk` trades one for the other.
DEFAULT_PREFILL_CHUNK = 256
# A request resumes a kept KV state only where the state holds at least this share of its prompt; else the state is
# released and the prompt fed whole. On the CPU plugin a call over an existing cache runs its attention query by query
# (dequantizing a u8 cache for each), so the rest of a prompt fed there costs more a token than a whole prompt does
# (`bench admission`: 1.3-1.5x), and a resumed turn that fed 1,000 of 1,283 tokens on a 1.1B model took 5.7 s against
# 4.2 s whole (`bench chat`, a random model whose replies re-encode to other tokens).
RESUME_MIN_SHARED = 0.5
# A prefix cache's entry is given up this long after it was kept: a fleet's agents free a micro-batch idle for
# MICRO_BATCH_IDLE_S, and a step on a freed one fails
PREFIX_CACHE_MAX_AGE_S = MICRO_BATCH_IDLE_S / 2
# After a stage had no memory for a step's row copies (ForwardResult.copies_dropped), rows that end are not copied out
# for this long: each copy made before the stage short of memory would be thrown away again
COPY_BACKOFF_S = 60.0
# A state taken from the prefix cache is compacted to its live slots, whatever their number: its row is then copied
# into a running micro-batch as its first live slots (AdmitRow)
_PACKED = CompactionPolicy(min_dead_slots=1, min_dead_fraction=0.0)


class ChainBroken(RuntimeError):
    """The chain lost a stage (an agent died, a link closed, a stage stopped answering): every micro-batch's
    KV state on it is gone. A chain raises it (or a subclass) from submit() or collect()."""


Recover = Callable[[ChainBroken], "StageChain"]  # a new chain to resume on; raises to give up
# switch_chain's opener: the chain to move the run onto, or None to stay on the one it runs on
ChainSwitch = Callable[[], "StageChain | None"]


class StageChain(Protocol):
    """Where the engine sends steps. A chain that several engines use one after the other (a chat's) also has
    renumber(): fresh micro-batch ids for the next engine, whose ids start at 1 again while steps of a run
    stopped early may still be in flight (LocalPipeline and FleetPipeline have it). A chain whose results cross a
    thread or a network may also have `last_arrival_s`: the perf_counter time the result collect() returned last
    reached the controller (FleetPipeline has it), so that adaptive K tells the chain's round trip from the time
    a result waited for the driver; without it, the driver's own collect time stands in."""

    def submit(self, message: Forward) -> None: ...

    def collect(self, timeout: float | None = None) -> ForwardResult: ...

    def release(self, batch_id: int) -> None: ...


@dataclass(frozen=True)
class StreamRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    ignore_eos: bool = False
    # tokens that end this stream as EOS does (e.g. the chat template's end of turn, where the model's
    # generation config does not list it)
    stop_token_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seed: int = 0
    speculative: bool = True  # draft this stream when the engine has a drafter
    arrival_step: int = 0  # admitted once the engine has collected this many steps (tests, benches)
    # Leave this stream's KV state on the chain when it ends (Engine.kept_kv); it then runs in a micro-batch of
    # its own, never batched with other streams.
    keep_kv: bool = False
    # A KeptKV of an earlier run on this engine's chain: only the prompt after the prefix it shares is fed.
    resume: KeptKV | None = None
    # The log-probability of each generated token, and of the `logprobs` most likely tokens at each (0 to
    # MAX_TOP_LOGPROBS; None: none), computed by the last stage (StreamResult.logprobs, Engine.latest_logprob)
    logprobs: int | None = None
    # Also each prompt token's after the first, as the prompt is fed (StreamResult.prompt_logprobs: an echo of the
    # prompt's log-probabilities, to score a text); needs `logprobs`, and no `resume` (its prefix is not fed)
    prompt_logprobs: bool = False
    # The API's penalties over the tokens generated so far and its logit bias (token id, bias), which the last stage
    # applies to the logits before it picks or samples (common/logits_adjust.py); the log-probabilities stay the raw
    # distribution's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


class KeptKV:
    """A finished stream's KV state left on its chain (StreamRequest.keep_kv): its micro-batch, holding `tokens`
    (its prompt and every token it generated but the last, which was never fed) on every stage.

    Give it to one later request on the same chain as `resume` (a chat's next turn), or release() it: until then
    it holds its KV state on every stage (a fleet's agents free a micro-batch idle for MICRO_BATCH_IDLE_S). It stays
    the caller's until the run of the engine it was given to starts (which takes it, or releases it where it holds
    too little of the prompt): an engine that never runs leaves it to the caller to release. A run stopped early
    renumbers the chain (StageChain), after which no kept state of the chain from before can be resumed or released
    by id: keep one per chain user at a time, as a chat does."""

    def __init__(self, chain: StageChain, track: BatchTrack, tokens: list[int]) -> None:
        self.chain = chain
        self.tokens = tuple(tokens)
        self._track: BatchTrack | None = track

    @property
    def micro_batch_id(self) -> int:
        if self._track is None:
            raise ValueError("this KeptKV was resumed or released already: a kept KV state serves one request")
        return self._track.micro_batch_id

    def shared_prefix(self, prompt_ids: list[int]) -> int:
        """How many of the prompt's first tokens its KV holds already (at most all but the prompt's last, which
        must be fed for the first token)."""
        return shared_prefix(self.tokens, prompt_ids)

    def take(self) -> BatchTrack:
        """The micro-batch, for the engine that resumes it (once)."""
        if self._track is None:
            raise ValueError("this KeptKV was resumed or released already: a kept KV state serves one request")
        track, self._track = self._track, None
        return track

    def release(self) -> None:
        """Free its KV state on every stage (logged, not raised, where the chain is broken); no-op when taken."""
        if self._track is not None:
            _release_quietly(self.chain, self.take().micro_batch_id)


@dataclass(frozen=True)
class StreamResult:
    stream_id: int
    tokens: list[int]
    prompt_tokens: int
    first_token_s: float  # from the engine's start
    last_token_s: float  # from the engine's start: its last token, or its latest where it was stopped (Ctrl-C)
    stopped_by_eos: bool
    reused_tokens: int = 0  # of the prompt, held by the kept KV state it resumed (not fed)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one for each token, where the request asked
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # one for each prompt token after the first, where asked

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens a second after the first (which the prompt's prefill makes); None with fewer than two tokens,
        where there is no decoding to time. A stream stopped early is timed to its latest token (it said 0.0)."""
        decoded = len(self.tokens) - 1
        span = self.last_token_s - self.first_token_s
        return decoded / span if decoded > 0 and span > 0 else None


@dataclass(frozen=True)
class EngineOptions:
    max_rows: int = 8  # streams per micro-batch
    # A micro-batch's rows at most while streams prefilled ahead (_admission_room) wait for a row, every
    # micro-batch being full: such a stream joins one past max_rows rather than stall after its first token for as
    # long as the running replies take (a server's 9th to 12th request on 8 rows: nothing for 4 s). It holds the
    # micro-batch's positions, not its own: more KV memory than waiting. 0: max_rows (generate's: its baselines run
    # streams one at a time with max_rows 1); at most twice max_rows, as many as are prefilled ahead
    rows_when_waiting: int = 0
    micro_batches: int = 1  # in flight at once; the number of stages keeps every stage busy
    k_min: int = 1
    k_max: int = 8
    fixed_k: int | None = None
    compaction: CompactionPolicy = field(default_factory=CompactionPolicy)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens a call at most; 0: a whole prompt in one call
    # Tokens of finished prompts' KV states kept on the chain for later requests that share their prefix
    # (controller/prefix_cache.py); 0: none kept
    prefix_cache_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_rows < 1 or self.micro_batches < 1:
            raise ValueError(f"max_rows and micro_batches must be at least 1, got {self.max_rows} and "
                             f"{self.micro_batches}")
        if self.rows_when_waiting and not self.max_rows <= self.rows_when_waiting <= 2 * self.max_rows:
            raise ValueError(f"rows_when_waiting must be 0 (max_rows) or from max_rows ({self.max_rows}) to twice it "
                             f"(as many streams as are prefilled ahead: _admission_room), got {self.rows_when_waiting}")
        if not 1 <= self.k_min <= self.k_max <= MAX_K:
            raise ValueError(f"need 1 <= k_min <= k_max <= {MAX_K}, got {self.k_min} and {self.k_max}")
        if self.fixed_k is not None and not 0 <= self.fixed_k <= MAX_K:
            raise ValueError(f"fixed_k must be from 0 to {MAX_K}, got {self.fixed_k}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be 0 (whole prompts) or more, got {self.prefill_chunk}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be 0 (no prefix cache) or more, got {self.prefix_cache_tokens}")


@dataclass
class _Stream:
    stream_id: int
    request: StreamRequest
    tokens: list[int] = field(default_factory=list)
    batch: int | None = None
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    done: bool = False
    stopped_by_eos: bool = False
    started: bool = False
    resume: KeptKV | None = None  # StreamRequest.resume until run() takes (or releases) it
    resumed: BatchTrack | None = None  # the kept micro-batch it starts from, once taken
    reused: int = 0  # prompt tokens already in that micro-batch's KV state
    cached: bool = False  # that micro-batch came from the prefix cache: once prefilled, admitted as any newcomer
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one a token, where the request asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., where the request asked

    @property
    def resumes(self) -> bool:
        """Starts from a kept KV state (its request's `resume`, or the prefix cache's)."""
        return self.resumed is not None or self.resume is not None

    @property
    def keeps_own_batch(self) -> bool:
        """Runs alone in its micro-batch: its KV state is kept, or it starts from one its request gave."""
        return self.request.keep_kv or (self.resumes and not self.cached)

    @property
    def confirmed(self) -> list[int]:
        return self.request.prompt_ids + self.tokens

    @property
    def confirmed_count(self) -> int:
        return len(self.request.prompt_ids) + len(self.tokens)


@dataclass(frozen=True)
class Failover:
    """One move onto a new chain during run(): what broke (or, for a switch_chain, why it moved), and how many
    streams resumed on the new chain."""

    error: str
    after_steps: int  # steps collected before the chain broke
    resumed_streams: int
    switched: bool = False  # asked for (switch_chain), not a break


@dataclass
class _InFlight:
    message: Forward
    drafts: list[list[int]]  # per row of the message
    sent_at: float
    draft_seconds: float
    prefill: bool
    # per row: whether the step's token is the row's next one (a prefill chunk that does not end the row's
    # prompt is not); None: every row's is
    takes_token: list[bool] | None = None
    # a prefill call was on the chain during this step, which then waited for it too: its round trip is not
    # what a round costs, and adaptive K does not learn from it
    beside_prefill: bool = False


@dataclass
class EngineTimings:
    """Where a run's driver thread spent its time, for benchmarks that ask why a configuration is as fast as it
    is: proposing (the drafter, on the controller), waiting for the chain's next result, and the round trip of
    each drafted step (sent to verified; not those beside a prefill)."""

    draft_seconds: float = 0.0
    wait_seconds: float = 0.0
    drafted_rounds: int = 0
    round_trip_seconds: float = 0.0


class Engine:
    """Runs streams to completion through `chain`. Call add() for each request, then run()."""

    def __init__(self, chain: StageChain, spec: ModelSpec, draft: Drafter | None = None,
                 options: EngineOptions | None = None, learned_k: AdaptiveK | None = None) -> None:
        """learned_k: the adaptive K of an earlier run with the same drafter and chain (a chat's previous turn):
        this run goes on from what it learned (AdaptiveK.carried) instead of from the prior, unless K is fixed or
        its bounds differ from `options`'."""
        self.chain = chain
        self.spec = spec
        self.draft = draft
        self.options = options = options or EngineOptions()
        if draft is not None:
            draft.check_compatible(spec)
        fixed = options.fixed_k
        if fixed is not None:
            self.k_policy = AdaptiveK.fixed(fixed)
        elif learned_k is not None and (learned_k.k_min, learned_k.k_max) == (options.k_min, options.k_max):
            self.k_policy = learned_k.carried()
        else:
            self.k_policy = AdaptiveK(options.k_min, options.k_max, prior_alpha=draft.prior_acceptance
                                      if draft is not None else DEFAULT_PRIOR_ACCEPTANCE)
        self._streams: dict[int, _Stream] = {}
        self._next_stream = 0
        self._cancelled: set[int] = set()  # started streams to end at their next result (cancel)
        self._unstarted: dict[int, _Stream] = {}  # streams waiting for a prefill, by id (arrival order)
        self._unfinished = 0
        self._tracks: dict[int, BatchTrack] = {}  # running micro-batches
        self._prefills: dict[int, BatchTrack] = {}  # one-row micro-batches being prefilled or waiting
        self._unfed: dict[int, list[int]] = {}  # by stream id: its prefill's tokens not sent yet (later chunks)
        self._in_flight: dict[int, _InFlight] = {}
        self._next_batch = 0
        self._collected = 0
        self._started = 0.0
        self._on_token: TokenCallback | None = None
        self.failovers: list[Failover] = []
        self._switch: tuple[ChainSwitch, str] | None = None  # a move onto another chain asked for (switch_chain)
        self._copies_paused_until = -math.inf  # rows are not copied out before then (COPY_BACKOFF_S)
        self.timings = EngineTimings()
        self._driver_busy = _DriverBusy()
        self._eos = frozenset(spec.eos_token_ids)
        self._kept: dict[int, KeptKV] = {}  # by stream id: finished keep_kv streams' micro-batches
        self.prefix_cache = PrefixCache(options.prefix_cache_tokens, PREFIX_CACHE_MAX_AGE_S, RESUME_MIN_SHARED)
        # by source micro-batch id: prompts kept at their admission, cached once the admitting step has run
        self._cache_pending: dict[int, KeptKV] = {}
        # by micro-batch id: micro-batches whose rows all ended, stepped once more to copy them out (_flush)
        self._flushing: dict[int, BatchTrack] = {}
        # by stream id: prompt tokens a stateful drafter still lacks (a resumed stream's kept prefix), fed to it a
        # chunk a call while other streams run; the stream drafts nothing until it has them
        self._draft_unfed: dict[int, list[int]] = {}

    # Public methods

    def add(self, request: StreamRequest) -> int:
        """Queue a stream; raises GenerationError naming what is wrong with it (ValueError: a `resume` of another
        chain's, or one resumed already)."""
        check_request(self.spec, request.prompt_ids, request.max_new_tokens)
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationError(f"logprobs must be 0-{MAX_TOP_LOGPROBS} most likely tokens, not {request.logprobs}")
        _check_adjust(self.spec, request)
        if request.prompt_logprobs and (request.logprobs is None or request.resume is not None):
            raise GenerationError("the prompt's log-probabilities need logprobs (0 or more most likely tokens), and "
                                  "the whole prompt fed (no kept KV state to resume)")
        stream_id = self._next_stream
        self._next_stream += 1
        stream = _Stream(stream_id, request)
        if request.resume is not None:
            kept = request.resume
            if kept.chain is not self.chain:
                raise ValueError("the kept KV state is on another chain than this engine's")
            if any(other.resume is kept for other in self._streams.values()):
                raise ValueError("a kept KV state serves one request: it was given to another of this engine's")
            self._next_batch = max(self._next_batch, kept.micro_batch_id)  # new micro-batches get other ids
            stream.resume = kept  # taken when the run starts: until then the caller owns it
        self._streams[stream_id] = self._unstarted[stream_id] = stream
        self._unfinished += 1
        return stream_id

    def cancel(self, stream_id: int) -> None:
        """End a stream before its end (its client went away). One not started yet, or whose micro-batch has no
        step in flight and no prompt left to feed (between steps, or prefilled and waiting for a row to free up),
        is dropped at once; one with a step in flight ends at that step's result (one being prefilled, once its
        prompt is in), its token of that step not taken. Its row goes as a finished stream's does; its result keeps
        the tokens made before. Call it where add() may be called during a run: on the run's thread, from its
        `feed`."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.done:
            return
        if stream_id in self._unstarted:
            del self._unstarted[stream_id]
            if stream.resume is not None:
                stream.resume.release()
                stream.resume = None
            if stream.resumed is not None:  # a kept micro-batch this run took for it: nobody else frees it
                _release_quietly(self.chain, stream.resumed.micro_batch_id)
                stream.resumed = None
            stream.done = True
            self._unfinished -= 1
            return
        for track in [*self._tracks.values(), *self._prefills.values()]:
            if stream_id in track.stream_ids and track.micro_batch_id not in self._in_flight \
                    and not self._feeding(track):
                stream.done = True
                self._unfinished -= 1
                self._retire(track, {stream_id})
                return
        self._cancelled.add(stream_id)

    def is_done(self, stream_id: int) -> bool:
        """Whether a stream of this engine has ended (its last token, or cancelled); False for one it forgot."""
        stream = self._streams.get(stream_id)
        return stream is not None and stream.done

    def forget(self, stream_id: int) -> StreamResult:
        """A finished stream's result, after which the engine holds nothing of it (a server's run is never over:
        every stream it ever ran stayed in results()). ValueError for a stream that is not done."""
        stream = self._streams.get(stream_id)
        if stream is None or not stream.done:
            raise ValueError(f"stream {stream_id} is not a finished stream of this engine")
        result = self._result_of(stream)
        del self._streams[stream_id]
        kept = self._kept.pop(stream_id, None)
        if kept is not None:  # nobody can take it now
            kept.release()
        return result

    def kept_kv(self, stream_id: int) -> KeptKV | None:
        """The KV state a finished keep_kv stream left on the chain (once; None if it did not finish in this run,
        e.g. stopped by Ctrl-C, whose run releases it)."""
        return self._kept.pop(stream_id, None)

    def run(self, on_token: TokenCallback | None = None, recover: Recover | None = None,
            feed: Feed | None = None) -> dict[int, StreamResult]:
        """Generate every queued stream to its end; results by stream id.

        When the chain raises ChainBroken: without `recover` the error propagates; with it, the engine
        resumes every unfinished stream on the chain `recover(error)` returns (which may raise to give up).
        With `feed`, the run goes on until feed returns False (Feed): streams come and go while it runs; what is
        unfinished then is released from the chain.
        """
        self._on_token = on_token
        self._started = time.perf_counter()
        try:
            self._take_resumed()
            # a step that copies ended rows out for the prefix cache (_flush) is collected before the run idles or ends
            while feed is None or feed(not self._unfinished and not self._flushing):
                if not self._unfinished and not self._flushing and self._switch is None:
                    if feed is None:
                        break
                    continue
                try:
                    if self._switch is not None:
                        self._switch_now()
                        continue
                    self._advance()
                except ChainBroken as error:
                    if recover is None:
                        raise
                    log.info("the chain broke after %d steps: %s", self._collected, error)
                    self._resume_on(recover(error), str(error))
            else:
                if self._unfinished or self._flushing:  # the feed ended the run under steps still running
                    self._abandon()
            self._release_cache()  # the states it kept on the chain are of no use past this run
        except BaseException:  # a stage's failure, a bad result, Ctrl-C: free what this run holds, then raise
            self._abandon()
            raise
        return self.results()

    def _take_resumed(self) -> None:
        """Take the kept micro-batch of every stream that resumes one: its row becomes the stream's, rolled back by
        mask to the prefix the prompt shares with it, and compacted first where that leaves many dead slots
        (every query of the prefill would scan them); one holding less than RESUME_MIN_SHARED of the prompt is
        released, the prompt fed whole."""
        for stream in self._streams.values():
            kept, stream.resume = stream.resume, None
            if kept is None:
                continue
            prompt = stream.request.prompt_ids
            shared = kept.shared_prefix(prompt)
            if shared < RESUME_MIN_SHARED * len(prompt):
                kept.release()
                continue
            self._start_from(stream, kept, shared, self.options.compaction)

    def _start_from(self, stream: _Stream, kept: KeptKV, shared: int, compaction: CompactionPolicy) -> None:
        """Make a kept micro-batch the stream's, rolled back by mask to the `shared` first tokens of its prompt and
        compacted where `compaction` says."""
        stream.reused = shared
        track = stream.resumed = kept.take()
        track.stream_ids = [stream.stream_id]
        track.reject(stream.stream_id, len(kept.tokens) - shared)
        track.compact(compaction)

    def _awaits_entry(self, stream: _Stream) -> bool:
        """Whether a newcomer waits for a KV state the prefix cache is about to keep (a prompt's or an ended row's,
        cached once the step copying it has run: a step or two) because it holds more of its prompt than any entry
        now: a chat's next turn, sent the moment its reply ended, starts from that reply's state."""
        if not self._cache_pending or not self._takes_cache(stream):
            return False
        prompt = stream.request.prompt_ids
        pending = max(kept.shared_prefix(prompt) for kept in self._cache_pending.values())
        return pending >= RESUME_MIN_SHARED * len(prompt) and pending > self.prefix_cache.best_shared(prompt)

    def _takes_cache(self, stream: _Stream) -> bool:
        """Whether a newcomer may start from the prefix cache: not one that resumes a state its request gave, keeps
        its own, scores its prompt (fed whole), or was resumed after a failover (its tokens are not its prompt's)."""
        request = stream.request
        return self.prefix_cache.enabled and not (stream.resumes or stream.tokens or request.keep_kv
                                                  or request.prompt_logprobs)

    def _start_cached(self, stream: _Stream) -> None:
        """Start a newcomer from the prefix cache's entry that shares the most of its prompt, where one shares
        enough (PrefixCache.take); its prefill then feeds only the rest."""
        request = stream.request
        if not self._takes_cache(stream):
            return
        # a stream the drafter drafts prefills it under the entry's id, which a draft model may hold still
        drafter = self.draft if self._uses_draft(stream) else None
        hit = self.prefix_cache.take(request.prompt_ids, lambda kept: drafter is None or not drafter.holds(
            kept.micro_batch_id if isinstance(kept, KeptKV) else -1))
        if hit is None:
            return
        kept, shared = hit
        assert isinstance(kept, KeptKV)
        stream.cached = True
        self._start_from(stream, kept, shared, _PACKED)

    def results(self) -> dict[int, StreamResult]:
        """Every stream's tokens so far, by stream id (after run(): the whole generation; after a run that
        raised, e.g. on Ctrl-C: what was generated before it stopped)."""
        return {stream.stream_id: self._result_of(stream) for stream in self._streams.values()}

    def latest_logprob(self, stream_id: int) -> TokenLogprob | None:
        """The log-probabilities of the stream's latest token (for an on_token callback); None where its request
        did not ask, or before its first token."""
        stream = self._streams[stream_id]
        return stream.logprobs[-1] if stream.request.logprobs is not None and stream.logprobs else None

    def prompt_logprobs(self, stream_id: int) -> tuple[TokenLogprob, ...] | None:
        """The log-probabilities of the stream's prompt tokens after the first, as far as they are fed (all of them
        once its first token came); None where its request did not ask."""
        stream = self._streams[stream_id]
        return tuple(stream.prompt_logprobs) if stream.request.prompt_logprobs else None

    @staticmethod
    def _result_of(stream: _Stream) -> StreamResult:
        return StreamResult(stream.stream_id, list(stream.tokens), len(stream.request.prompt_ids), stream.first_token_s,
                            stream.last_token_s, stream.stopped_by_eos, stream.reused,
                            tuple(stream.logprobs) if stream.request.logprobs is not None else None,
                            tuple(stream.prompt_logprobs) if stream.request.prompt_logprobs else None)

    def accepted_histogram(self) -> dict[int, int]:
        return self.k_policy.accepted_histogram()

    def mean_accepted(self) -> float:
        return self.k_policy.mean_accepted()

    def mean_k(self) -> float:
        """Draft tokens a row's drafted round proposed, on average over the run (AdaptiveK.mean_proposed)."""
        return self.k_policy.mean_proposed()

    # Private methods: scheduling

    def _advance(self) -> None:
        """Start what can start, then take one finished step."""
        self._start_arrived()
        self._merge_prefilled()
        self._continue_prefills()  # after the merge: a prefill that became a running stream now counts as one
        self._launch_idle()
        if not self._in_flight:
            if any(s.request.arrival_step > self._collected for s in self._unstarted.values()):
                self._collected += 1  # nothing runs until the next arrival: let time pass
                return
            raise GenerationError("the engine has nothing in flight but streams are not done")
        self._collect_one()

    def _collect_one(self) -> None:
        """Take the next step's result from the chain (waiting for it)."""
        waited_from = time.perf_counter()
        result = self.chain.collect()
        collected_at = time.perf_counter()
        self.timings.wait_seconds += collected_at - waited_from
        arrived_at = getattr(self.chain, "last_arrival_s", None)
        self._on_result(result, arrived_at if isinstance(arrived_at, float) and arrived_at > 0 else collected_at)

    def switch_chain(self, open_new: ChainSwitch, why: str) -> None:
        """Ask run() to move onto the chain `open_new` gives (a feed's call, on run()'s thread). Before its next
        step, run() collects every step in flight (their tokens count), releases every micro-batch on the chain
        (so that a re-plan `open_new` makes sees the memory they held) and queues every unfinished stream for a
        prefill of its prompt and tokens so far, as after a failover; then asks `open_new`. With a chain, the streams
        run on it (`why` is what the failover record says; the caller closes the old one); with None, on the chain
        they ran on. Either way their tokens are those of an uninterrupted run. What `open_new` raises ends the run,
        as any failure does; a chain that breaks meanwhile goes to run()'s `recover` as any break does."""
        self._switch = (open_new, why)

    def _switch_now(self) -> None:
        """switch_chain's move, between two steps."""
        assert self._switch is not None
        open_new, why = self._switch
        self._switch = None
        while self._in_flight:  # a flush step one of them starts is collected too
            self._collect_one()
        resumed = self._requeue_started()
        chain = open_new()
        if chain is not None:
            self.chain = chain
            self.failovers.append(Failover(why, self._collected, resumed, switched=True))

    def _resume_on(self, chain: StageChain, error: str) -> None:
        """Forget every micro-batch and queue every unfinished stream that had started for a prefill of its
        prompt plus its tokens so far on `chain` (_requeue_started); `error`: what broke the old one."""
        resumed = self._requeue_started()
        self.chain = chain
        self.failovers.append(Failover(error, self._collected, resumed))

    def _requeue_started(self) -> int:
        """Forget every micro-batch and queue every unfinished stream that had started for a prefill of its prompt
        plus its tokens so far; how many were queued so.

        The micro-batches are released on the chain first: a chain that broke by timing out (the fleet's
        step timeout: its links are open, the agents alive) still holds their KV state on every stage, for the
        agents' idle limit (10 minutes), beside what the resumed streams take on the same PCs. A chain whose
        link closed sends nothing (FleetPipeline.release), so this costs the common case nothing."""
        self._release_held()
        self._tracks.clear()
        self._prefills.clear()
        self._in_flight.clear()
        self._unfed.clear()  # each resumed stream's prefill starts again, from its confirmed tokens
        self._draft_unfed.clear()
        resumed = 0
        for stream in self._streams.values():
            stream.resumed, stream.reused = None, 0  # a kept KV state stays on the old chain (released there)
            if stream.stream_id in self._cancelled:  # its client went away: not fed again on the new chain
                stream.done = True
                self._unfinished -= 1
                continue
            if stream.started and not stream.done:
                stream.started, stream.batch = False, None
                self._unstarted[stream.stream_id] = stream
                resumed += 1
        self._cancelled.clear()
        self._unstarted = dict(sorted(self._unstarted.items()))  # arrival order
        return resumed

    def _abandon(self) -> None:
        """After run() stopped early: release every micro-batch this run opened on the chain and in the drafter
        (those with a step in flight too: the chain frees them after that step and drops its result), so the
        chain (a chat's, which the next reply reuses with a new engine) holds nothing of this run. Nothing
        here waits on the chain, and nothing hides the error run() raises: a broken chain's agents free idle
        micro-batches themselves."""
        self._release_held()
        renumber = getattr(self.chain, "renumber", None)
        if callable(renumber):  # the next engine's ids must not meet this run's steps still in flight
            renumber()
        self._tracks.clear()
        self._prefills.clear()
        self._in_flight.clear()
        self._unfed.clear()
        self._draft_unfed.clear()

    def _release_held(self) -> None:
        """Release every micro-batch this run holds, on the chain and in the drafter (it outlives the run: a
        chat reuses it), those with a step in flight too; nothing here waits on the chain or raises."""
        for stream in self._streams.values():  # kept states given to this run but not taken yet (stopped as it began)
            if stream.resume is not None:
                kept, stream.resume = stream.resume, None
                kept.release()  # now: a run stopped early renumbers the chain, after which its id names nothing
        tracks = [*self._tracks.values(), *self._prefills.values()]
        # the kept micro-batches of streams that ended in this run, and those of queued streams not started yet
        tracks += [kept.take() for kept in self._kept.values()]
        self._kept.clear()
        tracks += [kept.take() for kept in self._cache_pending.values()]
        self._cache_pending.clear()
        tracks += list(self._flushing.values())
        self._flushing.clear()
        self.prefix_cache.clear()
        tracks += [stream.resumed for stream in self._unstarted.values() if stream.resumed is not None]
        # A step in flight that admits a prefilled stream has taken that source off its track: a stage that
        # refused the step (or a Ctrl-C before the stage ran it) still holds it, and only this names it.
        in_flight_sources = {source for flight in self._in_flight.values() for source in flight.message.admit_from}
        held = ({track.micro_batch_id for track in tracks} | {source for track in tracks for source in track.admit_from}
                | set(self._in_flight) | in_flight_sources)
        for batch_id in sorted(held):
            if self.draft is not None and self.draft.has_batch(batch_id):
                _release_quietly(self.draft, batch_id)
            _release_quietly(self.chain, batch_id)

    def _release_cache(self) -> None:
        """Free every KV state the prefix cache holds, and those it was to hold once their admission ran."""
        for kept in self._cache_pending.values():
            kept.release()
        self._cache_pending.clear()
        self.prefix_cache.clear()

    def _new_batch_id(self) -> int:
        self._next_batch += 1
        return self._next_batch

    def _uses_draft(self, stream: _Stream) -> bool:
        return self.draft is not None and stream.request.speculative

    def _start_arrived(self) -> None:
        if not self._unstarted:
            return
        room = self._admission_room()
        if room <= 0:
            return
        arrived: list[_Stream] = []
        for stream in self._unstarted.values():
            if len(arrived) == room:
                break
            if stream.request.arrival_step <= self._collected and not self._awaits_entry(stream):
                arrived.append(stream)
        for stream in arrived:
            self._start_cached(stream)
        for group in self._prefill_groups(arrived):
            resumed = group[0].resumed  # a stream that starts from a kept KV state is alone in its group
            track = resumed or BatchTrack(self._new_batch_id(), self.spec.max_context)
            for stream in group:
                stream.started = True
                del self._unstarted[stream.stream_id]
                if resumed is None:
                    track.add_row(stream.stream_id)
                # sent by _continue_prefills; confirmed: the prompt, plus the tokens so far of a stream resumed
                # on a new chain; less the prefix a kept KV state holds already
                self._unfed[stream.stream_id] = stream.confirmed[stream.reused:]
            self._prefills[track.micro_batch_id] = track

    def _continue_prefills(self) -> None:
        """Send the next call of the prefills with prompt tokens left, in arrival order. While streams run, one
        prefill call at a time: each runs between their steps, and the calls of N newcomers at once would make
        them wait N chunks a step (the first newcomer's first token comes sooner, too)."""
        for track in self._prefills.values():
            if not self._feeding(track):
                continue
            if self._tracks and any(flight.prefill for flight in self._in_flight.values()):
                return
            if track.micro_batch_id not in self._in_flight:
                self._send_prefill_chunk(track)

    def _feeding(self, track: BatchTrack) -> bool:
        """Whether a prefill still has prompt tokens to send."""
        return any(stream_id in self._unfed for stream_id in track.stream_ids)

    def _send_prefill_chunk(self, track: BatchTrack) -> None:
        """Feed each row of a prefill its next `prefill_chunk` prompt tokens while other streams run, else the
        rest of its prompt (a row whose prompt is fed already idles: its first token came with the chunk that
        ended its prompt); a row takes the step's token only where this call ends its prompt.

        With nothing running nobody waits for the prompt, and chunks would only make it dearer (see
        DEFAULT_PREFILL_CHUNK)."""
        chunk = self.options.prefill_chunk if self._tracks else 0
        if any(self._streams[stream_id].request.prompt_logprobs for stream_id in track.stream_ids):
            # every fed position's logits come back to be scored: a chunk whose logits fit SCORED_LOGITS_BYTES
            fits = max(1, SCORED_LOGITS_BYTES // (4 * self.spec.vocab_size * track.rows))
            chunk = min(chunk, fits) if chunk else fits
        feed: list[list[int]] = []
        takes_token: list[bool] = []
        scored: list[list[int]] = []
        for stream_id in track.stream_ids:
            stream = self._streams[stream_id]
            left = self._unfed.pop(stream_id, [])
            piece, rest = (left[:chunk], left[chunk:]) if chunk else (left, [])
            if rest:
                self._unfed[stream_id] = rest
            feed.append(piece)
            takes_token.append(bool(piece) and not rest)
            scored.append(_scored_ids(stream, stream.confirmed_count - len(left), len(piece)))
        if len(feed) == 1 and self._uses_draft(self._streams[track.stream_ids[0]]):
            self._feed_draft(track, feed[0])  # only streams prefilled alone draft (see _prefill_groups)
        self._send(track, feed, prefill=True, takes_token=takes_token,
                   scored=scored if any(token >= 0 for row in scored for token in row) else None)

    def _feed_draft(self, track: BatchTrack, tokens: list[int]) -> None:
        """The drafter's share of a prefill call, chunk for chunk: a draft model prefills in the driver's thread,
        so a whole prompt there would stall the running streams as the target's would. A resumed stream's drafter
        also needs the prefix the kept KV state holds (it keeps no state of its own between runs): that goes first,
        a chunk a call while other streams run, the rest with the stream's next steps (_catch_up_draft)."""
        assert self.draft is not None
        stream = self._streams[track.stream_ids[0]]
        backlog = self._draft_unfed.pop(stream.stream_id, [])
        first_call = not self.draft.has_batch(track.micro_batch_id)
        if first_call:
            backlog = stream.confirmed[:stream.reused]
        backlog += tokens
        chunk = self.options.prefill_chunk if self._tracks else 0
        piece, rest = (backlog[:chunk], backlog[chunk:]) if chunk else (backlog, [])
        if first_call:
            self.draft.prefill(track.micro_batch_id, stream.stream_id, piece)
        else:
            self.draft.extend(track.micro_batch_id, stream.stream_id, piece)
        if rest:
            self._draft_unfed[stream.stream_id] = rest

    def _catch_up_draft(self, track: BatchTrack, stream: _Stream) -> None:
        """Feed the drafter the next chunk of the prompt it lacks (see _feed_draft), with the stream's step."""
        assert self.draft is not None
        backlog = self._draft_unfed.pop(stream.stream_id)
        chunk = self.options.prefill_chunk if len(self._tracks) > 1 or self._prefills else 0
        piece, rest = (backlog[:chunk], backlog[chunk:]) if chunk else (backlog, [])
        self.draft.extend(track.micro_batch_id, stream.stream_id, piece)
        if rest:
            self._draft_unfed[stream.stream_id] = rest

    def _admission_room(self) -> int:
        """How many more streams may start now: the rows of every micro-batch, and as many newcomers again,
        prefilled and ready to merge as rows free up (a micro-batch whose rows all end at one step takes a
        whole row's worth of them in one admitting step: admitting costs a copy of the micro-batch's KV state,
        so newcomers trickling in one a step ran 8-row batches of equal streams 2.5x slower). The others wait
        unprefilled, in arrival order: a prefill holds its KV state (and a session) on every stage until its
        stream runs, and runs ahead of the running micro-batches' next steps (800 queued prompts were all
        prefilled before any stream's first token, each holding its cache on every stage until it ran). With
        options.rows_when_waiting (serve's), those prefilled ahead join a full micro-batch instead of waiting for a
        row (_pick_target), up to it."""
        started = sum(track.rows for track in self._tracks.values()) + \
            sum(track.rows for track in self._prefills.values())
        return 2 * self.options.max_rows * self.options.micro_batches - started

    def _prefill_groups(self, arrived: list[_Stream]) -> list[list[_Stream]]:
        """Which newcomers to prefill together, as the rows of one micro-batch.

        Streams that arrive while nothing runs (the start of a run, or after a lull) and draft nothing are
        prefilled together in the micro-batches they will then run as: one weight read serves all their
        prompts (8 prompts of 32 tokens: about 2x faster than 8 one-row prefills on one core). Every other
        newcomer is prefilled alone and merged into a running micro-batch without stalling it.
        """
        if self._tracks or self._prefills or len(arrived) < 2:
            return [[stream] for stream in arrived]
        plain = [stream for stream in arrived if not self._uses_draft(stream) and not stream.resumes
                 and not stream.request.keep_kv]
        count = min(self.options.micro_batches, len(plain))
        grouped = plain[: count * self.options.max_rows]
        groups: list[list[_Stream]] = [grouped[index::count] for index in range(count)] if count else []
        taken = {stream.stream_id for stream in grouped}
        return groups + [[stream] for stream in arrived if stream.stream_id not in taken]

    def _merge_prefilled(self) -> None:
        """Move prefilled micro-batches into running ones (or run them as their own)."""
        for batch_id, track in list(self._prefills.items()):
            if track.micro_batch_id in self._in_flight or self._feeding(track):
                continue
            stream = self._streams[track.stream_ids[0]]
            target = self._pick_target()
            # A group prefilled together runs as its own micro-batch, and so does one with deltas the
            # stages have not seen (a row of its group finished at once): admission moves a whole
            # one-row state, which the stages' copy of this micro-batch would not be.
            # So does a stream whose drafter still lacks part of its prompt (fed with its own steps).
            if track.rows > 1 or track.pending or stream.keeps_own_batch or stream.stream_id in self._draft_unfed \
                    or (target is None and len(self._tracks) < self.options.micro_batches):
                del self._prefills[batch_id]
                self._tracks[batch_id] = track
                for stream_id in track.stream_ids:
                    self._streams[stream_id].batch = batch_id
                continue
            if target is None:
                continue  # every micro-batch is full: wait for a row to free up
            del self._prefills[batch_id]
            fed = track.next_position(stream.stream_id)
            keep = self.prefix_cache.enabled and not stream.request.keep_kv
            target.admit(stream.stream_id, batch_id, fed, keep_source=keep)
            if keep:  # the stages keep the prompt's micro-batch: cached once the admitting step has run
                self._cache_pending[batch_id] = KeptKV(self.chain, track, stream.confirmed[:fed])
            stream.batch = target.micro_batch_id
            if self._uses_draft(stream):
                assert self.draft is not None
                self.draft.merge(target.micro_batch_id, stream.stream_id, batch_id)

    def _pick_target(self) -> BatchTrack | None:
        """The running micro-batch a prefilled stream joins: the one of fewest rows under max_rows, else, every one
        full, under rows_when_waiting (a micro-batch that keeps its own rows, a kept chat's, takes no one); None:
        start another micro-batch, or wait for a row."""
        if len(self._tracks) < self.options.micro_batches:
            return None  # better: start another micro-batch to keep the stages busy
        joinable = [track for track in self._tracks.values()
                    if not any(self._streams[stream_id].keeps_own_batch for stream_id in track.stream_ids)]
        # a micro-batch whose drafter still lacks part of a row's prompt takes no one until it has caught up (a few
        # steps): one under max_rows is waited for, not passed over for a full one grown past it
        settling = {track.micro_batch_id for track in joinable
                    if any(stream_id in self._draft_unfed for stream_id in track.stream_ids)}
        for limit in (self.options.max_rows, self.options.rows_when_waiting):
            under = [track for track in joinable if track.rows < limit]
            ready = [track for track in under if track.micro_batch_id not in settling]
            if ready:
                return min(ready, key=lambda track: track.rows)
            if under:
                return None  # wait for one to settle
        return None

    def _launch_idle(self) -> None:
        for track in self._tracks.values():
            if track.micro_batch_id in self._in_flight or track.rows == 0:
                continue
            streams = [self._streams[stream_id] for stream_id in track.stream_ids]
            self._send_decode(track, streams)

    def _send_decode(self, track: BatchTrack, streams: list[_Stream]) -> None:
        proposal = self._propose(track, streams)
        drafts = [proposal.tokens.get(stream.stream_id, []) if proposal else [] for stream in streams]
        feed = [[stream.tokens[-1], *drafts[index]] for index, stream in enumerate(streams)]
        draft_info = None
        if proposal is not None:
            width = max(len(tokens) for tokens in drafts)
            ids = np.zeros((len(streams), width), dtype=np.int64)  # [B, K]
            for row, tokens in enumerate(drafts):
                ids[row, : len(tokens)] = tokens
            probs = None
            if proposal.probs:
                probs = np.zeros((len(streams), width, self.spec.vocab_size), dtype=np.float32)  # [B, K, V]
                for row, stream in enumerate(streams):
                    if stream.stream_id in proposal.probs:
                        q = proposal.probs[stream.stream_id]
                        probs[row, : q.shape[0]] = q
            draft_info = DraftInfo(tuple(len(tokens) for tokens in drafts), ids, probs, one_hot=proposal.one_hot)
        self._send(track, feed, prefill=False, draft=draft_info, drafts=drafts,
                   draft_seconds=proposal.seconds if proposal else 0.0)

    def _propose(self, track: BatchTrack, streams: list[_Stream]) -> Proposal | None:
        if self.draft is None or not self.draft.has_batch(track.micro_batch_id):
            return None
        for stream in streams:
            if stream.stream_id in self._draft_unfed:
                self._catch_up_draft(track, stream)
        k = self.k_policy.k
        rows = [DraftRow(stream.stream_id, stream.confirmed, min(k, self._room(stream)),
                         None if stream.request.sampling.greedy else stream.request.sampling, stream.request.seed)
                for stream in streams if self._uses_draft(stream) and stream.stream_id not in self._draft_unfed]
        if not any(row.k for row in rows):
            return None
        proposal = self.draft.propose(track.micro_batch_id, rows)
        self.timings.draft_seconds += proposal.seconds
        return proposal if any(proposal.tokens.values()) else None  # nothing proposed: a plain step

    def _room(self, stream: _Stream) -> int:
        """Draft tokens this stream can still use: never past max_new_tokens or the context."""
        left = stream.request.max_new_tokens - len(stream.tokens) - 1
        context_left = self.spec.max_context - stream.confirmed_count - 1
        return max(0, min(left, context_left))

    def _send(self, track: BatchTrack, feed: list[list[int]], prefill: bool, draft: DraftInfo | None = None,
              drafts: list[list[int]] | None = None, draft_seconds: float = 0.0,
              takes_token: list[bool] | None = None, scored: list[list[int]] | None = None) -> None:
        """`scored`: per row, the token whose log-probability each fed position returns, -1 none
        (Forward.scored_ids); None: no row's."""
        streams = [self._streams[stream_id] for stream_id in track.stream_ids]
        # a prefill chunk that does not end a row's prompt returns it no token: nothing to ask for, unless the row
        # scores its prompt tokens
        asked = tuple(-1 if stream.request.logprobs is None or (
            takes_token is not None and not takes_token[row] and not (scored and max(scored[row], default=-1) >= 0))
            else stream.request.logprobs for row, stream in enumerate(streams))
        adjust = LogitsAdjust.of([_row_adjust(stream) for stream in streams]) \
            if any(stream.request.adjusts() for stream in streams) else None  # None too where no row changes
        message = track.step(feed, draft=draft, sampling=self._sampling(track, streams), adjust=adjust,
                             logprobs=asked if max(asked, default=-1) >= 0 or scored else None,
                             scored_ids=_padded(scored, max((len(row) for row in feed), default=0)) if scored else None)
        if prefill:
            for flight in self._in_flight.values():
                flight.beside_prefill = True
        beside_prefill = any(flight.prefill for flight in self._in_flight.values())
        self._in_flight[track.micro_batch_id] = _InFlight(message, drafts or [[] for _ in feed], time.perf_counter(),
                                                          draft_seconds, prefill, takes_token, beside_prefill)
        self.chain.submit(message)

    def _sampling(self, track: BatchTrack, streams: list[_Stream]) -> SamplingInfo | None:
        if all(stream.request.sampling.greedy for stream in streams):
            return None
        # Keyed by the position of the first token this step samples: a resumed stream's prefill (its prompt plus
        # its tokens so far) draws what the step it replaces would have drawn, never what its first token drew.
        seeds = tuple(mix_seed(stream.request.seed, stream.confirmed_count, 0) for stream in streams)
        return SamplingInfo(temperatures=tuple(s.request.sampling.temperature for s in streams),
                            top_ks=tuple(self._wire_top_k(s.request.sampling.top_k) for s in streams),
                            top_ps=tuple(s.request.sampling.top_p for s in streams), seeds=seeds)

    def _wire_top_k(self, top_k: int) -> int:
        """top_k as a step carries it: one at or above the vocabulary keeps every token, as 0 (off) does, and
        the wire takes no number past int64 (an agent refused such a step mid-run)."""
        return top_k if top_k < self.spec.vocab_size else 0

    # Private methods: results

    def _on_result(self, result: ForwardResult, arrived_at: float) -> None:
        """Take one step's result; `arrived_at`: when it reached the controller (perf_counter)."""
        flight = self._in_flight.pop(result.micro_batch_id)
        self._collected += 1
        now = time.perf_counter() - self._started
        if result.micro_batch_id in self._flushing:  # its rows' copies are made: they may be resumed now
            self._cache_copies(flight.message.copy_into, result.copies_dropped)
            del self._flushing[result.micro_batch_id]
            self.chain.release(result.micro_batch_id)
            return
        track = self._tracks.get(result.micro_batch_id) or self._prefills[result.micro_batch_id]
        finished: set[int] = set()
        for row, stream_id in enumerate(flight.message.stream_ids):
            stream = self._streams[stream_id]
            if flight.message.scored_ids is not None and stream_id not in self._cancelled:
                stream.prompt_logprobs += _scored_of(result, row, flight.message.scored_ids[row], stream.request)
            if flight.takes_token is not None and not flight.takes_token[row]:
                continue  # a prefill chunk that did not end this row's prompt
            if stream_id in self._cancelled:  # its client went away: the row goes, as a finished stream's does
                self._cancelled.discard(stream_id)
                stream.done = True
                self._unfinished -= 1
                finished.add(stream_id)
                continue
            proposed = flight.drafts[row]
            accepted = result.accepted_counts[row] if result.accepted_counts is not None else 0
            confirmed_before = stream.confirmed_count
            if proposed:
                track.reject(stream_id, len(proposed) - accepted)
                assert self.draft is not None
                self.draft.after_verify(result.micro_batch_id, stream_id, confirmed_before, len(proposed), accepted)
                self.k_policy.record_round(len(proposed), accepted)
            if not stream.tokens:
                stream.first_token_s = now
            tokens = [*proposed[:accepted], result.next_token_ids[row]]
            if self._extend(stream, tokens, now, self._logprobs_of(result, row, tokens, stream.request.logprobs)):
                finished.add(stream_id)
        if any(flight.drafts) and not flight.prefill and not flight.beside_prefill:
            self._record_cost(flight, arrived_at)
        # every stage has copied those rows now: the kept micro-batches may be resumed
        for source in flight.message.admit_from:
            kept = self._cache_pending.pop(source, None)
            if kept is not None:
                self.prefix_cache.put(kept)
        self._cache_copies(flight.message.copy_into, result.copies_dropped)
        self._retire(track, finished)

    def _cache_copies(self, copies: tuple[int, ...], dropped: bool) -> None:
        """A step's row copies (CopyRow) have been made: the prefix cache keeps them. Where a stage had no memory for
        them (ForwardResult.copies_dropped), the stages before it made them and the rest did not: they are freed."""
        if dropped and copies:
            log.info("a stage had no memory for %d row copies of the prefix cache: they are not kept, and no row is "
                     "copied out for %.0f s", len(copies), COPY_BACKOFF_S)
            self._copies_paused_until = time.monotonic() + COPY_BACKOFF_S
        for copy in copies:
            kept = self._cache_pending.pop(copy, None)
            if kept is None:
                continue
            if dropped:
                kept.release()
            else:
                self.prefix_cache.put(kept)

    @staticmethod
    def _logprobs_of(result: ForwardResult, row: int, tokens: list[int], top: int | None) -> list[TokenLogprob] | None:
        """The log-probabilities the last stage returned with a row's tokens, where its stream asked."""
        if top is None:
            return None
        if result.token_logprobs is None or result.top_logprob_ids is None or result.top_logprobs is None:
            raise RuntimeError(f"the last stage returned no log-probabilities for micro-batch {result.micro_batch_id} "
                               f"step {result.step_id}, whose row {row} asked for them")
        if result.top_logprobs.shape[2] < top:
            raise RuntimeError(f"the last stage returned {result.top_logprobs.shape[2]} likeliest tokens for "
                               f"micro-batch {result.micro_batch_id} step {result.step_id}, whose row {row} asked "
                               f"for {top}")
        return entries(tokens, result.token_logprobs[row], result.top_logprob_ids[row], result.top_logprobs[row], top)

    def _extend(self, stream: _Stream, tokens: list[int], now: float,
                logprobs: list[TokenLogprob] | None = None) -> bool:
        """Append tokens (and their log-probabilities, where the stream asked) up to EOS (or a stop token of the
        stream) or max_new_tokens; True when the stream is done."""
        eos = self._eos
        for at, token in enumerate(tokens):
            stream.tokens.append(int(token))
            if logprobs is not None:
                stream.logprobs.append(logprobs[at])
            stream.last_token_s = now
            hit_eos = (int(token) in eos or int(token) in stream.request.stop_token_ids) \
                and not stream.request.ignore_eos
            done = hit_eos or len(stream.tokens) >= stream.request.max_new_tokens
            if done:  # before the callback: one that raises must leave results() consistent with the tokens
                stream.done, stream.stopped_by_eos = True, hit_eos
                self._unfinished -= 1
            if self._on_token is not None:
                self._on_token(stream.stream_id, int(token))
            if done:
                return True
        return False

    def _retire(self, track: BatchTrack, finished: set[int]) -> None:
        batch_id = track.micro_batch_id
        kept = [stream_id for stream_id in finished if self._streams[stream_id].request.keep_kv]
        if kept:  # alone in its micro-batch (keeps_own_batch)
            self._kept[kept[0]] = self._keep(track, self._streams[kept[0]])
            return
        cached = self._cached_end(track, finished)
        if cached is not None:  # the micro-batch's last row ends: it stays, as the prefix cache's
            self.prefix_cache.put(self._keep(track, cached))
            return
        if self._flush(track, finished):
            return
        if finished:
            if len(finished) < track.rows:  # rows go on: a step will carry copies of the ended rows out
                for stream_id in sorted(finished):
                    self._copy_out(track, self._streams[stream_id])
            track.drop(finished)
            for stream_id in finished:
                self._draft_unfed.pop(stream_id, None)
            if self.draft is not None:
                self.draft.drop(batch_id, finished)
        if track.rows == 0:
            self._tracks.pop(batch_id, None)
            self._prefills.pop(batch_id, None)
            self.chain.release(batch_id)
            for source in track.admit_from:  # prefills whose admission never stepped (their streams left first)
                self._cache_pending.pop(source, None)
                self.chain.release(source)
            for copy in track.copy_into:  # copies of rows never stepped: nothing of them is on the stages
                self._cache_pending.pop(copy, None)
            return
        track.compact(self.options.compaction)
        if self.draft is not None:
            self.draft.compact(batch_id, self.options.compaction)

    def _cached_end(self, track: BatchTrack, finished: set[int]) -> _Stream | None:
        """The stream whose end leaves its micro-batch to the prefix cache: the micro-batch's one row, where it was fed
        all its confirmed tokens but the last (not one cancelled mid-prompt); None where the cache is off or rows go
        on. A micro-batch of several rows is not kept (its state would keep them all until a next step, which a kept
        one never has), nor one with admissions it has not stepped."""
        if not self.prefix_cache.enabled or track.rows != 1 or len(finished) != 1 or track.admit_from \
                or track.copy_into:  # its copies would wait for a step a kept micro-batch may never have
            return None
        stream = self._streams[next(iter(finished))]
        return stream if self._keeps_end(track, stream) else None

    def _flush(self, track: BatchTrack, finished: set[int]) -> bool:
        """Where every row of a micro-batch of several ends at once, copy each one the prefix cache may keep out of it
        (_copy_out) with one more step, which feeds one of them its last token (never fed: the copies are taken
        before) and whose result is dropped; the micro-batch is released after it. False where the cache is off or
        nothing is to be kept (the caller releases the micro-batch)."""
        if not self.prefix_cache.enabled or track.rows < 2 or len(finished) < track.rows or track.admit_from:
            return False
        ends = [self._streams[stream_id] for stream_id in sorted(finished)]
        ends = [stream for stream in ends if self._keeps_end(track, stream)]
        if not ends:
            return False
        copied = [stream for stream in ends if self._copy_out(track, stream)]
        if not copied:  # none fits the cache: nothing for the step to make
            return False
        fed = copied[0]  # rolled back to its confirmed tokens but the last: that one goes in at a position it has
        track.drop(finished - {fed.stream_id})
        batch_id = track.micro_batch_id
        self._tracks.pop(batch_id, None)
        self._prefills.pop(batch_id, None)
        if self.draft is not None and self.draft.has_batch(batch_id):
            self.draft.release(batch_id)
        for stream_id in finished:
            self._draft_unfed.pop(stream_id, None)
        self._flushing[batch_id] = track
        message = track.step([[fed.confirmed[-1]]])
        self._in_flight[batch_id] = _InFlight(message, [[]], time.perf_counter(), 0.0, prefill=False)
        self.chain.submit(message)
        return True

    def _keeps_end(self, track: BatchTrack, stream: _Stream) -> bool:
        """Whether the prefix cache keeps a stream that ended: not a keep_kv stream's (its own micro-batch is kept),
        nor one cancelled mid-prompt (its KV state holds less than its confirmed tokens but the last)."""
        return self.prefix_cache.enabled and not stream.request.keep_kv and bool(stream.tokens) \
            and track.next_position(stream.stream_id) >= stream.confirmed_count - 1

    def _copy_out(self, track: BatchTrack, stream: _Stream) -> bool:
        """For the prefix cache, a stream that ended beside rows that go on: its row, holding its confirmed tokens
        but the last, is copied into a micro-batch of its own by the track's next step (CopyRow), and cached once
        that step has run. Not a keep_kv stream's (its own micro-batch is kept), nor one cancelled mid-prompt; True
        where the copy is queued."""
        if not self._keeps_end(track, stream) or stream.confirmed_count - 1 > self.prefix_cache.capacity_tokens:
            return False  # (a state larger than the whole cache would be released as soon as it was made)
        if time.monotonic() < self._copies_paused_until:  # a stage had no memory for the last ones
            return False
        fed = stream.confirmed[:-1]
        track.reject(stream.stream_id, track.next_position(stream.stream_id) - len(fed))
        copy_id = self._new_batch_id()
        track.copy_row(stream.stream_id, copy_id)
        self._cache_pending[copy_id] = KeptKV(
            self.chain, BatchTrack.copied(copy_id, self.spec.max_context, stream.stream_id, len(fed)), fed)
        return True

    def _keep(self, track: BatchTrack, stream: _Stream) -> KeptKV:
        """Leave a finished stream's micro-batch on the chain, holding its confirmed tokens but the last (never
        fed): drafts accepted past its end (an EOS or stop token inside a round) are rolled back."""
        self._tracks.pop(track.micro_batch_id, None)
        self._prefills.pop(track.micro_batch_id, None)
        self._draft_unfed.pop(stream.stream_id, None)
        fed = stream.confirmed[:-1]
        track.reject(stream.stream_id, track.next_position(stream.stream_id) - len(fed))
        if self.draft is not None and self.draft.has_batch(track.micro_batch_id):
            self.draft.release(track.micro_batch_id)  # the drafter's state is prefilled again on resume
        return KeptKV(self.chain, track, fed)

    def _record_cost(self, flight: _InFlight, arrived_at: float) -> None:
        """Tell adaptive K what this drafted round cost: the chain's round trip (sent to the result's arrival),
        the draft model's time a token, and the driver's share (common/speculative.py RoundCost): how many
        micro-batches it drafts for, and its own time a round besides drafting, over the steps since the last
        drafted round."""
        proposed = max(len(tokens) for tokens in flight.drafts)
        round_trip = max(arrived_at - flight.sent_at, 0.0)
        self.timings.drafted_rounds += 1
        self.timings.round_trip_seconds += round_trip
        now = time.perf_counter()
        busy = self._driver_busy.update(now, self.timings, self._collected)
        drafting = sum(1 for batch_id in self._tracks if self.draft is not None and self.draft.has_batch(batch_id))
        self.k_policy.record_cost(RoundCost(fixed_seconds=round_trip,
                                            draft_seconds_per_token=flight.draft_seconds / max(proposed, 1),
                                            drafting_batches=max(drafting, 1), driver_seconds=busy),
                                  verified=proposed + 1)


def _check_adjust(spec: ModelSpec, request: StreamRequest) -> None:
    """GenerationError naming a penalty or logit bias out of the API's range or the vocabulary."""
    for name, value in (("presence_penalty", request.presence_penalty),
                        ("frequency_penalty", request.frequency_penalty)):
        if not (math.isfinite(value) and abs(value) <= MAX_PENALTY):
            raise GenerationError(f"{name} must be from {-MAX_PENALTY} to {MAX_PENALTY}, not {value}")
    if len(request.logit_bias) > MAX_BIASED_TOKENS:
        raise GenerationError(f"logit_bias takes at most {MAX_BIASED_TOKENS} tokens, not {len(request.logit_bias)}")
    if len({token for token, _ in request.logit_bias}) != len(request.logit_bias):
        raise GenerationError("logit_bias names a token twice")
    for token, bias in request.logit_bias:
        if not 0 <= token < spec.vocab_size:
            raise GenerationError(f"logit_bias token {token} is outside the vocabulary (size {spec.vocab_size})")
        if not (math.isfinite(bias) and abs(bias) <= MAX_BIAS):
            raise GenerationError(f"logit_bias of token {token} must be from {-MAX_BIAS} to {MAX_BIAS}, not {bias}")


def _row_adjust(stream: _Stream) -> RowAdjust | None:
    """A stream's penalties over the tokens it generated so far, and its logit bias (Forward.adjust); None: none."""
    request = stream.request
    if not request.logit_bias and not (stream.tokens and (request.presence_penalty or request.frequency_penalty)):
        return None  # nothing to change (a prompt's prefill: no token generated yet), nor logits to fetch for it
    if request.presence_penalty or request.frequency_penalty:
        counted, counts = np.unique(np.asarray(stream.tokens, dtype=np.int64), return_counts=True)
    else:
        counted = counts = np.zeros(0, dtype=np.int64)
    return RowAdjust(request.presence_penalty, request.frequency_penalty, counted, counts.astype(np.int64),
                     np.array([token for token, _ in request.logit_bias], dtype=np.int64),
                     np.array([bias for _, bias in request.logit_bias], dtype=np.float32))


def _scored_ids(stream: _Stream, start: int, count: int) -> list[int]:
    """A prefill call's Forward.scored_ids row for `stream` fed its confirmed tokens [start, start + count): at each
    position, the prompt token that follows it where the request asks for the prompt's log-probabilities and it is
    not scored yet (a prompt fed again on a new chain is scored once), else -1."""
    prompt = stream.request.prompt_ids
    if not stream.request.prompt_logprobs:
        return [-1] * count
    scored_up_to = len(stream.prompt_logprobs)  # prompt tokens 1..scored_up_to have theirs
    return [prompt[at + 1] if scored_up_to < at + 1 < len(prompt) else -1 for at in range(start, start + count)]


def _padded(rows: list[list[int]], width: int) -> np.ndarray:
    """[B, width] int64 of each row, -1 past its end."""
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for row, values in enumerate(rows):
        out[row, : len(values)] = values
    return out


def _scored_of(result: ForwardResult, row: int, scored_ids: np.ndarray, request: StreamRequest) -> list[TokenLogprob]:
    """The log-probabilities the last stage returned at a row's scored positions (Forward.scored_ids)."""
    columns = np.flatnonzero(scored_ids >= 0)
    if not len(columns):
        return []
    if result.scored_logprobs is None or result.scored_top_ids is None or result.scored_top_logprobs is None \
            or result.scored_logprobs.shape[1] < len(scored_ids):
        raise RuntimeError(f"the last stage returned no log-probabilities of the prompt for micro-batch "
                           f"{result.micro_batch_id} step {result.step_id}, whose row {row} asked for them at "
                           f"{len(columns)} positions")
    top = request.logprobs or 0
    if result.scored_top_logprobs.shape[2] < top:
        raise RuntimeError(f"the last stage returned {result.scored_top_logprobs.shape[2]} likeliest tokens of the "
                           f"prompt for micro-batch {result.micro_batch_id} step {result.step_id}, whose row {row} "
                           f"asked for {top}")
    return entries(scored_ids[columns].tolist(), result.scored_logprobs[row, columns],
                   result.scored_top_ids[row, columns], result.scored_top_logprobs[row, columns], top)


class _DriverBusy:
    """The driver thread's own time a step besides drafting and waiting for the chain (taking results, masks,
    building and sending steps), from the engine's timings between two drafted rounds."""

    def __init__(self) -> None:
        self._last: tuple[float, float, float, int] | None = None  # (time, wait, draft, steps collected)

    def update(self, now: float, timings: EngineTimings, collected: int) -> float:
        """Seconds a step since the previous call (0.0 on the first)."""
        last, self._last = self._last, (now, timings.wait_seconds, timings.draft_seconds, collected)
        if last is None or collected <= last[3]:
            return 0.0
        busy = (now - last[0]) - (timings.wait_seconds - last[1]) - (timings.draft_seconds - last[2])
        return max(busy, 0.0) / (collected - last[3])


def _release_quietly(holder: StageChain | Drafter, batch_id: int) -> None:
    """holder.release(batch_id), logging instead of raising: one that fails (a broken chain) must not keep
    the rest of a stopped run's micro-batches from being released."""
    try:
        holder.release(batch_id)
    except Exception as error:
        log.info("could not release micro-batch %d of the stopped run: %s", batch_id, error)
