"""When a PC of the chain drops out mid-generation: re-plan over the fleet that is left, and carry on.

FleetFailover is the engine's `recover` (Engine.run): given the ChainError that broke the chain it
surveys the fleet again (registrations, a short mDNS browse, and the addresses of the chain's other
PCs), leaves out every agent that has failed in this run, plans over the others with the settings of
the model's last deploy (policy, streams, precision, device), pushes only what the new stages lack (the
surviving PCs usually hold their layers already) and opens the new chain; the engine then prefills
every unfinished stream with its prompt and the tokens it had, so the output is what an uninterrupted
run gives. The new plan is saved as the model's deployment. After `max_failovers` re-plans in one run,
or when the model no longer fits the PCs that are left, it raises FailoverError naming what was lost
and why no new chain could be made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from deskfleet.common import event_loop
from deskfleet.common.planner import PlanOptions
from deskfleet.controller.engine import ChainBroken
from deskfleet.controller.fleet_ca import Revocations
from deskfleet.controller.fleet_deploy import (
    DeployError,
    DeployReport,
    deploy,
    load_deploy_settings,
    load_deployment,
)
from deskfleet.controller.fleet_pipeline import ChainError, FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import SurveyOptions, survey

log = logging.getLogger(__name__)


class FailoverError(RuntimeError):
    """The chain broke and no new one could be made; the message says what broke and why."""


@dataclass
class FleetFailover:
    """Makes a new chain for the engine each time the old one breaks. Close it when the run is over: it
    owns the chains it opened."""

    store: FleetStore
    model_dir: Path
    max_failovers: int
    survey_options: SurveyOptions = field(default_factory=lambda: SurveyOptions(discover_seconds=1.0))
    notify: Callable[[str], None] = log.warning  # told what broke and where the run goes on
    lost: set[str] = field(default_factory=set)  # agent ids that failed in this run
    chains: list[FleetPipeline] = field(default_factory=list)
    run_start: int = 0  # how many of `chains` came before this run (a chat's reply): the budget is per run
    replans: list[dict[str, object]] = field(default_factory=list)  # what broke, and the chain made after it

    def __call__(self, error: ChainBroken) -> FleetPipeline:
        # the controller's own observation (a link closed, an agent not dialled) or a blame the chain checked
        # against the reporting stage's place in it (FleetPipeline._accepted_blame): never a bystander's id
        agent_id = error.agent_id if isinstance(error, ChainError) else None
        if agent_id is not None:
            self.lost.add(agent_id)
        replans = len(self.chains) - self.run_start
        if replans >= self.max_failovers:
            raise FailoverError(f"{error} (gave up: {replans} re-plan(s) already in this run, "
                                f"--max-failovers {self.max_failovers})") from error
        started = time.perf_counter()
        try:
            report = event_loop.run(self._redeploy())
            chain = FleetPipeline(report.stages, self.store.tls_files, Revocations(self.store),
                                  model_id=report.model_id)
        except (DeployError, ChainError) as failure:
            raise FailoverError(f"{error}; no new chain without the lost agent(s): {failure} (what to do: bring the "
                                "lost PC back, or join more PCs, then run this again)") from error
        self.chains.append(chain)
        stages = [[stage.agent_id, stage.layer_start, stage.layer_end] for stage in chain.stages]
        seconds = round(time.perf_counter() - started, 3)
        self.replans.append({"error": str(error), "lost_agent": agent_id, "stages": stages, "seconds": seconds})
        self.notify(f"the chain broke ({error}); re-planned in {seconds:.1f} s over {chain.num_stages} agent(s): "
                    f"{chain.describe()}")
        return chain

    def start_run(self) -> None:
        """A new run on the same chain (a chat's next reply): it gets the whole --max-failovers budget again, and
        the PCs that failed before it may serve again (a re-plan surveys them anew: one still gone stays out).
        Without this, a chat that outlived two dropped PCs in a day ended at the third, and a PC lost in its first
        reply was never used again however long it had been back."""
        self.run_start = len(self.chains)
        self.lost.clear()

    def close(self) -> None:
        for chain in self.chains:
            chain.close()

    def __enter__(self) -> FleetFailover:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Private methods

    async def _redeploy(self) -> DeployReport:
        settings = load_deploy_settings(self.store, self.model_dir)
        found = await survey(self.store, self._survey_options())
        try:
            _, report = await deploy(self.store, self.model_dir, found,
                                     PlanOptions(policy=settings.policy, streams=settings.streams),
                                     settings.precision, settings.device, exclude=frozenset(self.lost),
                                     kv_cache=settings.kv_cache)
        finally:
            await found.close()
        return report

    def _survey_options(self) -> SurveyOptions:
        """The survey's, plus the addresses of the chain's surviving PCs: they are dialled even when
        neither registration nor mDNS would find them (a deploy made with --peer)."""
        try:
            deployed = load_deployment(self.store, self.model_dir)
        except DeployError:
            deployed = ()
        survivors = [stage.address for stage in deployed if stage.agent_id not in self.lost]
        return replace(self.survey_options, peers=tuple(dict.fromkeys([*self.survey_options.peers, *survivors])))
