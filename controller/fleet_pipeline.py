"""The fleet as a StageChain: the engine's synchronous submit/collect/release over the TLS links.

A daisy chain controller -> stage 0 -> ... -> stage n-1 -> controller: the driver sends Forward (and
ReleaseMicroBatch, which follows the micro-batch's last Forward down the chain) to the first stage's
agent; the agents relay hidden states agent to agent; the last stage's agent sends the ForwardResult
(token ids only: top-1 compression, plus the accepted count when verifying) back on the link over which
this driver said ResultsHere. n+1 hops a step, and several micro-batches in flight at once.

The links live on an asyncio loop in a background thread; every task there is owned by one TaskGroup.
The driver also holds a link to every middle stage's agent: when an agent dies its link closes (the
websocket pings notice within link.PING_INTERVAL_S + PING_TIMEOUT_S + CLOSE_TIMEOUT_S, 17 s, for a stopped
PC; at once for a killed one) and collect() raises ChainError naming that agent (and its hostname), its stage
and its address; an Error a stage reports travels down the chain to here (a first stage answers a step it refuses
on this driver's own link to it).

Micro-batch ids on the wire are the engine's ids plus a base: each chain draws a random range of its own
(_REGION_IDS ids) and takes the next base in it at every renumber (each chat turn), so two drivers, or two
turns, never address each other's KV state on a stage, and the agents send each driver the results and
refusals of its own range (ResultsHere names it to every stage's agent).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deskfleet.agent.link import Link, LinkError, RevocationSource, TlsFiles, no_revocations, open_link
from deskfleet.common import event_loop
from deskfleet.common.stop_signal import Stopped, StopSignal
from deskfleet.common.wire import Error, ErrorCode, Forward, ForwardResult, ReleaseMicroBatch, ResultsHere
from deskfleet.controller.chain_ids import ChainIds
from deskfleet.controller.engine import ChainBroken
from deskfleet.controller.fleet_deploy import (
    DeployError,
    DeploymentWatch,
    StagePlacement,
    load_deployment,
    model_id_of,
)
from deskfleet.controller.fleet_store import FleetStore, agent_label
from deskfleet.controller.own_network import LinkDeath, OwnNetworkWatch, explain

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 120.0
REPLACED_POLL_S = 1.0  # how often a collect() that waits for a result looks whether the deployment was replaced
# A step's wait grows with the tokens it feeds: a prompt (or a failover's resume: prompt plus the tokens so far)
# is one step, and a long one through slow PCs may take minutes where a decode step takes milliseconds; a fixed
# wait made such a prefill look like a stuck agent, and the re-plan (blaming no one) ran it again and again.
STEP_TIMEOUT_S_PER_TOKEN = 0.05


class ChainError(ChainBroken):
    """A step failed: an agent is unreachable or reported an error (named). `agent_id` is the agent at
    fault when the chain knows it (its link closed, it could not be dialled, or a stage's error named it in
    keeping with that stage's place in the chain: FleetPipeline._accepted_blame), else None.

    `reported_by`: where the blame is an agent's word, not the controller's own observation, the agent whose
    stage's link carried the Error that named `agent_id` (it blamed itself, its next hop, or relayed an earlier
    stage's blame); None for what the controller saw itself (a link closed, a dial failed). `stages`: the chain
    that broke, where known. The failover checks an agent's word before it leaves a PC out
    (controller/fleet_failover.py, FleetFailover._check_blame). `own_fault`: where the controller's own link to
    `agent_id` died as this PC's own network failed under it (the address it ran from lost, or its interface's link:
    FleetPipeline's own_network, asked as it died), that fault in words: no PC is to blame."""

    def __init__(self, message: str, agent_id: str | None = None, reported_by: str | None = None,
                 stages: Sequence[StagePlacement] = (), own_fault: str | None = None) -> None:
        super().__init__(message)
        self.agent_id = agent_id
        self.reported_by = reported_by if agent_id is not None else None
        self.stages = tuple(stages)
        self.own_fault = own_fault if agent_id is not None and reported_by is None else None


class DeploymentReplaced(ChainError):
    """The chain's deployment on record was replaced under it (an admin's `fleet deploy`, another run's re-plan): no PC
    failed, and going on on the new one spends none of the run's --max-failovers."""


OPEN_TIMEOUT_S = 30.0
STRAY_ERROR_LOG_S = 60.0  # how often a stage's link logs the count of errors about other runs' micro-batches
_ID_SPAN = 1 << 24  # engine micro-batch ids stay below this
# A chain's range of wire ids: _REGION_BASES bases (one a run: a chat's turn), taken in turn from a random one and
# wrapping around (ChainIds knows the late results of earlier runs). 2^23 ranges to draw from: two drivers on one
# deployment draw the same one once in 8 million (they would then share micro-batches); every id stays an int64.
_REGION_BASES = 1 << 16
_REGION_IDS = _REGION_BASES * _ID_SPAN
_REGIONS = (1 << 63) // _REGION_IDS - 1


@dataclass(frozen=True)
class _Stop:
    pass


_Outgoing = Forward | ReleaseMicroBatch | _Stop


# What an agent's Error says happened, in the words a ChainError gives it
_ERROR_WORDS = {
    ErrorCode.BAD_MESSAGE: "a refused step",
    ErrorCode.NOT_ASSIGNED: "no stage for the step",
    ErrorCode.INTERNAL: "a failure",
    ErrorCode.UNAUTHORIZED: "a refused sender",
    ErrorCode.BUSY: "that it is busy",
    ErrorCode.OUT_OF_MEMORY: "that it ran out of memory",
    ErrorCode.DISK_FULL: "a full disk",
    ErrorCode.SHARD_MISMATCH: "files that do not match the model",
    ErrorCode.UNSUPPORTED_VERSION: "another protocol version",
}


def _link_failure(error: LinkError) -> str:
    """Why a stage's link failed, for _stage_error (which names the agent and its address already)."""
    return f"its link closed: {error.closed_because}" if error.closed_because else str(error)


class FleetPipeline:
    """A deployed chain of agents, driven synchronously. Use as a context manager or call close().

    `addresses` overrides where to dial each stage (e.g. a delay proxy in front of it); the agent id
    is still pinned by TLS. `return_logits` asks the last stage for the full logits too (benchmarks
    only: it is what top-1 compression saves). `model_id` (the deployment's) names the model in every
    step, so that an agent hosting stages of several models runs each on the right one. `hostnames` (agent id ->
    the hostname it enrolled with: FleetStore.hostnames) names the PCs in errors and in describe(). `replaced`
    (fleet_deploy.DeploymentWatch) says whether the deployment on record no longer places these stages: submit()
    and a collect() that waits then fail the chain at once, blaming no one, and the run's failover goes on on the new
    deployment. `stop` (a server's, set as it stops): the opening and a collect() that waits give up at once
    with Stopped. `own_network` (own_network.shared_watch()): asked, as a stage's link dies, whether this PC's own
    network failed under it (ChainError.own_fault).
    """

    def __init__(self, stages: Sequence[StagePlacement], files: TlsFiles,
                 revocations: RevocationSource = no_revocations, addresses: Sequence[str] | None = None,
                 step_timeout_s: float = STEP_TIMEOUT_S, return_logits: bool = False, model_id: str = "",
                 hostnames: Mapping[str, str] | None = None, replaced: Callable[[], bool] | None = None,
                 stop: StopSignal | None = None, own_network: OwnNetworkWatch | None = None) -> None:
        if not stages:
            raise ChainError("the deployment has no stages")
        self.stages = tuple(stages)
        self.addresses = tuple(addresses) if addresses is not None else tuple(s.address for s in stages)
        if len(self.addresses) != len(self.stages):
            raise ValueError(f"{len(self.addresses)} addresses for {len(self.stages)} stages")
        self.files = files
        self.revocations = revocations
        self.step_timeout_s = step_timeout_s
        self.return_logits = return_logits
        self.model_id = model_id
        self.hostnames = dict(hostnames or {})
        self.replaced = replaced
        self._stop = stop
        self.own_network = own_network
        self._first_id = secrets.randbelow(_REGIONS) * _REGION_IDS  # this driver's range of wire ids
        bases = itertools.count(secrets.randbelow(_REGION_BASES))
        self._ids = ChainIds(_ID_SPAN, lambda: self._first_id + next(bases) % _REGION_BASES * _ID_SPAN)
        # results with the perf_counter time they reached this process (the network thread's receipt)
        self._results: queue.Queue[tuple[float, ForwardResult] | ChainError | Stopped] = queue.Queue()
        self.last_arrival_s = 0.0  # when the result collect() returned last reached this process
        self._failure: ChainError | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[_Outgoing] | None = None
        self._closed = False
        # errors about another run's micro-batches dropped, and when that was last logged, by stage (_drop_stray_error)
        self._stray_errors: dict[int, int] = {}
        self._stray_logged_at: dict[int, float] = {}
        self._thread = threading.Thread(target=self._thread_main, name="fleet-chain", daemon=True)
        # a stop wakes a collect() that waits (or the opening): it is handed over as a result
        self._stop_wakes = contextlib.ExitStack()
        if stop is not None:
            self._stop_wakes.enter_context(stop.calling(lambda: self._results.put(Stopped("the chain was stopped"))))
        try:
            # start() inside: a Ctrl-C that comes once the thread runs but before the wait (a busy machine) must
            # give the opening up too, or the links the thread opens after it stay up
            self._thread.start()
            opened = self._wait_opened(OPEN_TIMEOUT_S + 5.0, stop)
        except BaseException:  # Ctrl-C while the links open (a chat goes on to its next message), a stop
            self._give_up_opening()
            self._stop_wakes.close()
            raise
        if not opened:
            self._stop_wakes.close()
            self._give_up_opening()
            raise ChainError(f"the chain did not open within {OPEN_TIMEOUT_S:.0f} s")
        if self._failure is not None:
            self._stop_wakes.close()
            self._thread.join()
            raise self._failure

    def _wait_opened(self, timeout: float, stop: StopSignal | None) -> bool:
        """Wait for the network thread to open the links (or fail); Stopped where `stop` is set meanwhile."""
        if stop is None:
            return self._ready.wait(timeout)
        with stop.calling(self._ready.set):
            opened = self._ready.wait(timeout)
        stop.check("opening the chain")
        return opened

    @classmethod
    def from_store(cls, store: FleetStore, model_dir: Path, **options: object) -> FleetPipeline:
        """The chain of the last `deskfleet fleet deploy` of this model."""
        from deskfleet.controller.fleet_ca import Revocations

        try:
            stages = load_deployment(store, model_dir)
        except DeployError as error:
            raise ChainError(str(error)) from None
        return cls(stages, store.tls_files, Revocations(store), model_id=model_id_of(model_dir),
                   hostnames=store.hostnames(), replaced=DeploymentWatch(store, model_dir, stages),
                   **options)  # type: ignore[arg-type]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    # Public methods: the StageChain protocol

    def submit(self, message: Forward) -> None:
        """Send one step; its result comes out of collect()."""
        self._check_open()
        self._check_deployment()
        self._post(self._ids.send(message, return_logits=self.return_logits or message.return_logits,
                                  model_id=self.model_id))

    def collect(self, timeout: float | None = None) -> ForwardResult:
        """The next finished step (any micro-batch). ChainError naming the agent when one failed.

        A result this driver has no step in flight for (a run stopped early, a duplicate) is logged and
        dropped, never handed to the engine."""
        self._check_open()  # closed: no result can come, so none is awaited (nor an agent blamed)
        if self._stop is not None:
            self._stop.check("a step of the chain")
        wait = (self.step_timeout_s + STEP_TIMEOUT_S_PER_TOKEN * self._ids.largest_step_in_flight
                if timeout is None else timeout)
        deadline = time.monotonic() + wait
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                entry = self._results.get(timeout=left if self.replaced is None else min(left, REPLACED_POLL_S))
            except queue.Empty:
                if time.monotonic() < deadline:  # a look whether the deployment was replaced under the steps
                    self._check_deployment()
                    continue
                raise ChainError(f"no result within {wait:.0f} s with {self._ids.in_flight} step(s) in flight on "
                                 f"{self.describe()}: an agent may be stuck") from None
            if isinstance(entry, ChainError):
                self._failure = entry
                raise entry
            if isinstance(entry, Stopped):
                raise entry
            arrived, item = entry
            if (result := self._ids.receive(item)) is not None:
                self.last_arrival_s = arrived
                return result
            if self._ids.from_earlier_run(item.micro_batch_id):
                log.debug("dropped the late result of a run stopped early (wire micro-batch %d step %d)",
                          item.micro_batch_id, item.step_id)
            else:
                log.warning("dropped a result for wire micro-batch %d step %d: no such step in flight here "
                            "(a duplicate?)", item.micro_batch_id, item.step_id)

    def release(self, batch_id: int) -> None:
        """Free a micro-batch's KV state on every stage (in order, after its last step). A step of it still in
        flight (a run stopped early) is no longer awaited: its result is dropped when it comes."""
        wire_id = self._ids.release(batch_id)
        if self._failure is None and not self._closed:
            self._post(ReleaseMicroBatch(wire_id))

    # Public methods: lifetime

    def renumber(self) -> None:
        """Use fresh wire ids from now on (a new engine on the same chain reuses its small ids), and stop
        awaiting the steps of the previous run (one stopped by Ctrl-C): their late results are dropped."""
        self._ids.renumber()

    def describe(self) -> str:
        return " -> ".join(self._stage_at(index) for index in range(len(self.stages)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_wakes.close()
        self._results.put(ChainError("the chain is closed"))  # wakes a collect() waiting in another thread
        if self._thread.is_alive():
            # the network thread may end between the check and the post (a link closed, failing the chain): the
            # post then raises that failure, which the closing of a broken chain must not (it did, in a teardown)
            with contextlib.suppress(ChainError):
                self._post(_Stop())
            self._thread.join(timeout=30.0)

    def __enter__(self) -> FleetPipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Private methods: the driver thread's side

    def _check_open(self) -> None:
        if self._closed:
            raise ChainError("the chain is closed")
        if self._failure is not None:
            raise self._failure

    def _check_deployment(self) -> None:
        """Fail the chain when its deployment on record was replaced (`replaced`): before, a deploy that made another
        PC the last stage, which this driver never told where its results go, had them dropped, and the run (an idle
        `serve --fleet` at its next request) waited out its step timeout, then failed over, 120 s later."""
        if self.replaced is None or not self.replaced():
            return
        error = DeploymentReplaced("the deployment on record was replaced under the chain (an admin's `fleet "
                                   "deploy`, or another run's re-plan)", stages=self.stages)
        self._fail(error)
        raise error

    def _give_up_opening(self) -> None:
        """The constructor leaves without a chain: the network thread closes the links it has opened or is
        opening and stops, unawaited (a link may take OPEN_TIMEOUT_S to open or fail). Nothing else would:
        nobody holds this object to close it, and the links stayed up, with the thread and its event loop,
        as long as the process ran."""
        self._closed = True  # before reading _loop: the thread sets _loop first, then reads _closed
        loop, outbox = self._loop, self._outbox
        if loop is not None and outbox is not None:
            try:
                loop.call_soon_threadsafe(outbox.put_nowait, _Stop())
            except RuntimeError:  # the loop closed in between: the thread is done
                pass

    def _post(self, item: _Outgoing) -> None:
        loop, outbox = self._loop, self._outbox
        if loop is None or outbox is None or loop.is_closed():
            raise self._failure or ChainError("the chain's network thread has stopped")
        try:
            loop.call_soon_threadsafe(outbox.put_nowait, item)
        except RuntimeError:  # the loop closed in between
            raise self._failure or ChainError("the chain's network thread has stopped") from None

    def _fail(self, error: ChainError) -> None:
        if self._failure is None:
            self._failure = error
        self._results.put(error)

    # Private methods: the network thread

    def _thread_main(self) -> None:
        try:
            event_loop.run(self._main())
        except ChainError as error:
            self._fail(error)
        except BaseException as error:  # never leave the driver waiting on a dead thread
            log.exception("the fleet chain's network thread failed")
            self._fail(ChainError(f"the chain's network thread failed: {error}"))
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        links = await self._open_links()
        if self._closed:  # given up while the links opened: nobody will drive or close this chain
            for link in links:
                await link.close()
            return
        try:
            self._ready.set()
            async with asyncio.TaskGroup() as group:
                receivers = [group.create_task(self._receive(index, link), name=f"receive-{index}")
                             for index, link in enumerate(links)]
                await self._send_all(links[0])
                for task in receivers:
                    task.cancel()
        except* ChainError as errors:
            self._fail(errors.exceptions[0])  # type: ignore[arg-type]
        finally:
            for link in links:
                await link.close()

    async def _open_links(self) -> list[Link]:
        links: list[Link] = []
        try:
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                for index, (stage, address) in enumerate(zip(self.stages, self.addresses, strict=True)):
                    try:
                        links.append(await open_link(address, self.files, stage.agent_id, self.revocations))
                    except LinkError as error:
                        raise ChainError(f"cannot reach {agent_label(stage.agent_id, self.hostnames)} (stage "
                                         f"{index}, layers [{stage.layer_start}:{stage.layer_end}]): {error}",
                                         stage.agent_id, stages=self.stages) from None
                # every stage's agent: the last sends the results, and any stage whose refusal has no next hop to
                # travel down (a paused middle stage) sends it back to the driver of its micro-batch
                for link in links:
                    await link.send(ResultsHere(self._first_id, self._first_id + _REGION_IDS))
        except (ChainError, LinkError, TimeoutError) as error:
            for link in links:
                await link.close()
            if isinstance(error, ChainError):
                raise
            raise ChainError(f"cannot open the chain {self.describe()}: {str(error) or 'timed out'}") from None
        return links

    async def _send_all(self, first: Link) -> None:
        assert self._outbox is not None
        while not isinstance(item := await self._outbox.get(), _Stop):
            try:
                await first.send(item)
            except LinkError as error:
                raise self._stage_error(0, _link_failure(error), first, error) from None

    async def _receive(self, index: int, link: Link) -> None:
        while True:
            try:
                message = await link.receive()
            except LinkError as error:
                raise self._stage_error(index, _link_failure(error), link, error) from None
            if isinstance(message, ForwardResult):
                self._results.put((time.perf_counter(), message))
            elif isinstance(message, Error):
                if message.micro_batch_id is not None and not self._ids.is_awaited(message.micro_batch_id):
                    # a step given up: this run's on the chain a failover left (a surviving stage relaying the break
                    # after the re-plan), or another run's (an agent dropped from its chain that woke up)
                    self._drop_stray_error(index, message)
                    continue
                blamed, ignored = self._accepted_blame(index, message)
                # which stage's link the error came back on (it may have begun earlier in the chain: the text
                # names the agent that made it), and what kind of error it is, in words
                what = _ERROR_WORDS.get(message.code, message.code.value)
                raise ChainError(f"{self._stage_at(index)} reported {what}: {message.message}{ignored}", blamed,
                                 self.stages[index].agent_id, self.stages)
            else:
                log.debug("ignoring %s from %s", type(message).__name__, link.describe())

    def _drop_stray_error(self, index: int, error: Error) -> None:
        """Log an Error about a micro-batch with no step in flight here: the first of each stage's link in full, the
        rest at debug level, counted, with one line a minute of how many (a woken agent that relayed a whole run's
        steps wrote one warning per micro-batch, the same text each time)."""
        now = time.monotonic()
        count = self._stray_errors.get(index, 0)
        self._stray_errors[index] = count + 1
        if count == 0:
            log.warning("%s: dropped an error about wire micro-batch %d, which has no step in flight here (a step "
                        "given up: on the chain before a re-plan, or another run's; any more such are counted): %s",
                        self._stage_at(index), error.micro_batch_id, error.message)
        elif now - self._stray_logged_at.get(index, 0.0) >= STRAY_ERROR_LOG_S:
            log.warning("%s: %d errors about micro-batches with no step in flight here dropped so far, the latest "
                        "about wire micro-batch %d: %s", self._stage_at(index), count + 1, error.micro_batch_id,
                        error.message)
        else:
            log.debug("dropped an error about wire micro-batch %d: %s", error.micro_batch_id, error.message)
            return
        self._stray_logged_at[index] = now

    def _accepted_blame(self, index: int, error: Error) -> tuple[str | None, str]:
        """The agent that `error`, arrived on stage `index`'s link, may name as at fault (the failover leaves it
        out of the next plan), and what to add to the error's text when its blame was ignored.

        The rule: an agent observes only itself (it gave its stages up) and its next hop (unreachable), and
        Errors travel down the chain, each stage relaying its previous hop's (agent/core.py takes them from
        that hop alone and drops a blame of itself or of its next hop). So what arrives from stage j can
        truthfully name only stages 0..j+1 of this chain: j itself, its next hop, or an earlier stage whose
        error it relayed. A blame of a later stage, or of an agent outside the chain, is nothing stage j can
        have learnt: it is ignored and logged, and the chain still breaks, blaming no one. What stands is still
        only the agent's word (a PC that cannot reach its next hop across a firewall blames a healthy one; a member
        can name an earlier member falsely: relayed errors carry no proof of where they began): the failover
        checks it against the controller's own links before leaving anyone out (FleetFailover._check_blame)."""
        blamed = error.agent_id
        if blamed is None or blamed in [stage.agent_id for stage in self.stages[:index + 2]]:
            return blamed, ""
        stage = self.stages[index]
        where = "is in no stage of this chain" if blamed not in [other.agent_id for other in self.stages] \
            else "hosts a later stage than its next hop"
        note = (f" [its blame of {agent_label(blamed, self.hostnames)} was ignored: that agent {where}, so "
                f"{agent_label(stage.agent_id, self.hostnames)} (stage {index}) cannot know it to be at fault]")
        log.warning("stage %d's %s reported an error blaming %s, which %s: the blame is ignored", index,
                    agent_label(stage.agent_id, self.hostnames), agent_label(blamed, self.hostnames), where)
        return None, note

    def _stage_at(self, index: int) -> str:
        stage = self.stages[index]
        return (f"stage {index} [{stage.layer_start}:{stage.layer_end}] on "
                f"{agent_label(stage.agent_id, self.hostnames)} at {self.addresses[index]}")

    def _stage_error(self, index: int, text: str, link: Link | None = None, error: LinkError | None = None
                     ) -> ChainError:
        """Stage `index` failed (`text` says how); where `link`, this end of its link, died of `error`, whether
        this PC's own network failed under it is asked now: the watch forgets faults after a while, and an idle
        server's chain may be found broken long after."""
        stage = self.stages[index]
        return ChainError(f"{agent_label(stage.agent_id, self.hostnames)} (stage {index}, layers [{stage.layer_start}:"
                          f"{stage.layer_end}]) at {self.addresses[index]}: {text}", stage.agent_id,
                          stages=self.stages, own_fault=self._own_fault(link, error))

    def _own_fault(self, link: Link | None, error: LinkError | None) -> str | None:
        """The fault of this PC's own network that `link` died of (`error`), in words, or None (own_network.explain)."""
        return None if link is None or error is None else explain(self.own_network, LinkDeath.of(link, error))
