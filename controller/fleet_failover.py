"""When a PC of the chain drops out mid-generation: re-plan over the fleet that is left, and carry on.

FleetFailover is the engine's `recover` (Engine.run): given the ChainError that broke the chain it
surveys the fleet again (registrations, a short mDNS browse, and the addresses of the chain's other
PCs), leaves out every agent that has failed in this run, plans over the others with the settings of
the model's last deploy (policy, streams, precision, device), pushes only what the new stages lack (the
surviving PCs usually hold their layers already) and opens the new chain; the engine then prefills
every unfinished stream with its prompt and the tokens it had, so the output is what an uninterrupted
run gives. The new plan is saved as the model's deployment. A re-plan holds the data dir's deploy lock, waiting for
another deploy to finish first (another run's re-plan, an admin's `fleet deploy`); when that one saved a deployment
that places none of the PCs this run lost nor a link it found broken, the run goes on on it instead of re-planning
(several runs on one deployment that lose the same PC make one new plan). After `max_failovers` re-plans in one run,
or when the model no longer fits the PCs that are left, it raises FailoverError naming what was lost
and why no new chain could be made.

A blame is checked before it costs a PC (_check_blame), against the survey the re-plan makes anyway (no
extra dial, no extra wait): a stage's word that another PC is at fault (its next hop unreachable, or an
earlier stage's error it relayed) stands only when the controller cannot reach that PC either. Where the
accused answers and still hosts its stage, it is kept; an accusation of the reporter's own next hop then
marks the link from the reporter to the accused broken for the run (a firewall between two desks, or the
reporter itself, is at fault) and keeps both, planned apart (PlanOptions.broken_links: the reporter never
directly before the accused; where no chain over both does as well, the planner leaves one out and says why),
and a relayed one, whose maker cannot be told, leaves no one out. A PC the controller saw fail
itself (its link closed) that answers the survey (restarted, or a moment's network fault) is kept once per
run, unless the controller's own network failed under that link (own_network: the interface that carried it lost its
link or its address as the link died): then no PC is blamed, and the re-plan spends no failover. A stage's blame of
itself (it gave its stages up) is taken at its word.

At a run's start, `rejoin` takes back PCs that a run's re-plan left out and that have called in since (restarted, or
back on the network), by a re-plan of the same kind, unless other runs drive the model (their stages would be replaced
under their streams); and PCs of the deployed chain that called in since their stage was assigned and, asked, no
longer host it (restarted, or paused and resumed while no run drove the model).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from deskfleet.agent.link import utc_now
from deskfleet.common import event_loop, pki
from deskfleet.common.agent_state import AgentState
from deskfleet.common.arguments import FAILOVER_BROWSE_S
from deskfleet.common.model_spec import ManifestError
from deskfleet.common.planner import RESUME_COMMAND, ExclusionReason, Plan
from deskfleet.common.stop_signal import Stopped, StopSignal
from deskfleet.common.wire import StageRef
from deskfleet.controller.engine import ChainBroken
from deskfleet.controller.fleet_ca import Revocations
from deskfleet.controller.fleet_deploy import (
    UNRECORDED,
    CalledInSinceAssigned,
    DeployError,
    DeploymentWatch,
    DeployReport,
    NotPlaced,
    StagePlacement,
    addresses_gone_since_saved,
    called_in_since,
    deploy,
    inexact_cache_note,
    load_deploy_settings,
    load_deployment,
    model_id_of,
    note_hosting_checked,
    note_readdress_tried,
    note_rejoin_tried,
    pcs_back,
    placed_pcs_called_in,
    placed_pcs_readdressed,
    utc_text,
)
from deskfleet.controller.fleet_pipeline import ChainError, DeploymentReplaced, FleetPipeline
from deskfleet.controller.fleet_runs import others_driving
from deskfleet.controller.fleet_store import FleetStore, FleetStoreError, agent_label
from deskfleet.controller.fleet_survey import AgentView, Survey, SurveyOptions, survey, survey_through_outage
from deskfleet.controller.own_network import OwnNetworkWatch, explain

log = logging.getLogger(__name__)

# How long a re-plan waits for another deploy from the data dir (an admin's `fleet deploy`, another run's failover)
# to finish before it gives up: the run's chain is broken meanwhile, and what that deploy saves may be the way on.
DEPLOY_LOCK_WAIT_S = 600.0
# ... and how long a running server's take-back waits for it (its streams wait meanwhile): the next idle moment's
# opening waits for the rest
RUNNING_LOCK_WAIT_S = 5.0
_LOCK_POLL_S = 0.25
# What an agent's status says when it can take a stage now: a paused or unavailable PC that lost its stage is left to
# the chain's failover
_CAN_TAKE_STAGES = frozenset({AgentState.AVAILABLE, AgentState.SERVING})
_ACTED_ON_KEPT = 64  # call-ins a take-back look remembers acting on (a server runs for months)
# Re-plans a run makes for this PC's own network for free; after that they spend --max-failovers as any other
# (a network that drops as often as that is one to mend, and a run must not re-plan without end on it)
OWN_NETWORK_FREE_REPLANS = 10


class FailoverError(RuntimeError):
    """The chain broke and no new one could be made; the message says what broke and why."""


@dataclass
class FleetFailover:
    """Makes a new chain for the engine each time the old one breaks. Close it when the run is over: it
    owns the chains it opened."""

    store: FleetStore
    model_dir: Path
    max_failovers: int
    survey_options: SurveyOptions = field(default_factory=lambda: SurveyOptions(discover_seconds=FAILOVER_BROWSE_S))
    notify: Callable[[str], None] = log.warning  # told what broke and where the run goes on
    lost: set[str] = field(default_factory=set)  # agent ids that failed in this run
    chains: list[FleetPipeline] = field(default_factory=list)
    opened: FleetPipeline | None = None  # the chain the run opened from the record (its opener's): closed once replaced
    run_start: int = 0  # how many of `chains` came before this run (a chat's reply): the budget is per run
    replans: list[dict[str, object]] = field(default_factory=list)  # what broke, and the chain made after it
    failed_replans: int = 0  # re-plans of this run that a PC failing meanwhile cut short: they count too
    kept: set[str] = field(default_factory=set)  # blamed in this run, kept because they answered (once each)
    # (from, to): links found broken in this run (a stage that could not reach its next hop, which answers the
    # controller); every re-plan of the run keeps their ends apart
    broken_links: set[tuple[str, str]] = field(default_factory=set)
    drafting: bool = False  # the run verifies drafts: told when a deployment it goes on on keeps an inexact cache
    # a server's stop (set as it stops, from another thread): a re-plan under way and the chains made give up at once,
    # raising Stopped, as a Ctrl-C gives them up in a command's main thread
    stop: StopSignal | None = None
    # this PC's own network, which the chains this failover opens ask whether it failed under a link of theirs that
    # died (own_network.shared_watch; ChainError.own_fault); None: every such death is taken for its PC's
    own_network: OwnNetworkWatch | None = None
    hostnames: dict[str, str] = field(default_factory=dict, init=False)  # the roster's (read at each re-plan)
    _blame: ChainError | None = field(default=None, repr=False)  # the blame the re-plan under way checks
    _left_out: str | None = field(default=None, repr=False)  # whom that check left out
    _verdict: str | None = field(default=None, repr=False)  # what that check found, in words
    _apart: tuple[str, str] | None = field(default=None, repr=False)  # the link that check found broken
    _blame_verdict: str | None = field(default=None, repr=False)  # _verdict as that check left it
    # the export the run started on (None: its folder held none then, and the chain could not open either)
    _model_id: str | None = field(default=None, init=False, repr=False)
    # the deployment the run's chain was opened on (the saved one at the start, then each of its re-plans'), to
    # tell a deployment saved meanwhile by someone else: another run's failover, or an admin's deploy
    _known: tuple[StagePlacement, ...] | None = field(default=None, init=False, repr=False)
    _adopted: bool = field(default=False, init=False, repr=False)  # the re-plan under way took one of those
    _broke: str = field(default="the chain broke", init=False, repr=False)  # what the notes say happened
    _break_text: str = field(default="", init=False, repr=False)  # the error behind it
    _break_told: bool = field(default=False, init=False, repr=False)
    _cache_note: str | None = field(default=None, init=False, repr=False)  # what check_cache told last
    # a run's start that re-planned for PCs back since a re-plan left them out (rejoin): what it found and made
    rejoined: list[dict[str, object]] = field(default_factory=list)
    # the PCs back that rejoin's re-plan under way must place, and the left-out PCs its survey dials with the short
    # timeout (those still gone among them)
    _rejoining: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _must_place: bool = field(default=True, init=False, repr=False)  # its plan must place one of them (else NotPlaced)
    _recheck_too: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _credit: int = field(default=0, init=False, repr=False)  # re-plans of this run not counted (rejoin says which)
    # when each PC in `lost` was first lost: one that has called in since (registered again, or said it can take
    # stages again) is lost no more (_forgive_called_in)
    _lost_at: dict[str, datetime.datetime] = field(default_factory=dict, init=False, repr=False)
    # forgiven once in this run already: a PC whose link flaps re-registers after every loss, and forgiven each time
    # it would spend a re-plan of --max-failovers at every other break
    _forgiven: set[str] = field(default_factory=set, init=False, repr=False)
    _own_fault: str | None = field(default=None, init=False, repr=False)  # the break's, in words (_own_network_fault)
    _own_network_replans: int = field(default=0, init=False, repr=False)  # this run's, of OWN_NETWORK_FREE_REPLANS

    def __post_init__(self) -> None:
        self.hostnames = self.store.hostnames()
        try:
            self._model_id = model_id_of(self.model_dir)
        except (OSError, ManifestError):
            self._model_id = None
        try:
            self._known = load_deployment(self.store, self.model_dir)
        except (DeployError, OSError, ManifestError):
            self._known = None

    def __call__(self, error: ChainBroken, opening: bool = False) -> FleetPipeline:
        """A new chain after `error` broke the old one; `opening`: the deployed chain could not be opened (a PC gone
        since the deploy), which the notes say instead of "the chain broke"."""
        self._broke = "the deployed chain could not open" if opening else "the chain broke"
        self._break_text = str(error)
        self._break_told = False  # a note of this break gave its error already (the wait for another deploy)
        # the controller's own observation (a link closed, an agent not dialled) or a blame the chain checked
        # against the reporting stage's place in it (FleetPipeline._accepted_blame): never a bystander's id.
        # Left out until the re-plan's survey has checked it (_check_blame).
        agent_id = error.agent_id if isinstance(error, ChainError) else None
        if isinstance(error, DeploymentReplaced):  # no PC failed: the new deployment is gone on on for free
            self._credit += 1
        self._own_fault = self._own_network_fault(error)
        if self._own_fault is not None and self._own_network_replans < OWN_NETWORK_FREE_REPLANS:
            self._own_network_replans += 1  # not of _credit, which a take-back's failure sets
        blamed = agent_id if self._own_fault is None else None
        self._forgive_called_in()
        if blamed is not None:
            self._lose(blamed)
        started = time.perf_counter()
        cut_short: list[str] = []  # what failed each re-plan of this break that another PC's failure cut short

        def record(chain: FleetPipeline | None) -> float:
            seconds = round(time.perf_counter() - started, 3)
            self.replans.append({
                "error": str(error), "lost_agent": self._left_out, "blamed_agent": blamed,
                "blame_check": self._verdict, "seconds": seconds, "cut_short": cut_short,
                "stages": [[stage.agent_id, stage.layer_start, stage.layer_end] for stage in chain.stages]
                if chain is not None else [],
                "adopted": self._adopted and chain is not None, "interrupted": chain is None,
                "own_network": self._own_fault})
            return seconds

        try:
            while True:
                replans = self._spent()
                if replans >= self.max_failovers:
                    raise FailoverError(f"{error} (gave up: {replans} re-plan(s) already in this run, "
                                        f"--max-failovers {self.max_failovers})") from error
                chain = self._replan(error, blamed, cut_short)
                if chain is not None:
                    break
        except (KeyboardInterrupt, Stopped):  # Ctrl-C mid-re-plan: the report still says what broke, and whom it lost
            record(None)
            raise
        finally:
            self._blame = None  # weighed by this break's first re-plan that surveyed (or by none)
        self._add_chain(chain)
        seconds = record(chain)
        checked = f"; {self._verdict}" if self._verdict else ""
        how = ("went on in {seconds:.1f} s on the deployment saved meanwhile (another run's re-plan, or a `fleet "
               "deploy`)" if self._adopted else "re-planned in {seconds:.1f} s").format(seconds=seconds)
        broke = f"{self._broke} (as above)" if self._break_told else f"{self._broke} ({error})"
        self.notify(f"{broke}{checked}; {how} over {chain.num_stages} agent(s): {chain.describe()}")
        self.check_cache()  # an admin's deploy saved meanwhile may keep another cache than the run began on
        return chain

    def check_cache(self) -> None:
        """Tell a drafting run when the saved deployment's stages keep a KV cache that makes drafted output part from
        plain decoding (fleet_deploy.inexact_cache_note): at the start, and after a re-plan when that changed."""
        if not self.drafting:
            return
        note = inexact_cache_note(self.store, self.model_dir)
        if note is not None and note != self._cache_note:
            self.notify(note)
        self._cache_note = note

    @property
    def model_id(self) -> str | None:
        """The export the run started on (None: its folder held none then)."""
        return self._model_id

    def rejoin(self, running: bool = False) -> FleetPipeline | None:
        """At a run's start, before the deployed chain opens, take back the PCs that can serve the model again, by a
        re-plan with the deployment's settings, as a failover would, so that the run and the ones after it have them:
        - PCs of the admin's deploy that a run's re-plan left out and that have called in since
          (fleet_deploy.pcs_back: restarted, back on the network, resumed by their user);
        - PCs of the deployed chain that called in since their stage was assigned and, asked, no longer host it
          (stages_gone: restarted, or paused and resumed while no run drove the model). The chain learnt that only at
          its first step, and spent a failover on it (with --max-failovers 0 the run failed);
        - PCs of the deployed chain that no longer register an address they did when it was saved
          (placed_pcs_readdressed: a new DHCP lease, a rotated IPv6 address), while no chain of this run is open
          (`running` False) and no other run drives the model: the chain on record gives the stage before each, and
          the driver, the gone address. Its first step failed over after a dial of it timed out (13 s of an 8-token
          run in an exploratory test); the re-plan usually assigns the same stages again, with the new addresses,
          compiling nothing.
        Returns the new chain, or None to open the deployment on record.

        The data dir's deploy lock is taken first and held through the re-plan: a deploy under way (another run's
        start taking the PC back, an admin's) is waited for, and what it saved is opened. Where other runs drive the
        model (fleet_runs), nothing is re-planned under their streams for a PC left out: a run that starts while none
        does takes it back (counted before the lock was held, a run starting a moment after another's count took the
        old chain, which that one's deploy then replaced under it). A stage gone is gone under their streams too, and
        is re-planned for all the same. A re-plan that does not place a PC left out, or fails, is said in a note and
        noted in the record, so that the next runs wait for that PC's next call-in. A re-plan here is not a failure:
        it spends none of the run's --max-failovers; and where it failed after agents were told anything (their
        stages of the chain on record may be gone), a stage is known gone, or the deploy waited for did not finish,
        the run's first failover is not counted either.

        `running`: the run's chain is open and its streams wait (a busy `serve --fleet`: EngineService moves them onto
        the chain this gives). The run may have lost the PC itself, in a failover when its user paused it: a PC lost in
        this run that has called in since is forgiven first, as a failover's re-plan does (once a run); one still lost
        is left to the next run's start (nothing is re-planned for it, nor noted as tried). A deploy under way is
        waited for RUNNING_LOCK_WAIT_S at most (None then: the next idle moment's opening waits for it), a deployment
        another deploy saved meanwhile is gone on on (the chain of the record would break on it), and the re-plan is
        not counted against --max-failovers."""
        self._forgive_called_in()
        back = pcs_back(self.store, self.model_dir)
        if back is not None and running and set(back.agents) <= self.lost:
            log.info("%s called in since this run lost it, which forgave it once already: the next run's start takes "
                     "it back", ", ".join(self._name(agent_id) for agent_id in back.agents))
            back = None
        if back is not None:
            since = (f"since the re-plan at {utc_text(back.replanned_at)} that left "
                     f"{'it' if len(back.agents) == 1 else 'them'} out")
            chain = self._take_back(back.agents, f"called in {since}",
                                    {"agents": list(back.agents), "replanned_at": back.replanned_at},
                                    still_wanted=lambda: pcs_back(self.store, self.model_dir) is not None,
                                    recheck=frozenset(back.left_out),
                                    tried=lambda when: note_rejoin_tried(self.store, self.model_dir, when),
                                    running=running)
            if chain is not None:
                return chain
        # (a PC left out that was not taken back leaves the chain on record to open: its stages are asked about too)
        called_in = placed_pcs_called_in(self.store, self.model_dir)
        known = self._known
        if called_in is not None and self._model_id is not None:
            gone = stages_gone(self.store, self.model_dir, self._model_id, called_in, self.stop)
            if gone:  # (none gone, asked about once, or they could not be asked: the chain's first step tells)
                at = f" at {utc_text(called_in.assigned_at)}" if called_in.assigned_at is not None else ""
                said = (f"no longer hosts its stage (it called in since the stage was assigned{at})" if len(gone) == 1
                        else f"no longer host their stages (they called in since the stages were assigned{at})")
                return self._take_back(gone, said, {"agents": list(gone), "assigned_at": called_in.assigned_at},
                                       still_wanted=lambda: self._saved_deployment() == known, recheck=frozenset(),
                                       tried=lambda when: note_hosting_checked(self.store, self.model_dir, called_in),
                                       stage_gone=True, running=running)
        readdressed = placed_pcs_readdressed(self.store, self.model_dir)
        if readdressed is None or running:  # (a running chain's links are open: its next break re-plans, if any)
            return None
        addresses_gone = sorted({address for addresses in readdressed.gone for address in addresses})
        one = len(readdressed.agents) == 1
        said = (f"{'no longer registers' if one else 'no longer register'} {', '.join(addresses_gone)}, given to the "
                f"PC before {'it' if one else 'them'} and to the driver by the chain on record")
        return self._take_back(readdressed.agents, said, {"agents": list(readdressed.agents),
                                                          "assigned_at": readdressed.assigned_at,
                                                          "addresses_gone": addresses_gone},
                               still_wanted=lambda: self._saved_deployment() == known, recheck=frozenset(),
                               tried=lambda when: note_readdress_tried(self.store, self.model_dir, readdressed),
                               stage_gone=True, under_others=False, running=running)

    def _chain_of(self, report: DeployReport) -> FleetPipeline:
        """The chain of a deployment this run goes on on, watching the record for another one replacing it."""
        return FleetPipeline(report.stages, self.store.tls_files, Revocations(self.store), model_id=report.model_id,
                             hostnames=self.hostnames,
                             replaced=DeploymentWatch(self.store, self.model_dir, report.stages), stop=self.stop,
                             own_network=self.own_network)

    def _saved_deployment(self) -> tuple[StagePlacement, ...] | None:
        try:
            return load_deployment(self.store, self.model_dir)
        except (DeployError, OSError, ManifestError):
            return None

    def _take_back(self, agents: tuple[str, ...], said: str, entry: dict[str, object], still_wanted: Callable[[], bool],
                   recheck: frozenset[str], tried: Callable[[datetime.datetime], None],
                   stage_gone: bool = False, under_others: bool | None = None,
                   running: bool = False) -> FleetPipeline | None:
        """rejoin's re-plan for `agents` (of which the notes say: "NAMES {said}"), recorded in `rejoined` as `entry`;
        `still_wanted` is asked after waiting for a deploy under way (None is returned when it says no: that deploy did
        the work), `recheck` the PCs the survey dials with the short timeout besides `agents`, and `tried` notes a
        re-plan that failed (given when it began), so that the runs after wait for the PCs' next call-in. `stage_gone`:
        the chain on record is known to lack a stage of `agents`, so its first failover is free whatever happens here,
        other runs driving the model do not stop the re-plan, and a plan that leaves those PCs out is deployed all the
        same (a PC left out is taken back only by a plan that places it). `under_others` (default: `stage_gone`):
        whether it re-plans while other runs drive the model, replacing the chain under their streams. `running`: as
        rejoin says."""
        started, tried_at = time.perf_counter(), self.store.stamp(utc_now())
        names = ", ".join(self._name(agent_id) for agent_id in agents)
        said = f"{names} {said}"

        def record(**fields: object) -> None:
            entry.update(seconds=round(time.perf_counter() - started, 3), **fields)
            self.rejoined.append(entry)

        with contextlib.ExitStack() as held:
            deadline = time.monotonic() + (RUNNING_LOCK_WAIT_S if running else DEPLOY_LOCK_WAIT_S)
            waiting = False
            while True:
                try:
                    held.enter_context(self.store.deploying())
                    break
                except OSError as error:  # its lock file cannot be opened: no deploy can run, nor this re-plan
                    self._credit = 1 if stage_gone else self._credit
                    record(stages=[], problem=str(error))
                    self.notify(f"{said}, but the run goes on on the deployment on record: {error}")
                    return None
                except FleetStoreError:  # a deploy under way: what it saves is what this run opens
                    if not waiting:
                        waiting = True
                        self.notify(f"{said}: the run waits for the deploy under way from {self.store.data_dir} "
                                    "(another run's, or a `fleet deploy`) to finish")
                    if time.monotonic() >= deadline:  # the chain it opens may still be replaced: not its fault
                        self._credit = 1 if not running else self._credit  # (running: DeploymentReplaced is free)
                        record(stages=[], problem="the deploy under way did not finish in "
                               f"{RUNNING_LOCK_WAIT_S if running else DEPLOY_LOCK_WAIT_S:.0f} s")
                        return None
                    self._pause(_LOCK_POLL_S)
                    if not still_wanted():  # taken back meanwhile, or deployed anew
                        return None
            if waiting and not still_wanted():  # the deploy waited for ended after the last look: it did the work
                return None  # (on a loaded machine this run went on, and noted a re-plan of its own)
            if under_others is None:
                under_others = stage_gone
            busy = others_driving(self.store, self._model_id) if self._model_id is not None and not under_others else 0
            if busy:  # a re-plan now would replace the stages under their streams: a run that starts alone does it
                record(stages=[], problem=f"{busy} other run(s) drive the model")
                self.notify(f"{said}: it is taken back by a run that starts while no other drives the model ({busy} "
                            "other run(s) do now)")
                return None
            self._rejoining, self._must_place = frozenset(agents), not stage_gone
            self._recheck_too = recheck  # the admin's PCs still gone: the short timeout too
            try:
                report = event_loop.run(self._redeploy(lock_held=True), stop=self.stop)
            except (KeyboardInterrupt, Stopped):
                record(stages=[], interrupted=True)
                raise
            except (DeployError, ChainError, FailoverError, ManifestError, OSError, FleetStoreError,
                    pki.PkiError) as failure:
                tried(tried_at)  # a PC gone again, or still short of memory: its next call-in is looked at
                if stage_gone or not isinstance(failure, NotPlaced):  # agents may have been told of a plan not saved
                    self._credit = 1
                record(stages=[], problem=str(failure))
                self.notify(f"{said}, but the run goes on on the deployment on record: {failure}")
                return None
            finally:
                self._rejoining = self._recheck_too = frozenset()
        self._known = report.stages
        adopted, self._adopted = self._adopted, False
        if adopted:  # another deploy saved one meanwhile: the run opens it, as it would have without a PC back
            log.debug("a deployment of %s was saved meanwhile: the run opens it", self.model_dir)
            if not running:
                return None
        try:
            chain = self._chain_of(report)
        except ChainError as error:  # the new chain did not open: re-planned around, as a chain gone at the start is
            record(stages=[[stage.agent_id, stage.layer_start, stage.layer_end] for stage in report.stages],
                   problem=f"the new chain did not open: {error}")
            self._credit = 1
            return self(error, opening=True)
        self._add_chain(chain)
        # not a failure: at a run's start its budget is whole; mid-run, what it spent stays spent
        self.run_start = self.run_start + 1 if running else len(self.chains)
        record(stages=[[stage.agent_id, stage.layer_start, stage.layer_end] for stage in chain.stages])
        how = "the run goes on on the deployment saved meanwhile (a `fleet deploy`, or another run's re-plan)" \
            if adopted else f"re-planned in {entry['seconds']:.1f} s"
        self.notify(f"{said}: {how} over {chain.num_stages} agent(s): {chain.describe()}")
        self.check_cache()
        return chain

    def _pause(self, seconds: float) -> None:
        """time.sleep(seconds), cut short by the stop with Stopped."""
        if self.stop is None:
            time.sleep(seconds)
        elif self.stop.wait(seconds):
            self.stop.check("the re-plan")

    def _add_chain(self, chain: FleetPipeline) -> None:
        """Own `chain`, the run's new one, and close those before the one `chain` replaces (the engine releases its
        micro-batches on that one as it moves), the chain opened from the record too: a server that runs for months
        re-plans many times, and each chain kept open held its links to the agents."""
        self.chains.append(chain)
        for replaced in [*([self.opened] if self.opened is not None and len(self.chains) > 1 else []),
                         *self.chains[:-2]]:
            replaced.close()

    def _spent(self) -> int:
        """The re-plans this run has spent of --max-failovers, less those this PC's own network made it (free up to
        OWN_NETWORK_FREE_REPLANS); -1 while the credit for a re-plan that rejoin's failure may cause is unspent (with
        --max-failovers 0 too, that re-plan is made)."""
        return len(self.chains) - self.run_start + self.failed_replans - self._credit - self._own_network_replans

    def start_run(self) -> None:
        """A new run on the same chain (a chat's next reply): it gets the whole --max-failovers budget again, and
        the PCs that failed before it may serve again (a re-plan surveys them anew: one still gone stays out).
        Without this, a chat that outlived two dropped PCs in a day ended at the third, and a PC lost in its first
        reply was never used again however long it had been back."""
        self.run_start = len(self.chains)
        self.failed_replans = 0
        self._credit = 0
        self.lost.clear()
        self._lost_at.clear()
        self._forgiven.clear()
        self.kept.clear()
        self.broken_links.clear()
        self._own_network_replans = 0

    def _lose(self, agent_id: str) -> None:
        """Leave `agent_id` out of this run's re-plans, from now until it calls in (or the run ends)."""
        if agent_id not in self.lost:
            self._lost_at[agent_id] = self.store.stamp(utc_now())
        self.lost.add(agent_id)

    def _forgive_called_in(self) -> None:
        """Take back into this run's re-plans the lost PCs whose agent has called in since it was lost (the roster's
        `registered_at`: registered again, or resumed by its user, plugged in again): a PC that was paused, resumed
        and called in was left out of every later re-plan of a long run (a `serve --fleet` within its 10-minute
        window, a chat's reply), though it stood available. Once a run each (a link that flaps re-registers after
        every loss). A roster that cannot be read forgives no one."""
        if not self.lost:
            return
        try:
            roster = self.store.roster()
        except (FleetStoreError, OSError):
            return
        for agent_id in list(self.lost - self._forgiven):
            lost_at = self._lost_at.get(agent_id)
            if lost_at is not None and called_in_since(roster.get(agent_id), lost_at):
                self.lost.discard(agent_id)
                self._forgiven.add(agent_id)
                del self._lost_at[agent_id]
                log.info("%s called in since this run lost it: the next re-plan may place it again",
                         self._name(agent_id))

    def close(self) -> None:
        for chain in self.chains:
            chain.close()

    def __enter__(self) -> FleetFailover:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Private methods

    def _replan(self, error: ChainBroken, agent_id: str | None, cut_short: list[str]) -> FleetPipeline | None:
        """A new chain without the lost PCs; None when another PC failed while it was made (a link lost, no
        answer, a refusal while deploying; a PC of the new chain not reached when it opened): that PC is then
        lost too, what failed is added to `cut_short`, and the caller re-plans again while the budget lasts.
        Before, such a second loss ended the run at once with budget left, telling the user to bring the lost PC
        back, and the same command run again at once re-planned fine. The blame that broke the chain is weighed
        by the first attempt only: weighed again, a blamed PC kept the first time read as blamed twice."""
        if not cut_short:
            self._blame = error if isinstance(error, ChainError) and agent_id is not None else None
            self._left_out, self._verdict, self._apart, self._blame_verdict = agent_id, self._own_fault, None, None
        else:  # what the first survey made of the blame, without what its plan added (_planned_apart); none when
            # the first attempt took a deployment saved meanwhile (it surveyed nothing: this attempt weighs it)
            self._verdict = self._blame_verdict
        try:
            report = event_loop.run(self._redeploy(), stop=self.stop)
            chain = self._chain_of(report)
            self._known = report.stages
            return chain
        except (DeployError, ChainError) as failure:
            failed = failure.agents if isinstance(failure, DeployError) else \
                frozenset({failure.agent_id} if failure.agent_id is not None else ())
            own = explain(self.own_network, failure.death) if isinstance(failure, DeployError) else failure.own_fault
            if failed - self.lost and own is not None:
                # this PC's own network failed under the re-plan (a laptop's Wi-Fi dropped again as it deployed):
                # no PC is lost for it; healthy PCs were, and a run ended on one PC (from an exploratory test)
                free = self._own_network_replans < OWN_NETWORK_FREE_REPLANS
                self.failed_replans += 1
                self._own_network_replans += free
                cut_short.append(str(failure))
                replans = self._spent()
                if replans < self.max_failovers:
                    self.notify(f"{self._broke} ({error}); while re-planning, {failure}; that link died as this PC's "
                                f"own network failed under it ({own}): no PC is blamed, and the re-plan is made "
                                f"again{'' if free else ', spending a failover'}")
                    return None
                raise FailoverError(f"{error}; while re-planning, {failure}, as this PC's own network failed under "
                                    f"it ({own}) (gave up: {replans} re-plan(s) already in this run, --max-failovers "
                                    f"{self.max_failovers})") from error
            if failed - self.lost:  # a PC failed while the chain was made: re-planned without it, budget allowing
                for agent_id in failed:
                    self._lose(agent_id)
                self.failed_replans += 1
                cut_short.append(str(failure))
                replans = self._spent()
                if replans < self.max_failovers:
                    self.notify(f"{self._broke} ({error}); while re-planning, {failure}: re-planning without "
                                f"{', '.join(self._name(agent) for agent in sorted(failed))} too")
                    return None
                raise FailoverError(f"{error}; while re-planning, {failure} (gave up: {replans} re-plan(s) "
                                    f"already in this run, --max-failovers {self.max_failovers})") from error
            checked = f" ({self._verdict})" if self._verdict else ""
            without = " without the lost agent(s)" if self.lost else ""
            reasons = failure.exclusion_reasons if isinstance(failure, DeployError) else frozenset()
            raise FailoverError(f"{error}{checked}; no new chain{without}: {failure} (what to do: "
                                f"{_remedy(bool(self.lost), reasons, f'{error} {failure}')}, then run this again)"
                                ) from error

    async def _redeploy(self, lock_held: bool = False) -> DeployReport:
        """The deployment to go on with, under the data dir's deploy lock (waited for: another deploy may be saving
        the way on): one saved since this run's chain was opened that leaves out every PC lost in this run (another
        run on the same deployment re-planned first, or an admin deployed anew), else a re-plan with the settings
        saved last. Before, a second run's failover was refused at once while the first one's re-plan deployed,
        and ended; and a re-plan that read the settings before an admin's deploy saved its own overwrote it.
        `lock_held`: the caller holds the deploy lock already (a run's start re-planning for PCs that are back)."""
        self._adopted = False
        if self._model_id is not None and (now := model_id_of(self.model_dir)) != self._model_id:
            # exported again mid-run: a chain of the new export would carry on the run's streams with another
            # model's weights (a re-plan prefills them with the tokens so far), so the run ends instead
            raise FailoverError(f"{self.model_dir} was exported again during this run ({self._model_id} is now "
                                f"{now}): the run cannot go on on another model; `fleet deploy` the new export and "
                                "run this again")
        async with contextlib.nullcontext() if lock_held else self._deploy_lock():
            self.hostnames = self.store.hostnames()  # a PC that joined since the run began may be in the new chain
            adopted = self._deployed_meanwhile()
            if adopted is not None:
                return adopted
            settings = load_deploy_settings(self.store, self.model_dir)
            # a PC that registers after this is "back" for the runs after (pcs_back)
            surveyed_at = self.store.stamp(utc_now())
            found = await survey_through_outage(self.store, self._survey_options(), self.notify, surveyor=survey)
            try:
                self._check_blame(found)
                self._blame = None  # weighed once a break: a retry after another PC failed meanwhile does not
                self._blame_verdict = self._verdict
                options = replace(settings.plan_options(), broken_links=frozenset(self.broken_links))
                result, report = await deploy(self.store, self.model_dir, found, options,
                                              settings.precision, settings.device, exclude=frozenset(self.lost),
                                              kv_cache=settings.kv_cache, lock_held=True,
                                              replanned_at=surveyed_at,
                                              placing=self._rejoining if self._must_place else frozenset())
            finally:
                await found.close()
        self._planned_apart(result, report)
        return report

    @contextlib.asynccontextmanager
    async def _deploy_lock(self) -> AsyncIterator[None]:
        """Hold the data dir's deploy lock, waiting up to DEPLOY_LOCK_WAIT_S for another deploy to let it go
        (said once); FailoverError when it does not."""
        # not the lock's own words ("let it finish, then deploy again": advice for `fleet deploy`), nor its pid, which
        # a holder that has just taken the lock may not have written yet
        under_way = f"the deploy under way from {self.store.data_dir} (another run's re-plan, or a `fleet deploy`)"
        deadline = time.monotonic() + DEPLOY_LOCK_WAIT_S
        waiting = False
        with contextlib.ExitStack() as held:
            while True:
                try:
                    held.enter_context(self.store.deploying())
                    break
                except FleetStoreError:
                    if time.monotonic() >= deadline:
                        raise FailoverError(f"{self._break_text}; its re-plan waited {DEPLOY_LOCK_WAIT_S:.0f} s for "
                                            f"{under_way} to finish: run this again once it has") from None
                    if not waiting:
                        waiting = True
                        self.notify(f"{self._broke} ({self._break_text}); its re-plan waits for {under_way} to finish")
                        self._break_told = True
                    await asyncio.sleep(_LOCK_POLL_S)
            yield

    def _deployed_meanwhile(self) -> DeployReport | None:
        """The model's saved deployment when it is not the one this run's chain was opened on and places no PC
        lost in this run; None otherwise (or when none can be read: the re-plan then says what is wrong)."""
        try:
            saved = load_deployment(self.store, self.model_dir)
        except DeployError:
            return None
        if saved == self._known or any(stage.agent_id in self.lost for stage in saved):
            return None
        if any((before.agent_id, after.agent_id) in self.broken_links for before, after in itertools.pairwise(saved)):
            return None  # a link this run found broken, which whoever saved it did not know of
        self._adopted = True
        model_id = self._model_id if self._model_id is not None else model_id_of(self.model_dir)  # checked at start
        return DeployReport(model_id, saved, {}, {})

    def _own_network_fault(self, error: ChainBroken) -> str | None:
        """Where the controller's own link to a stage died (the controller's observation, not an agent's word) while
        the interface that carried it lost its link or the address it ran from (ChainError.own_fault, which the chain
        asked as the link died): what happened, in words; else None.
        A drop of the controller's own network named the stage whose link died first, and the failover kept it once
        a run: a second drop in the run left that healthy PC out (an exploratory test's laptop controller)."""
        if not isinstance(error, ChainError) or error.agent_id is None or error.own_fault is None:
            return None
        free = "no failover is spent on it" if self._own_network_replans < OWN_NETWORK_FREE_REPLANS else \
            f"a failover is spent on it ({OWN_NETWORK_FREE_REPLANS} such breaks in this run were free)"
        return (f"the link to {self._name(error.agent_id)} died as this PC's own network failed under it "
                f"({error.own_fault}): no PC is blamed, and {free}")

    def _name(self, agent_id: str) -> str:
        return agent_label(agent_id, self.hostnames)

    def _survey_options(self) -> SurveyOptions:
        """The survey's, plus the addresses of the chain's surviving PCs: they are dialled even when
        neither registration nor mDNS would find them (a deploy made with --peer)."""
        try:
            deployed = load_deployment(self.store, self.model_dir)
        except DeployError:
            deployed = ()
        survivors = [stage.address for stage in deployed if stage.agent_id not in self.lost]
        # the PCs a run's start re-plans for (rejoin) get the short timeout too: one that called in and went again
        # must not hold the run up for the whole open timeout
        return replace(self.survey_options, peers=tuple(dict.fromkeys([*self.survey_options.peers, *survivors])),
                       recheck=frozenset(self.lost | self._forgiven) | self._rejoining | self._recheck_too)

    def _planned_apart(self, result: Plan, report: DeployReport) -> None:
        """Add to the verdict of a link found broken (_check_blame) what the re-plan made of its two ends: both in
        the new chain, apart, or one left out by the planner (then the replan's `lost_agent`) and why."""
        if self._apart is None or self._verdict is None:
            return
        placed = [stage.agent_id for stage in report.stages]
        at = {agent_id: index for index, agent_id in enumerate(placed)}
        reporter, accused = self._apart
        if reporter in at and accused in at:
            where = (f"{self._name(accused)} (stage {at[accused]}) now comes before {self._name(reporter)} "
                     f"(stage {at[reporter]})" if at[accused] < at[reporter] else
                     f"{self._name(reporter)} (stage {at[reporter]}) and {self._name(accused)} (stage "
                     f"{at[accused]}) are no longer neighbours")
            self._verdict += f"; the new chain keeps both: {where}"
            return
        for agent_id in (reporter, accused):
            if agent_id in at:
                continue
            why = next((exclusion for exclusion in result.exclusions if exclusion.agent_id == agent_id), None)
            if why is None:
                self._verdict += f"; {self._name(agent_id)} is not in the new chain"
                continue
            if why.reason is ExclusionReason.BROKEN_LINK:
                self._left_out = agent_id
            self._verdict += f"; the new plan leaves {self._name(agent_id)} out ({why.message})"

    def _was_removed(self, agent_id: str) -> bool:
        """Whether `fleet remove` removed it (a survey does not reach a removed PC: no other word for its silence)."""
        try:
            return Revocations(self.store)().is_revoked(agent_id)
        except pki.PkiError:  # revoked.json lost or damaged: the survey said so; the silence is then just silence
            return False

    def _check_blame(self, found: Survey) -> None:
        """Weigh the blame that broke the chain (self._blame, its agent provisionally in `lost`) against what the
        re-plan's survey found, before anyone is left out for it; sets _left_out and _verdict.

        An agent's word that another PC failed is one side of a link: a stage that cannot reach its next hop (a
        firewall or a dead switch port between two desks, while the controller reaches both) blamed a healthy
        PC, and a buggy or hostile member could have honest PCs left out one failover at a time. So:
        - the accused did not answer the survey (nor is it registered or announced): the blame stands;
        - a stage blamed itself (it gave its stages up): it stands, the agent's word about itself;
        - the accused answers and still hosts its stage of this chain: it is kept. Where it was the reporter's
          next hop, the reporter made the accusation (an agent drops a relayed blame of its next hop), and the
          link between the two or the reporter itself is at fault: the link is marked broken for the run and
          both are kept, the reporter never directly before the accused in a re-plan (where no chain over both
          does as well, the planner leaves one of them out: _planned_apart says which and why); a reporter that
          already could not reach another PC in this run is itself at fault and is left out instead; where the
          accused no longer registers an address it did when the chain was saved (the record's `roster_addresses`),
          the reporter was given that gone one: both are kept, no link is marked broken, and the re-plan gives the
          reporter the new ones (before, the link was marked broken, and the re-plan moved stages apart). An earlier
          stage's blame was relayed, and which stage made it cannot be told: nobody is left out for it;
        - the accused answers but no longer hosts its stage (it restarted), or the controller saw its link close
          and it answers now: it is kept (re-planned, it is given its stage again).
        Whichever way, an accused PC is kept once per run: blamed again after that, it is left out (a PC that
        answers its status but cannot serve its stage would otherwise cost an honest reporter at every
        failover, or a relayed blame re-plan the same chain until --max-failovers)."""
        error = self._blame
        if error is None or error.agent_id is None or error.reported_by == error.agent_id:
            return
        accused, reporter = error.agent_id, error.reported_by
        answered = next((agent for agent in found.reachable() if agent.agent_id == accused), None)
        if answered is None or answered.report is None:
            if reporter is not None and self._was_removed(accused):
                self._verdict = f"{self._name(accused)} was removed from the fleet: it is left out"
            elif reporter is not None:
                self._verdict = f"{self._name(accused)} does not answer the controller either: it is left out"
            return
        positions = {stage.agent_id: index for index, stage in enumerate(error.stages)}
        hosting = accused in positions and StageRef(model_id_of(self.model_dir),
                                                    error.stages[positions[accused]].layer_start,
                                                    error.stages[positions[accused]].layer_end
                                                    ) in answered.report.stages
        if reporter is not None and hosting and accused not in self.kept:
            self.kept.add(accused)
            self.lost.discard(accused)
            accused_at, reporter_at = positions[accused], positions.get(reporter)
            # a reporter that already could not reach another PC the controller reaches: it is the fault (its
            # network, or a member's false word), and a link marked broken at each failover would only move it before
            # another PC until --max-failovers ended the run
            earlier = sorted(target for source, target in self.broken_links if source == reporter and target != accused)
            next_hop = reporter_at is not None and accused_at == reporter_at + 1
            # the next hop no longer registers an address it did when the chain was saved (a rotated IPv6 address, a
            # new DHCP lease): the reporter was given a gone one, and no link between them is at fault
            gone = addresses_gone_since_saved(self.store, self.model_dir, error.stages, accused) if next_hop else ()
            if gone:
                self._left_out = None
                self._verdict = (f"{self._name(reporter)} (stage {reporter_at}) could not reach its next hop "
                                 f"{self._name(accused)} (stage {accused_at}), which answers the controller and still "
                                 f"hosts its stage; {self._name(accused)} no longer registers {', '.join(gone)}, "
                                 f"which it did when the chain was deployed, and {self._name(reporter)} was given: "
                                 "both are kept, no link is marked broken, and the re-plan gives it the new addresses")
            elif next_hop and earlier:
                self._lose(reporter)
                self._left_out = reporter
                self._verdict = (f"{self._name(reporter)} (stage {reporter_at}) reported its next hop "
                                 f"{self._name(accused)} (stage {accused_at}) at fault, but that agent answers the "
                                 f"controller and still hosts its stage, and {self._name(reporter)} could not reach "
                                 f"{', '.join(self._name(target) for target in earlier)} either earlier in this run: "
                                 f"{self._name(reporter)} itself is at fault, so it is left out of the next plan and "
                                 f"{self._name(accused)} is kept")
            elif next_hop:
                self.broken_links.add((reporter, accused))
                self._apart = (reporter, accused)
                self._left_out = None
                self._verdict = (f"{self._name(reporter)} (stage {reporter_at}) reported its next hop "
                                 f"{self._name(accused)} (stage {accused_at}) at fault, but that agent answers the "
                                 f"controller and still hosts its stage: the link from {reporter[:12]} to "
                                 f"{accused[:12]} (a firewall or network fault between those two PCs), or "
                                 f"{self._name(reporter)} itself, is at fault, so that link is marked broken for this "
                                 f"run and the re-plan weighs both (never with {self._name(reporter)} directly before "
                                 f"{self._name(accused)})")
            else:
                self._left_out = None
                self._verdict = (f"the error that stage {reporter_at}'s {self._name(reporter)} passed on blamed "
                                 f"{self._name(accused)} (stage {accused_at}), but that agent answers the controller "
                                 "and still hosts its stage: the blame was relayed, and which stage made it cannot "
                                 "be told, so nobody is left out for it")
            log.warning("%s", self._verdict)
            return
        why = "" if accused not in positions else " and still hosts its stage" if hosting else \
            ", but no longer hosts its stage (restarted?)"
        if accused in self.kept:
            self._verdict = (f"{self._name(accused)} answers the controller{why}, but it was blamed and kept once "
                             "already in this run: it is left out")
            return
        self.kept.add(accused)
        self.lost.discard(accused)
        self._left_out = None
        self._verdict = (f"{self._name(accused)} answers the controller{why}: it is kept in the plan (blamed again "
                         "in this run, it is left out)")
        log.warning("%s", self._verdict)


def stages_gone(store: FleetStore, model_dir: Path, model_id: str, called_in: CalledInSinceAssigned,
                stop: StopSignal | None = None) -> tuple[str, ...] | None:
    """Of the PCs of `called_in` (fleet_deploy.placed_pcs_called_in), those that answer now, able to take stages,
    without their stage of it; None where they could not be asked. Only they are dialled, with the short timeout,
    no mDNS browse: a PC that does not answer, or is paused again, is left to the chain's failover. Where none is
    gone, the ask is noted (note_hosting_checked): those call-ins are not asked about again. Where one is, it is not
    (a run that starts while the stage is re-planned for asks too). Raises only Stopped (where `stop` is set): the
    ask is a help to a run that would start without it."""
    agents = frozenset(stage.agent_id for stage in called_in.stages)
    options = SurveyOptions(discover_seconds=0.0, only=agents, recheck=agents)

    async def ask() -> list[AgentView]:
        found = await survey(store, options)
        answered = found.reachable()  # those with a link: close() lets them go
        await found.close()
        return answered

    try:
        answered = {agent.agent_id: agent.report for agent in event_loop.run(ask(), stop=stop)}
    except Stopped:
        raise
    except Exception as error:
        log.warning("could not ask the PCs that called in since their stage was assigned whether they still host it: "
                    "%s (the chain's first step tells)", error, exc_info=log.isEnabledFor(logging.DEBUG))
        return None
    gone = tuple(dict.fromkeys(
        stage.agent_id for stage in called_in.stages
        if (report := answered.get(stage.agent_id)) is not None and report.state in _CAN_TAKE_STAGES
        and StageRef(model_id, stage.layer_start, stage.layer_end) not in report.stages))
    if not gone:
        note_hosting_checked(store, model_dir, called_in)
    return gone


class TakeBackLook:
    """Whether a run that holds its chain open (`serve --fleet` while idle, `chat --fleet` between replies) should
    open it again to take a PC back, no deploy being under way (the opening would wait for it):
    - a PC a re-plan left out has called in since (restarted, resumed by its user, plugged in again:
      fleet_deploy.pcs_back) and no other run drives the model: the opening re-plans to include it;
    - a PC of the deployed chain has called in since its stage was assigned (fleet_deploy.placed_pcs_called_in)
      and, asked (stages_gone: that PC alone is dialled), no longer hosts it: restarted, or paused and resumed while
      the run was idle. The opening re-plans for it (FleetFailover.rejoin) before a request's first step spends a
      failover on it. A PC that still hosts its stage (its link came back, `fleet serve` restarted) costs the run
      nothing: a chat reopened for it would feed its whole conversation again;
    - a PC of the deployed chain that no longer registers an address it did when the deployment was saved
      (fleet_deploy.placed_pcs_readdressed): the opening re-plans, giving the stage before it the new ones, before a
      request's first step fails over on a dial of the gone address.
    Each call-in, and each change, is acted on once: where the opening did not take the PC back (its re-plan left it
    out or failed, which the record notes; a deploy lock that could not be opened, which it does not), the run waits
    for the PC's next call-in (or change) instead of opening its chain again at every look. A few small files read a
    look, and a dial only after a call-in of a PC of the chain. `left_out_back` is the look for a run whose streams are
    running: the first kind only, with no dial (a stage gone from the chain fails its next step within moments, and
    the failover re-plans), so that no step waits on the network."""

    def __init__(self, store: FleetStore, model_dir: Path, stop: StopSignal | None = None) -> None:
        """`stop` (a server's): its dial of a PC gives up with Stopped as the server stops."""
        self.store = store
        self.model_dir = model_dir
        self.stop = stop
        self._model_id = model_id_of(model_dir)
        # the evidence of each call-in acted on (which PCs, since when, their call-ins), oldest first
        self._acted_on: dict[tuple[object, ...], None] = {}

    def __call__(self) -> bool:
        if self.store.deploy_under_way():
            return False
        if self.left_out_back():
            return True
        called_in = placed_pcs_called_in(self.store, self.model_dir)
        if called_in is not None and self._first_time(("placed", called_in)) \
                and stages_gone(self.store, self.model_dir, self._model_id, called_in, self.stop):
            return True
        readdressed = placed_pcs_readdressed(self.store, self.model_dir)
        return readdressed is not None and self._first_time(("readdressed", readdressed))

    def left_out_back(self) -> bool:
        """Whether a PC a re-plan left out has called in since, no other run drives the model and no deploy is under
        way, not acted on before (it is now); files read only."""
        if self.store.deploy_under_way():
            return False
        left_out = self._left_out_back()
        return left_out is not None and self._first_time(left_out)

    def _left_out_back(self) -> tuple[object, ...] | None:
        back = pcs_back(self.store, self.model_dir)
        if back is None or others_driving(self.store, self._model_id):
            return None
        roster = self.store.roster()
        return ("left out", back.agents, back.replanned_at,
                tuple(entry.registered_at if (entry := roster.get(agent_id)) else None for agent_id in back.agents))

    def _first_time(self, evidence: tuple[object, ...]) -> bool:
        """Whether `evidence` was not acted on before (it is now); the oldest are forgotten past _ACTED_ON_KEPT."""
        if evidence in self._acted_on:
            return False
        self._acted_on[evidence] = None
        while len(self._acted_on) > _ACTED_ON_KEPT:
            del self._acted_on[next(iter(self._acted_on))]
        return True


# How the deploy names a file of the export damaged since it was made (fleet_deploy._open_export_file,
# model_spec.verify_files): a failover's remedy then is to export the model again, not to mend a PC
DAMAGED_EXPORT = (" is damaged: its bytes hash to ", " is corrupted: sha256 ")


def _remedy(lost: bool, reasons: frozenset[ExclusionReason], said: str = "") -> str:
    """What a user can do when a failover found no new chain: first for the PCs the plan left out that could
    take work again (a paused one was not lost: bringing it back is not the step), then for the lost ones (a
    blame that left no one out, a link marked broken, may still leave no chain: the reason names what). `said`:
    the break's error and the deploy's, whose command to resume a PC (a lost PC's own word that its user paused it,
    or the planner's, when no PC could take work) is not repeated."""
    if any(damaged in said for damaged in DAMAGED_EXPORT):  # the export's own file (fleet_deploy): no PC mends that
        return "export the model again, and deploy it (`deskfleet fleet deploy --model` the new export)"
    if UNRECORDED in said:  # the controller's own disk: it said "bring the lost PC back, or join more PCs"
        return "make room for the controller's data dir (the reason names the file), then run again: the re-plan " \
               "sends nothing the PCs already hold"
    steps = []
    if ExclusionReason.PAUSED in reasons or (lost and RESUME_COMMAND in said):  # the latter: lost as its user paused it
        how = "as above" if RESUME_COMMAND in said else f"{RESUME_COMMAND} on it"
        steps.append(f"resume a paused PC ({how}; one its admin paused, `paused: true` in its settings, only there)")
    if ExclusionReason.UNAVAILABLE in reasons:
        steps.append("wait until a PC left out as unavailable is free again (the reason says what it is waiting "
                     "for)")
    if ExclusionReason.OTHER_PROTOCOL in reasons:  # running, but of another release: starting them does nothing
        steps.append("upgrade deskfleet where a PC speaks another fleet protocol (the reason says on which side)")
    steps.append("bring the lost PC back" if lost else "mend what the reason names")
    return ", ".join(steps) + ", or join more PCs"
