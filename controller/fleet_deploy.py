"""`deskfleet fleet plan` and `deskfleet fleet deploy`: split a model over the agents, push, assign.

Deploy, per stage of the plan (agents in parallel):
1. ShardQuery the files the stage needs (manifest.json + its IR files); the agent answers what it holds
   whole and where partial ones stop;
2. push only what is missing, in chunks from the resume offset, then ShardComplete (the agent verifies
   the sha256); a second ShardQuery confirms every file arrived whole;
3. AssignStage (layer range, next hop, the previous stage's agent, manifest entries); the agent compiles and
   answers StageReady.
Once every stage is ready, an agent the new plan leaves out is told to release the stage it held of the
model (ReleaseStage): a stage no chain uses would keep its memory and cache pins until the agent restarts.
A second deploy of the same model finds every shard cached and every stage hosted: it sends no bytes.
The deployment (which agent holds which layers, where) is saved as deployments.json for the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import math
import os
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from deskfleet.agent.link import Link, LinkError, utc_now
from deskfleet.common import pki
from deskfleet.common.devices import device_kind
from deskfleet.common.kv_cache_size import kv_cache_bytes_per_token_per_layer, kv_cache_precision
from deskfleet.common.model_spec import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    check_sizes,
    load_manifest,
    model_file,
    verify_files,
)
from deskfleet.common.planner import (
    NOT_ASKED,
    SEE_LEFT_OUT,
    AgentCandidate,
    Exclusion,
    ExclusionReason,
    ModelFiles,
    ModelFootprint,
    Plan,
    PlanOptions,
    PlanPolicy,
    left_out_text,
    plan,
)
from deskfleet.common.prefill_scratch import layer_width, prefill_scratch_per_token
from deskfleet.common.wire import (
    MAX_OTHER_ADDRESSES,
    AssignStage,
    Error,
    ErrorCode,
    ManifestEntry,
    Message,
    NextHop,
    Precision,
    ProtocolError,
    ReleaseStage,
    ShardChunk,
    ShardComplete,
    ShardHave,
    ShardQuery,
    StageReady,
    StageRef,
    is_agent_id,
    parse_address,
)
from deskfleet.controller.fleet_ca import Revocations
from deskfleet.controller.fleet_store import FleetStore, FleetStoreError, RosterEntry, agent_label
from deskfleet.controller.fleet_survey import NO_ADDRESS, AgentView, Survey, links_of_no_shared_family
from deskfleet.controller.own_network import LinkDeath

log = logging.getLogger(__name__)

RELEASE_UNSAVED_TIMEOUT_S = 2.0  # a deploy that did not finish tells each PC to release its stage within this

CHUNK_BYTES = 1 << 20
REPLY_TIMEOUT_S = 60.0
COMPILE_TIMEOUT_S = 300.0
DEPLOYMENT_WATCH_S = 0.5  # how often a running chain looks whether its deployment on record was replaced
MAX_REPLACED = 16  # the earlier exports of a folder whose stages a deploy still looks for (newest first)

_M = TypeVar("_M", bound=Message)

Progress = Callable[[str, str, int, int], None]  # agent id, file name, bytes sent of it, its size


class DeployError(RuntimeError):
    """The deployment cannot go on; the message names the agent and the step. `code`: the agent's refusal;
    `agents`: the ids of the PCs whose failure it was (a link lost, no answer, a refusal), none where the fault
    is not a PC's (a damaged export, a plan that does not fit); `exclusion_reasons`: why the plan left PCs out, where no
    plan could be made (a failover's remedy depends on it: a paused PC is resumed, not brought back); `death`: where
    the failure was a link's to that PC dying, how (own_network.LinkDeath: the failover asks whether this PC's own
    network failed under it).
    `failed_run`: the run failed (a PC, a plan the PCs cannot hold, another deploy running, the record not
    written), not what the user gave (an export, the controller's files): `fleet deploy` exits 1 for the one, 2 for
    the other, as `generate` does. A PC's failure (`agents`) is always a failed run."""

    def __init__(self, message: str, code: ErrorCode | None = None, agents: frozenset[str] = frozenset(),
                 exclusion_reasons: frozenset[ExclusionReason] = frozenset(), failed_run: bool = False,
                 death: LinkDeath | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.agents = agents
        self.exclusion_reasons = exclusion_reasons
        self.failed_run = failed_run or bool(agents)
        self.death = death


class NotPlaced(DeployError):
    """A deploy asked to place certain PCs (deploy's `placing`) found a plan that places none of them: nothing
    was sent or assigned; the message says why the plan leaves them out."""


@dataclass(frozen=True)
class StagePlacement:
    agent_id: str
    address: str
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class DeploySettings:
    """How a model was deployed; a re-plan after a PC drops out deploys it the same way."""

    policy: PlanPolicy = PlanPolicy.FEWEST_AGENTS
    streams: int = 1
    precision: Precision = Precision.DEVICE_DEFAULT
    device: str = "CPU"
    kv_cache: str | None = None  # the agents' KV cache precision; None: the precision's own
    hop_cost: float = PlanOptions.hop_cost  # what a stage's hop costs a token, in the planner's unit (ns)

    def plan_options(self) -> PlanOptions:
        """The options a re-plan of this deployment plans with."""
        return PlanOptions(policy=self.policy, streams=self.streams, hop_cost=self.hop_cost)

    def options_given(self) -> dict[str, str]:
        """`fleet deploy`'s options that make these settings, those that differ from its defaults (option: value)."""
        default = DeploySettings()
        hops_priced = self.policy is PlanPolicy.ALL_BY_SPEED  # the fewest agents' plan prices no hop
        given = {"--policy": self.policy.value if self.policy is not default.policy else None,
                 "--streams": str(self.streams) if self.streams != default.streams else None,
                 "--device": self.device if self.device != default.device else None,
                 "--hop-ms": f"{self.hop_cost / 1e6:g}" if hops_priced and self.hop_cost != default.hop_cost else None,
                 "--precision": self.precision.value if self.precision is not default.precision else None,
                 "--kv-cache": self.kv_cache}
        return {option: value for option, value in given.items() if value is not None}

    def command_options(self) -> str:
        """options_given as a command line takes them (" --policy all_by_speed --hop-ms 0"), or ""."""
        return "".join(f" {option} {shlex.quote(value)}" for option, value in self.options_given().items())

    def changes_from(self, before: DeploySettings) -> list[str]:
        """What differs from `before`, in the options' words: ["--precision f32 -> default", ...]."""
        now, then = self.options_given(), before.options_given()
        return [f"{option} {then.get(option, 'default')} -> {now.get(option, 'default')}"
                for option in dict.fromkeys([*then, *now]) if now.get(option) != then.get(option)]


@dataclass(frozen=True)
class DeployReport:
    model_id: str
    stages: tuple[StagePlacement, ...]
    bytes_sent: dict[str, int]  # per agent id
    files_sent: dict[str, int]


# Public functions

def model_id_of(model_dir: Path) -> str:
    """The model's fleet id: its name and the start of its manifest's sha256 (a re-export differs)."""
    name = load_manifest(model_dir).model_name  # first: it names a folder that is no export (ManifestError)
    digest = hashlib.sha256((model_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    return f"{name}@{digest[:12]}"


def footprint_of(manifest: Manifest, device: str = "CPU", precision: Precision = Precision.DEVICE_DEFAULT,
                 kv_cache: str | None = None, manifest_file_bytes: int = 0) -> ModelFootprint:
    """The planner's view of an export deployed with `precision` and `kv_cache` (as `deploy` takes them): its
    bytes, on a CPU the head's work priced by parameters, and its KV cache and prefill scratch as the stages
    will hold them (see kv_cache_precision, kv_cache_bytes_per_token_per_layer, KV_GROWTH, common/prefill_scratch),
    and the files a deploy sends (sent_files; `manifest_file_bytes`: the size of its manifest.json, which every
    stage gets).

    On the CPU plugin a decode step's time follows the parameters multiplied (unpacking INT4 weights, not
    reading them, sets the pace), and the INT8 head costs about what its parameters would at the layers'
    rate, not what its bytes would. Measured on the 2-core machine, one thread, a 330M INT4 model's head
    took the time of 2.4 of its layers (its bytes: 5.4 layers, its parameters: 2.8), the demo target's 1.6
    (bytes 3.9, parameters 2.0). Priced by bytes, 2 PCs got 11 and 5+head of 16 layers (15.6 and 11.3 ms
    a step); priced by parameters 9 and 7+head, and 2 streams ran 6-10% faster. For f16 and f32 exports
    both measures agree. A GPU or NPU is taken to be bound by reading memory: bytes (not measured here).
    Its memory: see `resident_factor`.
    """
    spec = manifest.spec
    head_work = None
    if device_kind(device) == "CPU":
        bytes_per_parameter = sum(manifest.layer_bytes) / (spec.num_layers * spec.layer_parameters)
        head_work = spec.head_parameters * bytes_per_parameter
    kv = kv_cache_precision(precision, device, kv_cache)
    growth, scratch, first_scratch = _held_beside_weights(device, kv, layer_width(spec))
    return ModelFootprint(manifest.model_name, manifest.layer_bytes, manifest.embed_bytes, manifest.head_bytes,
                          kv_cache_bytes_per_token_per_layer(manifest.spec, kv), spec.max_context, head_work,
                          resident_factor(device), growth, scratch, kv or "the device's own, counted as f32",
                          first_scratch, sent_files(manifest, manifest_file_bytes))


def sent_files(manifest: Manifest, manifest_file_bytes: int) -> ModelFiles:
    """The bytes of the files a deploy sends a stage (_stage_entries), per unit and for every stage."""
    def unit(stem: str) -> int:
        return sum(manifest.files[name].size for name in manifest.ir_files(stem))

    return ModelFiles(tuple(unit(manifest.layer_ir(layer)) for layer in range(manifest.spec.num_layers)),
                      unit(manifest.EMBED_IR), unit(manifest.HEAD_IR), unit(manifest.ROPE_IR) + manifest_file_bytes)


def paper_footprint(num_layers: int, layer_bytes: int, embed_bytes: int, head_bytes: int,
                    kv_bytes_per_token_per_layer: int, context: int, device: str = "CPU",
                    precision: Precision = Precision.DEVICE_DEFAULT, kv_cache: str | None = None,
                    width: int | None = None) -> ModelFootprint:
    """A model of identical layers described on paper (`fleet plan --layers ...`), held as a deploy of it would
    hold it: the weights x resident_factor, the KV cache (its bytes per token as given) grown as the precision's
    is, and with `width` (hidden_size + intermediate_size) the prefill scratch; without a width no scratch can be
    counted (the plan says what it counts)."""
    kv = kv_cache_precision(precision, device, kv_cache)
    growth, scratch, first_scratch = _held_beside_weights(device, kv, width or 0)
    return ModelFootprint("on paper", (layer_bytes,) * num_layers, embed_bytes, head_bytes,
                          kv_bytes_per_token_per_layer, context, None, resident_factor(device), growth, scratch,
                          kv or "the device's own", first_scratch)


def _held_beside_weights(device: str, kv: str | None, width: int) -> tuple[float, int, int]:
    """(KV growth, prefill scratch per token, the first stage's) of a stage on `device` with a `kv` cache, for
    layers of hidden_size + intermediate_size `width`: measured on the CPU plugin, none known elsewhere."""
    if device_kind(device) != "CPU":
        return 1.0, 0, 0
    growth = KV_GROWTH_F32 if kv == "f32" else KV_GROWTH
    return growth, prefill_scratch_per_token(device, width), prefill_scratch_per_token(device, width, first=True)


# The CPU plugin grows a KV cache by reallocating it at twice the tokens it must hold whenever it is full
# (scaled_attn's updatePastkv: (L0 + L1) * 2), so at the full context it may hold up to 2x; the allocator
# keeps some of the smaller caches it outgrew besides. Measured (170M INT4, 12 layers, context 2048, decoded
# one token a call to 2048): f32 99.3 MB of anonymous memory for 50.3 MB of tokens (1.97x); u8 35.2 MB for
# 14.2 MB with 1 row (2.49x), 133.5 MB for 56.6 MB with 4 rows (2.36x). f16 / bf16 not measured: as u8.
KV_GROWTH_F32 = 2.0
KV_GROWTH = 2.5


CPU_RESIDENT_FACTOR = 1.3


def resident_factor(device: str) -> float:
    """The memory a loaded stage holds per byte of its weight files on `device`.

    On the CPU plugin, 1.3: where the plugin repacks the weights at the first call into memory of its own,
    the stage maps its files and holds the weights once (a 3-layer INT4 export, hidden 2048: 99 MB of files
    -> 99 MB of anonymous memory, plus page cache the kernel may reclaim); where it runs most of them in place
    (a Xeon with AMX), the stage reads the files into memory for huge pages and holds them plus the part
    repacked (170M model: 130 MB for ~100 MB of files). See agent/stage.py, weights_were_repacked. Until the
    stage chose, it read every file and held the weights twice (that export: 204 MB; an 8B-shaped one, 294 MB
    of files: 600 MB), and a plan at 1x gave such a stage less than it held before its first token. Other
    devices: their bytes (not measured here)."""
    return CPU_RESIDENT_FACTOR if device_kind(device) == "CPU" else 1.0


def candidates_of(agents: list[AgentView], model_id: str | None = None) -> list[AgentCandidate]:
    """Planner candidates from the agents that answered, with their measured weight GB/s as speed, and the
    layer ranges of `model_id` each hosts now (its free memory lacks them: see AgentCandidate.hosted).

    An agent that has not measured yet counts as the slowest measured one (or 1.0 when none has), so an
    unmeasured PC is never planned as the fastest.
    """
    answered = [agent for agent in agents if agent.report is not None and agent.agent_id is not None]
    speeds = [agent.report.weight_gb_per_s for agent in answered
              if agent.report is not None and agent.report.weight_gb_per_s]
    fallback = min(speeds, default=1.0)
    candidates = []
    for agent in answered:
        assert agent.report is not None and agent.agent_id is not None
        report = agent.report
        candidates.append(AgentCandidate(agent.agent_id, report.state, report.free_memory_bytes,
                                         report.weight_gb_per_s or fallback,
                                         report.reasons[0] if report.reasons else None, report.detail,
                                         agent.hostname,
                                         tuple((stage.layer_start, stage.layer_end) for stage in report.stages
                                               if model_id is not None and stage.model_id == model_id),
                                         report.devices, report.shard_room_bytes))
    return candidates


def plan_survey(footprint: ModelFootprint, found: Survey, options: PlanOptions,
                exclude: frozenset[str] = frozenset(), assumed: Sequence[AgentCandidate] = (),
                model_id: str | None = None) -> Plan:
    """The plan over the agents that answered (less `exclude`) and the `assumed` ones; the agents that were
    found but did not answer are listed as left out too, with why. Call it before `found.close()`.
    `model_id`: the model's fleet id (model_id_of), so that the stages of it the agents host are counted
    back and a deployed split that is still as good is kept."""
    agents = [agent for agent in found.reachable() if agent.agent_id not in exclude]
    answered = {agent.agent_id for agent in found.reachable()}
    options = replace(options, broken_links=options.broken_links | links_of_no_shared_family(agents))
    unreachable = tuple(
        Exclusion(agent.agent_id or agent.address, ExclusionReason.OTHER_PROTOCOL,  # its problem says it all
                  agent.problem or f"speaks fleet protocol {agent.other_protocol}{_at(agent.address)}", agent.hostname)
        if agent.other_protocol is not None else
        Exclusion(agent.agent_id or agent.address, ExclusionReason.UNREACHABLE,
                  f"unreachable{_at(agent.address)}: {agent.problem or 'no status'}", agent.hostname)
        for agent in found.agents if agent.agent_id not in answered)
    return plan(footprint, [*assumed, *candidates_of(agents, model_id)], options, unreachable)


def check_deploy_settings(precision: Precision, kv_cache: str | None) -> None:
    """ValueError for settings a deploy refuses (`fleet plan` checks them too, so that it shows no plan that a
    deploy would refuse)."""
    if precision is Precision.F32 and kv_cache not in (None, "f32"):
        raise ValueError(f"--precision f32 is exact and keeps the KV cache in f32, not {kv_cache}: leave out "
                         f"--kv-cache, or give --precision device_default for a {kv_cache} cache")


async def deploy(store: FleetStore, model_dir: Path, found: Survey, options: PlanOptions,
                 precision: Precision = Precision.DEVICE_DEFAULT, device: str = "CPU",
                 progress: Progress | None = None, exclude: frozenset[str] = frozenset(),
                 kv_cache: str | None = None, lock_held: bool = False,
                 replanned_at: datetime.datetime | None = None,
                 placing: frozenset[str] = frozenset()) -> tuple[Plan, DeployReport]:
    """Plan over the surveyed agents (less those in `exclude`), push what each lacks, assign the stages.
    DeployError on failure, also at once when another deploy from this data dir is running (`lock_held`: the
    caller holds the store's deploy lock already, as a failover does while it weighs the saved deployment).

    `replanned_at`: a run's re-plan, not an admin's deploy, whose survey began then: the record keeps the PCs the
    admin's deploy placed (`deployed_agents`) and that time (`replanned_at`), so that a later run can tell which of
    them called in since (pcs_back; a PC that registered while the re-plan pushed its shards answered its survey, or
    did not, and is counted back). `placing`: deploy only a plan that places at least one of these agents, else
    NotPlaced with nothing sent (a run's start that would re-plan for a PC that is back, when the plan leaves it
    out)."""
    try:
        check_deploy_settings(precision, kv_cache)
    except ValueError as error:
        raise DeployError(str(error)) from None
    with contextlib.ExitStack() as held:
        try:
            if not lock_held:
                held.enter_context(store.deploying())
        except FleetStoreError as error:  # another deploy from this data dir (a failover's too) is running
            raise DeployError(str(error), failed_run=True) from None
        return await _deploy_locked(store, model_dir, found, options, precision, device, progress, exclude, kv_cache,
                                    replanned_at, placing)


async def _deploy_locked(store: FleetStore, model_dir: Path, found: Survey, options: PlanOptions,
                         precision: Precision, device: str, progress: Progress | None, exclude: frozenset[str],
                         kv_cache: str | None, replanned_at: datetime.datetime | None, placing: frozenset[str]
                         ) -> tuple[Plan, DeployReport]:
    manifest = load_manifest(model_dir)
    check_sizes(model_dir, manifest)  # a lost or cut file, before a plan: not only where a PC lacks it
    model_id = model_id_of(model_dir)
    _deployments(store)  # a damaged file is named now, not after every byte was sent
    footprint = footprint_of(manifest, device, precision, kv_cache, (model_dir / MANIFEST_NAME).stat().st_size)
    result = plan_survey(footprint, found, replace(options, device=device), exclude, model_id=model_id)
    # a `fleet init --force` between the survey and the lock (which it holds while it replaces the fleet)
    _check_same_fleet(store, found.fleet_id, "before anything was sent")
    if not result.feasible:
        answered = any(agent.agent_id not in exclude for agent in found.reachable())
        unreachable = any(e.reason in NOT_ASKED for e in result.exclusions)
        cause = f"cannot deploy {model_id}: " if (unreachable and not answered) or not result.usable else \
            "the model does not fit the fleet: "
        # a deploy shows no plan: the list follows the problem, in place of its pointer to it
        left_out = left_out_text(result)
        problems = [problem.replace(SEE_LEFT_OUT, "") for problem in result.problems] if left_out else result.problems
        lost = [agent for agent in found.reachable() if agent.agent_id in exclude]
        if lost and not answered:  # "no agents in the fleet" of a fleet whose PCs answered, but were lost in the run
            problems = [f"no agent left: the {len(lost)} that answered ("
                        + ", ".join(agent_label(agent.agent_id or "?", {agent.agent_id or "?": agent.hostname})
                                    for agent in lost)
                        + ") failed in this run" if problem == "no agents in the fleet" else problem
                        for problem in problems]
        raise DeployError(cause + "; ".join(problems) + (f" ({left_out})" if left_out else ""),
                          exclusion_reasons=frozenset(exclusion.reason for exclusion in result.exclusions),
                          failed_run=True)
    if placing and not placing & {stage.agent_id for stage in result.stages}:
        hostnames = {agent.agent_id: agent.hostname for agent in found.agents if agent.agent_id is not None}
        why = [f"{agent_label(exclusion.agent_id, hostnames)}: {exclusion.message}" for exclusion in result.exclusions
               if exclusion.agent_id in placing]
        raise NotPlaced("the plan over the fleet leaves " + ", ".join(sorted(agent_label(agent_id, hostnames)
                                                                               for agent_id in placing))
                        + " out" + (f" ({'; '.join(why)})" if why else ""))
    addresses = {agent.agent_id: agent.address for agent in found.agents if agent.agent_id is not None}
    placements = tuple(StagePlacement(stage.agent_id, addresses[stage.agent_id], stage.first_layer,
                                      stage.stop_layer) for stage in result.stages)
    settings = DeploySettings(options.policy, options.streams, precision, device, kv_cache, options.hop_cost)
    sent: dict[str, int] = {}
    files: dict[str, int] = {}
    before = _placed_before(store, model_dir)
    assigned_at = store.stamp(utc_now())
    try:
        try:
            await _deploy_all(model_dir, manifest, model_id, placements, settings, found, sent, files, progress)
        except* DeployError as errors:
            failed = [error for error in errors.exceptions if isinstance(error, DeployError)]
            raise DeployError("; ".join(str(error) for error in errors.exceptions),
                              agents=frozenset().union(*(error.agents for error in failed))) from None
        report = DeployReport(model_id, placements, sent, files)
        # a save that fails leaves the stages unrecorded too
        _save_deployment(store, model_dir, report, settings, replanned_at, assigned_at, found.fleet_id)
    except BaseException:  # an agent failed, or Ctrl-C: the deployment on record stays, and so must its stages only
        await _release_unsaved(model_id, placements, before, found)
        raise
    await _release_left_out(store, found, model_id)
    return result, report


async def _deploy_all(model_dir: Path, manifest: Manifest, model_id: str, placements: tuple[StagePlacement, ...],
                      settings: DeploySettings, found: Survey, sent: dict[str, int],
                      files: dict[str, int], progress: Progress | None) -> None:
    async with asyncio.TaskGroup() as tasks:
        for index, placement in enumerate(placements):
            entries = _stage_entries(model_dir, manifest, placement)
            link = found.links[placement.agent_id]
            next_hop = None
            if index + 1 < len(placements):
                following = placements[index + 1]
                next_hop = NextHop(following.address, following.agent_id, _other_addresses(found, following))
            # the stage takes steps only from the agent before it (the first stage: from the controller)
            previous_agent_id = placements[index - 1].agent_id if index else None
            assignment = AssignStage(StageRef(model_id, placement.layer_start, placement.layer_end),
                                     placement.layer_start == 0, placement.layer_end == manifest.spec.num_layers,
                                     settings.device, settings.precision, next_hop, entries, settings.kv_cache,
                                     previous_agent_id)
            tasks.create_task(_deploy_stage(link, model_dir, assignment, sent, files, progress))


def _other_addresses(found: Survey, placement: StagePlacement) -> tuple[str, ...]:
    """The addresses the survey knows of the PC of `placement` besides the one it answered at, as many as a NextHop
    carries."""
    for agent in found.agents:
        if agent.agent_id == placement.agent_id:
            others = (address for address in agent.other_addresses if address != placement.address)
            return tuple(others)[:MAX_OTHER_ADDRESSES]
    return ()


def _placed_before(store: FleetStore, model_dir: Path) -> frozenset[tuple[str, int, int]]:
    """(agent id, first layer, stop layer) of every stage the deployment on record places (none when there is none,
    or it cannot be read: the deploy names that)."""
    try:
        return frozenset((stage.agent_id, stage.layer_start, stage.layer_end)
                         for stage in load_deployment(store, model_dir))
    except (DeployError, OSError, ManifestError):
        return frozenset()


async def _release_unsaved(model_id: str, placements: tuple[StagePlacement, ...],
                           before: frozenset[tuple[str, int, int]], found: Survey) -> None:
    """A deploy that did not finish (an agent failed, Ctrl-C, its record not saved): ask each PC of its plan to
    release the stage it was (or was being) assigned, unless the deployment on record places that stage there. A
    stage kept held its memory and cache pins, unused, until the agent restarted, `fleet ls` listed it as not
    deployed, and only a deploy of a model the admin had just cancelled released it. An agent takes its link's
    messages in order, so a release sent while it compiles the stage comes after it. The sends go together, bounded
    as a whole: the deploy's own error or Ctrl-C is what the user is waiting for."""
    async def release(placement: StagePlacement) -> None:
        link = found.links.get(placement.agent_id)
        if link is None:
            return
        try:
            await link.send(ReleaseStage(StageRef(model_id, placement.layer_start, placement.layer_end)))
            log.info("agent %s asked to release %s[%d:%d]: the deploy did not finish", placement.agent_id[:12],
                     model_id, placement.layer_start, placement.layer_end)
        except LinkError as error:
            log.warning("agent %s may keep the unused stage %s[%d:%d] of the deploy that did not finish (cannot tell "
                        "it to release it: %s): restarting the agent releases it", placement.agent_id[:12], model_id,
                        placement.layer_start, placement.layer_end, error)

    unsaved = [placement for placement in placements
               if (placement.agent_id, placement.layer_start, placement.layer_end) not in before]
    try:
        async with asyncio.timeout(RELEASE_UNSAVED_TIMEOUT_S):
            await asyncio.gather(*(release(placement) for placement in unsaved))
    except TimeoutError:
        log.warning("not every PC of the deploy that did not finish could be asked within %.0f s to release its "
                    "stage: `deskfleet fleet ls` lists what they keep as not deployed", RELEASE_UNSAVED_TIMEOUT_S)


async def _release_left_out(store: FleetStore, found: Survey, model_id: str) -> None:
    """Once `model_id`'s deployment is saved, tell each surveyed agent to release the stages of this export, or
    of an earlier export of its folder that it replaced (the record's `replaces`), that it reported and that no
    deployment places on it: those the new plan leaves out, those a failover left behind, those of the exports
    its folder held before. Only those ids: a stage of another folder's model is that deployment's to release.
    A stage the plan gave the PC again with other layers was replaced when assigned: releasing it does nothing.
    A failure is logged: the deployment stands without it."""
    record = _deployments(store).get(model_id)
    replaced = set(_replaced_ids(record))
    hosted: dict[str, Sequence[StageRef]] = {agent.agent_id: agent.report.stages for agent in found.reachable()
                                             if agent.agent_id is not None and agent.report is not None}
    for agent_id, stale in undeployed_stages(store, hosted).items():
        link = found.links[agent_id]
        for stage in stale:
            if stage.model_id != model_id and stage.model_id not in replaced:
                continue
            why = "the new plan leaves it out" if stage.model_id == model_id else \
                f"its folder holds {model_id} now"
            try:
                await link.send(ReleaseStage(stage))
                log.info("agent %s released %s[%d:%d]: %s", agent_id[:12], stage.model_id, stage.layer_start,
                         stage.layer_end, why)
            except LinkError as error:
                log.warning("agent %s keeps its unused stage %s[%d:%d] (cannot tell it to release it: %s)",
                            agent_id[:12], stage.model_id, stage.layer_start, stage.layer_end, error)


def undeployed_stages(store: FleetStore, hosted: dict[str, Sequence[StageRef]]) -> dict[str, list[StageRef]]:
    """Of the stages each agent hosts (by agent id), those deployments.json does not place on it: left by a
    failover that re-planned without the PC while it was unreachable (it could not be told to release them), or
    of a model no deployment names (an export its folder's next deploy replaced, on a PC that deploy could not
    reach). Nothing drives them; the next deploy of the model releases them. A model whose record is damaged
    counts as placing its stages (nothing is known of it). DeployError for a damaged file.
    """
    placed: set[tuple[str, str, int, int]] = set()
    unknown: set[str] = set()
    for model_id, record in _deployments(store).items():
        try:
            stages = _placements_of(record.get("stages") if isinstance(record, dict) else None)
        except ValueError:
            unknown.add(model_id)
            continue
        placed.update((stage.agent_id, model_id, stage.layer_start, stage.layer_end) for stage in stages)
    return {agent_id: stale for agent_id, refs in hosted.items()
            if (stale := [ref for ref in refs if ref.model_id not in unknown
                          and (agent_id, ref.model_id, ref.layer_start, ref.layer_end) not in placed])}


def awaiting_take_back(store: FleetStore, agent_id: str) -> frozenset[str]:
    """The models whose deployment a run re-planned without `agent_id`, a PC the admin's deploy placed: the next run
    of each (or `serve --fleet`, at once where it runs) takes the PC back (pcs_back) and most often gives it the stage
    it held, which it then keeps as built instead of loading and compiling it again. DeployError for a damaged file.
    """
    roster, removed = store.roster(), pki.RevocationSet()  # a removed PC registers no more: none to leave out
    return frozenset(model_id for model_id, record in _deployments(store).items()
                     if (left := _left_out(model_id, record, roster, removed)) is not None
                     and agent_id in left.left_out)


# An export this large is said to be checked (verify_export) before its hashing begins: a 40 GB model's takes a while
VERIFY_NOTE_BYTES = 2_000_000_000


def verify_export(model_dir: Path, starting: Callable[[int, int], None] | None = None) -> None:
    """Hash every file of the export against its manifest (an admin's deploy: a run's re-plan hashes only what it
    sends); `starting(files, bytes)` is told first. DeployError naming a damaged or missing file (or manifest)."""
    try:
        manifest = load_manifest(model_dir)
        if starting is not None:
            starting(len(manifest.files), sum(entry.size for entry in manifest.files.values()))
        verify_files(model_dir, manifest)
    except ManifestError as error:
        raise DeployError(str(error)) from None


def unhosted_stages(store: FleetStore, hosted: dict[str, Sequence[StageRef]]) -> dict[str, list[StagePlacement]]:
    """By model id, the stages deployments.json places on a PC that answered (`hosted`: what each agent that
    answered hosts, by agent id) but does not host them now: it restarted, or its user paused and resumed it, since
    the stage was assigned. A PC that did not answer is not counted (the list says it is unreachable). The next run
    on the model gives such stages back at its start. Damaged records are passed over; DeployError for a damaged
    file."""
    lost: dict[str, list[StagePlacement]] = {}
    for model_id, record in sorted(_deployments(store).items()):
        try:
            stages = _placements_of(record.get("stages") if isinstance(record, dict) else None)
        except ValueError:
            continue
        gone = [stage for stage in stages if stage.agent_id in hosted
                and StageRef(model_id, stage.layer_start, stage.layer_end) not in hosted[stage.agent_id]]
        if gone:
            lost[model_id] = gone
    return lost


def load_deployment(store: FleetStore, model_dir: Path) -> tuple[StagePlacement, ...]:
    """The stages saved by the last deploy of this model; DeployError if it was never deployed."""
    record = _deployment_record(store, model_dir)
    if record is None:
        raise DeployError(f"{model_id_of(model_dir)} has not been deployed: run `deskfleet fleet deploy "
                          f"--model {model_dir}{store.data_dir_option}`")
    try:
        return _placements_of(record.get("stages"))
    except ValueError as error:
        raise DeployError(f"{store.data_dir / 'deployments.json'}: the deployment of {model_id_of(model_dir)} is "
                          f"damaged ({error}): run `deskfleet fleet deploy --model {model_dir}{store.data_dir_option}` "
                          "again") from None


class DeploymentWatch:
    """Whether the model's deployment on record still places `stages`, the chain a run drives (FleetPipeline asks
    while it runs): an admin's `fleet deploy`, or another run's re-plan, that saved another one has moved or released
    stages under it, and a stage the chain never told where its results go may now be the last one (its results were
    dropped, and the run waited out its 120 s step timeout). A look is a stat of deployments.json at most every
    DEPLOYMENT_WATCH_S, the file read only when it changed; a record that cannot be read tells nothing."""

    def __init__(self, store: FleetStore, model_dir: Path, stages: Sequence[StagePlacement],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.model_dir = model_dir
        self.stages = tuple(stages)
        self._clock = clock
        self._looked_at = -math.inf  # the clock's time of the last stat
        self._seen: tuple[int, int] | None = None  # deployments.json's (mtime_ns, size) when last read

    def __call__(self) -> bool:
        """Whether the deployment on record places other stages now (False too while it cannot be read)."""
        now = self._clock()
        if now - self._looked_at < DEPLOYMENT_WATCH_S:
            return False
        self._looked_at = now
        try:
            status = (self.store.data_dir / "deployments.json").stat()
        except OSError:
            return False
        seen = (status.st_mtime_ns, status.st_size)
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            return load_deployment(self.store, self.model_dir) != self.stages
        except (DeployError, OSError, ManifestError):
            return False


def load_deploy_settings(store: FleetStore, model_dir: Path) -> DeploySettings:
    """The settings of the last deploy of this model (the defaults for a record saved without them)."""
    return _settings_of(_deployment_record(store, model_dir), model_dir)


def _settings_of(record: object, model_dir: Path | str) -> DeploySettings:
    """A record's deploy settings (the defaults for one saved without them); DeployError when they cannot be read."""
    settings = record.get("settings") if isinstance(record, dict) else None
    if not isinstance(settings, dict):
        return DeploySettings()
    try:
        kv_cache = settings.get("kv_cache")
        hop_cost = float(settings.get("hop_cost", PlanOptions.hop_cost))  # absent: saved before hops had a price
        if not 0 <= hop_cost < math.inf:
            raise ValueError(f"hop_cost {hop_cost} is not a cost")
        return DeploySettings(PlanPolicy(settings["policy"]), int(settings["streams"]),
                              Precision(settings["precision"]), str(settings["device"]),
                              None if kv_cache is None else str(kv_cache), hop_cost)
    except (KeyError, ValueError, TypeError) as error:
        raise DeployError(f"the saved deployment of {model_dir} has unreadable settings ({error}): "
                          "deploy it again") from None


def inexact_cache_note(store: FleetStore, model_dir: Path) -> str | None:
    """What a drafted run over the saved deployment of `model_dir` is told when its stages keep a KV cache other
    than f32; None when they keep f32, the device's own cache is not known here, or the settings cannot be read
    (opening the chain then names what is wrong). Such a run is not token-identical to plain decoding: a
    verification of K+1 positions reads the u8 (or f16) cache in another order than one-token steps do, and a
    near-tie can go the other way (a local run switches its cache to f32 for drafting by itself; a deploy cannot
    know that later runs will draft): a fleet deployed with the defaults gave the demo target other text with
    --draft than the local run did."""
    try:
        settings = load_deploy_settings(store, model_dir)
    except DeployError:
        return None
    cache = kv_cache_precision(settings.precision, settings.device, settings.kv_cache)
    if cache is None or cache == "f32":
        return None
    exact = replace(settings, kv_cache="f32").command_options()  # the deploy's other options kept
    return (f"the fleet's stages of {model_dir} keep a {cache} KV cache, as it was deployed: drafted output can part "
            f"from plain decoding, and verification is slower there; `deskfleet fleet deploy --model "
            f"{shlex.quote(str(model_dir))}{store.data_dir_option}{exact}` for token-identical output")


@dataclass(frozen=True)
class LeftOut:
    """A deployment that a run's re-plan saved without some of the PCs the admin's `fleet deploy` placed."""

    model_id: str
    model_dir: str  # the export folder the record names
    deployed: tuple[str, ...]  # the PCs the admin's deploy placed
    left_out: tuple[str, ...]  # those the deployment on record does not place
    replanned_at: str  # ISO 8601 UTC: when the survey of the re-plan that saved it began
    called_in: tuple[str, ...]  # of `left_out`, those whose agent registered with `fleet serve` since
    deploy_options: str = ""  # the deploy's options as `fleet deploy` takes them (DeploySettings.command_options)
    added: tuple[str, ...] = ()  # the PCs the deployment on record places that the admin's deploy did not


@dataclass(frozen=True)
class PcsBack:
    """PCs an admin's deploy placed that a run's re-plan left out, which called in since (pcs_back)."""

    agents: tuple[str, ...]
    replanned_at: str  # ISO 8601 UTC: when the survey of the re-plan that left them out began
    left_out: tuple[str, ...]  # every PC of the admin's deploy the deployment leaves out (`agents` among them)


def pcs_back(store: FleetStore, model_dir: Path) -> PcsBack | None:
    """The PCs of the model's last admin deploy that the deployment on record leaves out (a run's re-plan went on
    without them) and whose agent registered with `fleet serve` since that re-plan: restarted, or back on the
    network. A PC removed from the fleet (`fleet remove`) is not missed, and one a run's start already tried to take
    back (note_rejoin_tried) is back only once it registers again after that. None when there are none, the record
    is an admin's deploy, or it (or the roster, or revoked.json) cannot be read: the chain's opening then says what
    is wrong. A PC that comes back without registering again (a pause its user ended, a link that stayed up
    through a freeze) is not seen here: `fleet deploy` takes it."""
    try:
        record = _deployment_record(store, model_dir)
        left_out = _left_out(model_id_of(model_dir), record, store.roster(), Revocations(store)())
    except (DeployError, FleetStoreError, OSError, ManifestError, pki.PkiError):
        return None
    if left_out is None or not left_out.called_in:
        return None
    return PcsBack(left_out.called_in, left_out.replanned_at, left_out.left_out)


def note_rejoin_tried(store: FleetStore, model_dir: Path, when: datetime.datetime) -> None:
    """Record in the model's deployment that a run's start tried to take back its PCs at `when` and could not (the
    plan left them out, or the re-plan failed): pcs_back then waits for a registration after it, instead of every
    run surveying the fleet again for a PC that is paused, short of memory, or gone again. Best effort: a record
    that cannot be written is left as it was (the next run tries again)."""
    with contextlib.suppress(DeployError, FleetStoreError, OSError, ManifestError):
        with store.locked():
            deployments = _deployments(store)
            record = deployments.get(model_id_of(model_dir))
            if isinstance(record, dict) and isinstance(record.get("replanned_at"), str):
                record["rejoin_tried_at"] = when.isoformat()
                store.write("deployments", deployments)


@dataclass(frozen=True)
class CalledInSinceAssigned:
    """Stages of a deployment on record whose PC's agent called in since they were assigned (placed_pcs_called_in)."""

    stages: tuple[StagePlacement, ...]
    assigned_at: str | None  # ISO 8601 UTC: when the deploy began assigning them; None: a record older than that
    call_ins: tuple[str, ...]  # each stage's PC's call-in (the roster's registered_at), in the order of `stages`


def placed_pcs_called_in(store: FleetStore, model_dir: Path) -> CalledInSinceAssigned | None:
    """The stages of the model's deployment on record whose PC's agent called in to `fleet serve` since the deploy (or
    re-plan) that saved it began assigning them, each with a call-in no run has asked about yet (note_hosting_checked):
    restarted, resumed by its user, plugged in again, each of which may have cost the PC its stage (a restarted agent
    hosts none, a paused one gives its stages up), which the chain would learn only at its first step. The roster's
    `registered_at`, no dial. None when there are none, or the record or roster cannot be read (the chain's opening
    says what is wrong). A record saved before deskfleet kept `assigned_at` counts every call-in on record, once."""
    placed = _placed_on_record(store, model_dir)
    if placed is None:
        return None
    record, stages, roster = placed
    assigned_at, since = record.get("assigned_at"), datetime.datetime.min.replace(tzinfo=datetime.UTC)
    try:
        since = _utc_time(assigned_at)  # type: ignore[arg-type]
    except (ValueError, TypeError):  # absent or damaged: every call-in on record counts
        assigned_at = None
    asked = _hosting_checked(record)
    called_in = [(stage, entry.registered_at) for stage in stages
                 if called_in_since(entry := roster.get(stage.agent_id), since) and entry is not None
                 and entry.registered_at is not None and asked.get(stage.agent_id) != entry.registered_at]
    if not called_in:
        return None
    return CalledInSinceAssigned(tuple(stage for stage, _ in called_in), assigned_at,
                                 tuple(call_in for _, call_in in called_in))


def note_hosting_checked(store: FleetStore, model_dir: Path, called_in: CalledInSinceAssigned) -> None:
    """Record in the model's deployment that a run asked the PCs of `called_in` whether they still host their stages
    (`hosting_checked`: each PC's call-in asked about): placed_pcs_called_in then names a PC again only once it calls
    in again, not at every run's start. Per PC: a call-in that came while another PC was asked about is still asked
    about. Best effort, as note_rejoin_tried; a record since saved anew (other stages) is left as it is."""
    with contextlib.suppress(DeployError, FleetStoreError, OSError, ManifestError):
        with store.locked():
            deployments = _deployments(store)
            record = deployments.get(model_id_of(model_dir))
            if not isinstance(record, dict) or (called_in.assigned_at is not None
                                                and record.get("assigned_at") != called_in.assigned_at):
                return
            asked = _hosting_checked(record)
            asked.update((stage.agent_id, call_in) for stage, call_in in zip(called_in.stages, called_in.call_ins,
                                                                             strict=True))
            record["hosting_checked"] = asked
            store.write("deployments", deployments)


def left_out_by_replans(store: FleetStore) -> list[LeftOut]:
    """Every deployment on record that a run's re-plan saved without some of its admin's PCs (`fleet ls` says
    which, and whether they will be taken back); records that cannot be read are passed over (`fleet ls` names
    a damaged deployments.json by itself)."""
    try:
        deployments = _deployments(store)
        roster = store.roster()
        removed = Revocations(store)()
    except (DeployError, FleetStoreError, pki.PkiError):
        return []
    found = (_left_out(model_id, record, roster, removed) for model_id, record in sorted(deployments.items()))
    return [left_out for left_out in found if left_out is not None]


@dataclass(frozen=True)
class ReaddressedSinceAssigned:
    """PCs of a deployment on record that no longer list addresses they listed when it was saved
    (placed_pcs_readdressed)."""

    agents: tuple[str, ...]
    assigned_at: str | None  # ISO 8601 UTC: when the deploy began assigning the stages
    gone: tuple[tuple[str, ...], ...]  # each PC's addresses it no longer lists, in the order of `agents`
    now_at: tuple[tuple[str, ...], ...]  # each PC's addresses on the roster now


def placed_pcs_readdressed(store: FleetStore, model_dir: Path) -> ReaddressedSinceAssigned | None:
    """The PCs of the model's deployment on record that no longer list, on the roster, an address they listed when it
    was saved (its `roster_addresses`: a new DHCP lease, a rotated IPv6 address), each at a set of addresses no run's
    re-plan has tried and failed on yet (note_readdress_tried). The chain on record gave the stage before each, and the
    driver, the gone address: its first step would fail over, after a dial of it timed out. An address added, a first
    registration, or a new order is no change. The files alone, no dial; None when there are none, or the record (one
    saved before deskfleet kept `roster_addresses` too) or the roster cannot tell."""
    placed = _placed_on_record(store, model_dir)
    if placed is None:
        return None
    record, stages, roster = placed
    tried = _readdress_tried(record)
    changed = [(agent_id, gone, entry.addresses) for agent_id in dict.fromkeys(stage.agent_id for stage in stages)
               if (entry := roster.get(agent_id)) is not None
               and (gone := _addresses_gone(record, agent_id, entry.addresses))
               and tried.get(agent_id) != tuple(sorted(entry.addresses))]
    if not changed:
        return None
    assigned_at = record.get("assigned_at")
    return ReaddressedSinceAssigned(tuple(agent_id for agent_id, _, _ in changed),
                                    assigned_at if isinstance(assigned_at, str) else None,
                                    tuple(gone for _, gone, _ in changed), tuple(now for _, _, now in changed))


def note_readdress_tried(store: FleetStore, model_dir: Path, readdressed: ReaddressedSinceAssigned) -> None:
    """Record in the model's deployment that a run's re-plan for the PCs of `readdressed` failed (`readdress_tried`:
    each PC's addresses then), so that placed_pcs_readdressed names a PC again only once its addresses change again,
    not at every run's start (its chain's first step says what is wrong). Best effort, as note_hosting_checked."""
    with contextlib.suppress(DeployError, FleetStoreError, OSError, ManifestError):
        with store.locked():
            deployments = _deployments(store)
            record = deployments.get(model_id_of(model_dir))
            if not isinstance(record, dict) or record.get("assigned_at") != readdressed.assigned_at:
                return
            tried = {**_readdress_tried(record), **dict(zip(readdressed.agents, (
                tuple(sorted(now)) for now in readdressed.now_at), strict=True))}
            record["readdress_tried"] = {agent_id: list(addresses) for agent_id, addresses in tried.items()}
            store.write("deployments", deployments)


def addresses_gone_since_saved(store: FleetStore, model_dir: Path, stages: Sequence[StagePlacement],
                               agent_id: str) -> tuple[str, ...]:
    """The addresses `agent_id` listed on the roster when the deployment on record, where it places `stages`, was
    saved, and no longer lists (placed_pcs_readdressed): the stage before that PC was given them. () where none
    went, or where the files cannot tell (a record of other stages: another run's re-plan or an admin's deploy saved
    since)."""
    try:
        record = _deployment_record(store, model_dir)
        if record is None or _placements_of(record.get("stages")) != tuple(stages):
            return ()
        entry = store.roster().get(agent_id)
    except (DeployError, FleetStoreError, OSError, ManifestError, ValueError):
        return ()
    return () if entry is None else _addresses_gone(record, agent_id, entry.addresses)


def called_in_since(entry: RosterEntry | None, moment: datetime.datetime) -> bool:
    """Whether the roster says the agent registered, or called in, after `moment`; False for none on record or a
    time that cannot be read."""
    if entry is None or entry.registered_at is None:
        return False
    try:
        return _utc_time(entry.registered_at) > moment
    except ValueError:
        return False


def utc_text(iso: str) -> str:
    """A time the store wrote (ISO 8601) as notes give it: "2026-12-05 08:00:00 UTC"; the text as it is where it
    cannot be read as one with a zone."""
    try:
        return _utc_time(iso).astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (ValueError, TypeError):
        return iso


# Private functions

def _placed_on_record(store: FleetStore, model_dir: Path
                      ) -> tuple[dict[str, Any], tuple[StagePlacement, ...], dict[str, RosterEntry]] | None:
    """The model's deployment record, its stages and the roster; None where it has none, or either file cannot be
    read."""
    try:
        record = _deployment_record(store, model_dir)
        if record is None:
            return None
        return record, _placements_of(record.get("stages")), store.roster()
    except (DeployError, FleetStoreError, OSError, ManifestError, ValueError):
        return None


def _readdress_tried(record: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """A record's `readdress_tried` (agent id -> the addresses, sorted, a run's re-plan failed on); {} for none or a
    damaged one."""
    tried = record.get("readdress_tried")
    if not isinstance(tried, dict):
        return {}
    return {agent_id: tuple(addresses) for agent_id, addresses in tried.items()
            if isinstance(agent_id, str) and isinstance(addresses, list)
            and all(isinstance(address, str) for address in addresses)}


def _addresses_gone(record: dict[str, Any], agent_id: str, now: tuple[str, ...]) -> tuple[str, ...]:
    """Of the addresses `agent_id` listed on the roster when `record` was saved (`roster_addresses`), those it no
    longer lists (`now`); () for a record that kept none (saved before deskfleet kept them) or a damaged one."""
    kept = record.get("roster_addresses")
    then = kept.get(agent_id) if isinstance(kept, dict) else None
    if not isinstance(then, list) or not all(isinstance(address, str) for address in then):
        return ()
    return tuple(address for address in then if address not in now)


def _hosting_checked(record: dict[str, Any]) -> dict[str, str]:
    """A record's `hosting_checked` (agent id -> the call-in a run asked it about); {} for none or a damaged one."""
    asked = record.get("hosting_checked")
    if not isinstance(asked, dict):
        return {}
    return {agent_id: call_in for agent_id, call_in in asked.items()
            if isinstance(agent_id, str) and isinstance(call_in, str)}


def _left_out(model_id: str, record: object, roster: dict[str, RosterEntry],
              removed: pki.RevocationSet) -> LeftOut | None:
    """What a record's re-plan left out of its admin's PCs (LeftOut; a PC since removed from the fleet is no longer
    one of them); None for an admin's deploy, a re-plan that kept them all, or a record whose `replanned_at` or
    stages cannot be read. A PC counts as called in when it registered after the re-plan's survey began and after
    the last time a run's start tried to take it back (`rejoin_tried_at`)."""
    replanned_at = record.get("replanned_at") if isinstance(record, dict) else None
    if not isinstance(record, dict) or not isinstance(replanned_at, str):
        return None
    try:
        since = _utc_time(replanned_at)
        placed = {stage.agent_id for stage in _placements_of(record.get("stages"))}
    except ValueError:
        return None
    with contextlib.suppress(ValueError, TypeError):  # absent or damaged: the re-plan's time stands
        since = max(since, _utc_time(record.get("rejoin_tried_at")))  # type: ignore[arg-type]
    deployed = [agent_id for agent_id in _deployed_agents(record) if not removed.is_revoked(agent_id)]
    left_out = tuple(agent_id for agent_id in deployed if agent_id not in placed)
    if not left_out:
        return None
    called_in = [agent_id for agent_id in left_out if called_in_since(roster.get(agent_id), since)]
    folder = record.get("model_dir")
    try:
        settings = _settings_of(record, str(folder)).command_options()
    except DeployError:
        settings = ""
    added = tuple(sorted(placed - set(_deployed_agents(record))))
    return LeftOut(model_id, folder if isinstance(folder, str) else "?", tuple(deployed), left_out, replanned_at,
                   tuple(called_in), settings, added)


def _deployed_agents(record: object) -> list[str]:
    """A record's `deployed_agents` (the PCs the admin's deploy placed); [] for none, a record saved before it,
    or a damaged one."""
    agents = record.get("deployed_agents") if isinstance(record, dict) else None
    return [item for item in agents if isinstance(item, str) and is_agent_id(item)] if isinstance(agents, list) else []


def _placed_agents(record: object) -> list[str]:
    """The agents a record's stages place, in chain order; [] for none or a damaged record."""
    try:
        return list(dict.fromkeys(stage.agent_id for stage in _placements_of(
            record.get("stages") if isinstance(record, dict) else None)))
    except ValueError:
        return []


def _utc_time(text: str) -> datetime.datetime:
    """An ISO 8601 time as the store writes it (utc_now); ValueError for anything else, or one without a zone
    (TypeError for what is no string)."""
    moment = datetime.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return moment


def _at(address: str) -> str:
    """" at ADDRESS", or nothing for an enrolled PC that never said where it listens."""
    return "" if address == NO_ADDRESS else f" at {address}"


def _replaced_ids(record: object) -> list[str]:
    """A record's `replaces`: the ids of the exports its folder held before, newest first; [] for none, a
    record saved before it, or a damaged one (nothing is released for it)."""
    ids = record.get("replaces") if isinstance(record, dict) else None
    return [item for item in ids if isinstance(item, str)] if isinstance(ids, list) else []


def _deployments(store: FleetStore) -> dict[str, Any]:
    """deployments.json's records by model id; DeployError naming the file when it holds something else."""
    body = store.read("deployments", {})
    if not isinstance(body, dict):
        raise DeployError(f"{store.data_dir / 'deployments.json'} must hold an object of deployments by model id, "
                          f"not {body!r:.60}; fix or remove it (then deploy the models again)")
    return body


def _deployment_record(store: FleetStore, model_dir: Path) -> dict[str, Any] | None:
    """This model's record; a damaged one (not an object) reads as a dict without stages."""
    record = _deployments(store).get(model_id_of(model_dir))
    if record is None:
        return None
    return record if isinstance(record, dict) else {}


def _placements_of(stages: object) -> tuple[StagePlacement, ...]:
    """A saved record's stages, each field checked, contiguous from layer 0; ValueError saying what is wrong."""
    if not isinstance(stages, list) or not stages:
        raise ValueError(f"its stages must be a non-empty list, not {stages!r:.60}")
    placements = tuple(_placement_of(index, stage) for index, stage in enumerate(stages))
    expected_start = 0
    for index, placement in enumerate(placements):
        if placement.layer_start != expected_start:
            raise ValueError(f"stage {index} starts at layer {placement.layer_start}, not {expected_start}")
        expected_start = placement.layer_end
    return placements


def _placement_of(index: int, stage: object) -> StagePlacement:
    names = [field.name for field in fields(StagePlacement)]
    if not isinstance(stage, dict) or sorted(stage) != sorted(names):
        raise ValueError(f"stage {index} must be an object with exactly {', '.join(names)}, not {stage!r:.80}")
    agent_id, address, start, end = (stage[name] for name in names)
    if not isinstance(agent_id, str) or not is_agent_id(agent_id):
        raise ValueError(f"stage {index}'s agent_id {agent_id!r:.60} is not an agent id")
    try:
        parse_address(address if isinstance(address, str) else "")
    except ProtocolError:
        raise ValueError(f"stage {index}'s address {address!r:.60} is not host:port") from None
    whole = all(isinstance(value, int) and not isinstance(value, bool) for value in (start, end))
    if not whole or not 0 <= start < end:
        raise ValueError(f"stage {index}'s layers [{start!r:.20}:{end!r:.20}] are not a range of layers")
    return StagePlacement(agent_id, address, start, end)


def _stage_entries(model_dir: Path, manifest: Manifest, placement: StagePlacement) -> tuple[ManifestEntry, ...]:
    manifest_bytes = (model_dir / MANIFEST_NAME).read_bytes()
    entries = [ManifestEntry(MANIFEST_NAME, hashlib.sha256(manifest_bytes).hexdigest(), len(manifest_bytes))]
    for stem in manifest.stage_ir_stems(placement.layer_start, placement.layer_end):
        for name in manifest.ir_files(stem):
            entry = manifest.files[name]
            entries.append(ManifestEntry(name, entry.sha256, entry.size))
    return tuple(entries)


async def _deploy_stage(link: Link, model_dir: Path, assignment: AssignStage, sent: dict[str, int],
                        files: dict[str, int], progress: Progress | None) -> None:
    agent_id = link.peer.agent_id
    sent.setdefault(agent_id, 0)
    files.setdefault(agent_id, 0)
    by_sha = {entry.sha256: entry for entry in assignment.manifest}
    try:
        for attempt in range(2):
            # with the sizes, the agent keeps the whole stage from eviction, or refuses it at once if it cannot fit
            await link.send(ShardQuery(tuple(by_sha), tuple(entry.size for entry in by_sha.values())))
            have = await _expect(link, ShardHave, REPLY_TIMEOUT_S)
            offsets = {partial.sha256: partial.offset for partial in have.partial}
            pushed = [entry for sha256, entry in by_sha.items() if sha256 not in have.complete]
            for entry in pushed:
                sent[agent_id] += await _push(link, model_dir, entry, offsets.get(entry.sha256, 0), progress)
                files[agent_id] += 1
            await link.send(ShardQuery(tuple(by_sha)))
            try:
                confirmed = await _expect(link, ShardHave, REPLY_TIMEOUT_S)
            except DeployError as error:
                # a shard whose bytes did not hash to its sha256 (damaged on the way, or on the PC's disk: a partial
                # file it resumed) was discarded: one more round sends it whole. The deploy failed, and the next
                # one went through.
                if error.code is not ErrorCode.SHARD_MISMATCH or attempt:
                    raise
                log.warning("agent %s: %s; sending it again", agent_id[:12], _name_shards(str(error), by_sha))
                await _reply_past_mismatches(link)  # the confirming query's own answer, still to come
                continue
            missing = sorted(by_sha[sha].file_name for sha in set(by_sha) - set(confirmed.complete))
            if missing:
                raise DeployError(f"agent {agent_id[:12]} did not keep {', '.join(missing)}",
                                  agents=frozenset({agent_id}))
            await link.send(assignment)
            try:
                await _expect(link, StageReady, COMPILE_TIMEOUT_S)
                return
            except DeployError as error:
                # a cached file that changed on disk since it was verified: the agent dropped it, so one more
                # round sends it again
                if error.code is not ErrorCode.SHARD_MISMATCH or attempt:
                    raise
                log.warning("agent %s: %s; sending what it dropped again", agent_id[:12], error)
    except LinkError as error:
        raise DeployError(f"agent {agent_id[:12]} at {link.address}: {error}", agents=frozenset({agent_id}),
                          death=LinkDeath.of(link, error)) from None
    except DeployError as error:
        named = _name_shards(str(error), by_sha)
        if named == str(error):
            raise
        raise DeployError(named, error.code, error.agents, error.exclusion_reasons, error.failed_run) from None


def _name_shards(text: str, by_sha: dict[str, ManifestEntry]) -> str:
    """`text` (an agent's refusal) with the export's file name after each shard it names by its sha256's start: an
    agent knows shards by content only."""
    for sha256, entry in by_sha.items():
        text = text.replace(f"shard {sha256[:12]}…", f"shard {sha256[:12]}… ({entry.file_name})")
    return text


def _open_export_file(model_dir: Path, entry: ManifestEntry) -> BinaryIO:
    """The export's file, opened once (a link is refused, also one swapped in after a check) and checked
    against the manifest's size and sha256 through that same handle, rewound: every byte a deploy sends is
    the export's own. DeployError naming the file otherwise (damaged since the export, or a tampered folder
    linking in a file from elsewhere, such as /etc/passwd)."""
    try:
        path = model_file(model_dir, entry.file_name)
        stream = os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)),
                           "rb")
    except ManifestError as error:
        raise DeployError(str(error)) from None
    except OSError as error:  # ELOOP: a link appeared after the check
        raise DeployError(f"{model_dir / entry.file_name} cannot be opened as a file of the export: "
                          f"{error.strerror or error}") from None
    try:
        size = os.fstat(stream.fileno()).st_size
        if size != entry.size:
            raise DeployError(f"{model_dir / entry.file_name} has {size} bytes, the export's manifest says "
                              f"{entry.size}: is the export folder complete?")
        digest = hashlib.sha256()
        while chunk := stream.read(CHUNK_BYTES):
            digest.update(chunk)
        if (found := digest.hexdigest()) != entry.sha256:
            raise DeployError(f"{model_dir / entry.file_name} is damaged: its bytes hash to {found[:12]}…, the "
                              f"export's manifest says {entry.sha256[:12]}…; export the model again")
        stream.seek(0)
    except BaseException:
        stream.close()
        raise
    return stream


async def _push(link: Link, model_dir: Path, entry: ManifestEntry, offset: int, progress: Progress | None) -> int:
    """Send the export's file from `offset` in chunks, then ShardComplete; returns the bytes sent."""
    path = model_dir / entry.file_name
    sent = 0
    with await asyncio.to_thread(_open_export_file, model_dir, entry) as stream:
        stream.seek(offset)
        while offset < entry.size:
            data = stream.read(CHUNK_BYTES)
            if not data:
                raise DeployError(f"{path} shrank while it was being sent")
            await link.send(ShardChunk(entry.sha256, offset, entry.size, data))
            offset += len(data)
            sent += len(data)
            if progress is not None:
                progress(link.peer.agent_id, entry.file_name, offset, entry.size)
    await link.send(ShardComplete(entry.sha256))
    return sent


async def _reply_past_mismatches(link: Link) -> ShardHave:
    """The next ShardHave, past the refusals of other shards that did not match their sha256 (each is sent
    again)."""
    while True:
        try:
            return await _expect(link, ShardHave, REPLY_TIMEOUT_S)
        except DeployError as error:
            if error.code is not ErrorCode.SHARD_MISMATCH:
                raise


async def _expect(link: Link, kind: type[_M], timeout: float) -> _M:
    """The next message of `kind` within `timeout` (messages of other kinds, and other chains' step errors, count
    against it); an Error from the agent becomes DeployError."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            message = await asyncio.wait_for(link.receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise DeployError(f"agent {link.peer.agent_id[:12]} sent no {kind.__name__} in {timeout:.0f} s",
                              agents=frozenset({link.peer.agent_id})) from None
        if isinstance(message, Error) and message.micro_batch_id is not None:
            # a step's error of a chain through this PC (its next hop lost mid-run), sent here as the link that spoke
            # last: no answer to this deploy. Taken for one, it left the healthy PC out of the re-plan too
            log.info("agent %s: ignoring an error about micro-batch %d during the deploy: %s", link.peer.agent_id[:12],
                     message.micro_batch_id, message.message)
            continue
        if isinstance(message, Error):
            # BAD_MESSAGE: what was sent is at fault (an export whose files contradict its manifest), not the PC
            failed = frozenset() if message.code is ErrorCode.BAD_MESSAGE else frozenset({link.peer.agent_id})
            raise DeployError(f"agent {link.peer.agent_id[:12]} refused: {message.code.value}: {message.message}",
                              message.code, failed)
        if isinstance(message, kind):
            return message


def _check_same_fleet(store: FleetStore, fleet_id: str | None, then: str) -> None:
    """DeployError where the data dir's fleet is no longer `fleet_id` (None: not checked); `then`: what became of the
    deploy's work."""
    if fleet_id is not None and (now := pki.fleet_id(store.tls_files.ca_certificate())) != fleet_id:
        raise DeployError(f"the fleet was made anew (`deskfleet fleet init --force`: fleet {now}, was {fleet_id}) "
                          f"while this deploy ran, {then}; deploy once the PCs have joined the new fleet",
                          failed_run=True)


def _check_fleet_unchanged(store: FleetStore, report: DeployReport, fleet_id: str | None) -> None:
    """DeployError where the data dir's fleet is no longer `fleet_id`, or a PC of `report` was removed."""
    _check_same_fleet(store, fleet_id, f"{UNRECORDED}: the PCs were told to release the stages again")
    removed = Revocations(store)() if report.stages else pki.RevocationSet()
    gone = [stage.agent_id for stage in report.stages if removed.is_revoked(stage.agent_id)]
    if gone:
        raise DeployError(f"agent(s) {', '.join(agent_id[:12] for agent_id in gone)} were removed from the fleet "
                          f"(`deskfleet fleet remove`) while this deploy ran, {UNRECORDED}: the PCs were told to "
                          "release the stages again; deploy again, without them", agents=frozenset(gone),
                          failed_run=True)


def _save_deployment(store: FleetStore, model_dir: Path, report: DeployReport, settings: DeploySettings,
                     replanned_at: datetime.datetime | None = None, assigned_at: datetime.datetime | None = None,
                     fleet_id: str | None = None) -> None:
    """Save the model's deployment: `replanned_at` a run's re-plan's (whose survey began then), `assigned_at` when
    its stages began to be assigned (None: now). DeployError where, since the deploy's survey, the fleet was made
    anew (`fleet_id`: the one it surveyed) or a PC of it removed: nothing is recorded (the caller releases the
    stages). Before, the record of the old fleet's PCs went into the new fleet's data dir, and a removed PC's stage
    into the deployment, each found by the next run."""
    with store.locked():
        _check_fleet_unchanged(store, report, fleet_id)
        folder = str(model_dir.resolve())
        # The records of the exports this folder held before (exported again since): it holds this one now. They
        # go, and their ids are kept in `replaces`, for this deploy and the next ones to release their stages on
        # every PC they reach (a PC off now keeps its stage, marked "not deployed", until then, or until `fleet serve`
        # releases it when the PC registers again). A copy of such an export in another folder is then no longer
        # deployed: `fleet deploy` it to run it.
        earlier = _deployments(store)
        old = earlier.get(report.model_id)
        replaced = [model_id for model_id, record in earlier.items()
                    if model_id != report.model_id and isinstance(record, dict) and record.get("model_dir") == folder]
        chain = [*replaced, *_replaced_ids(old),
                 *(item for model_id in replaced for item in _replaced_ids(earlier[model_id]))]
        replaces = [model_id for model_id in dict.fromkeys(chain) if model_id != report.model_id][:MAX_REPLACED]
        deployments = {model_id: record for model_id, record in earlier.items() if model_id not in replaced}
        placed = list(dict.fromkeys(stage.agent_id for stage in report.stages))
        # an admin's deploy places its PCs; a re-plan keeps the ones the admin's deploy placed (pcs_back)
        admins = (_deployed_agents(old) or _placed_agents(old) or placed) if replanned_at is not None else placed
        extra: dict[str, object] = {"replanned_at": replanned_at.isoformat()} if replanned_at is not None else {}
        # when its stages were assigned: a PC of it that calls in after may have lost its stage (placed_pcs_called_in)
        extra["assigned_at"] = (assigned_at or utc_now()).isoformat()
        # where its PCs registered: one that no longer lists an address gave the stage before it a gone one
        # (placed_pcs_readdressed). Read now, not at the survey: a change in between goes unseen (the chain's first
        # step then fails over as before)
        try:
            roster = store.roster()
            extra["roster_addresses"] = {agent_id: list(roster[agent_id].addresses) for agent_id in placed
                                         if agent_id in roster}
        except FleetStoreError as error:  # a damaged roster: runs cannot tell a change, as before deskfleet kept them
            log.warning("the deployment keeps no roster addresses: %s", error)
        deployments[report.model_id] = {"model_dir": folder, "replaces": replaces, "deployed_agents": admins, **extra,
                                        "stages": [asdict(stage) for stage in report.stages],
                                        "settings": {"policy": settings.policy.value, "streams": settings.streams,
                                                     "precision": settings.precision.value,
                                                     "device": settings.device, "kv_cache": settings.kv_cache,
                                                     "hop_cost": settings.hop_cost}}
        try:
            store.write("deployments", deployments)
        except FleetStoreError as error:  # a full disk. It said "the stages are assigned", but deploy() then
            # released them (nothing runs on a deployment that is not on record)
            raise DeployError(f"every stage was sent and assigned, {UNRECORDED}: {error}; "
                              "the PCs were told to release the stages again. Make room for the data dir's files, "
                              "then `fleet deploy` again: it sends nothing the PCs already hold", failed_run=True
                              ) from None


# How a deploy says its record could not be written (a full disk under the controller's data dir): a failover's
# remedy then is to make room there, not to mend a PC
UNRECORDED = "but the deployment could not be recorded"


def policy_options(policy: str, streams: int = 1, hop_ms: float | None = None,
                   device: str | None = None) -> PlanOptions:
    """The options of `fleet plan` / `deploy`: `hop_ms` what a stage's hop costs a token (None: the planner's
    default), in milliseconds as the CLI takes it (the planner's unit is bytes / (GB/s): nanoseconds); `device`
    the one the stages compile on (agents that lack it are left out; a deploy sets it itself)."""
    options = PlanOptions(policy=PlanPolicy(policy), streams=streams, device=device)
    return options if hop_ms is None else replace(options, hop_cost=hop_ms * 1e6)
