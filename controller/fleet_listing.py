"""What `deskfleet fleet ls` and the fleet window show: every PC a survey finds and how it is (its state, its
sensors, the stages it holds), then the notes and warnings on the fleet's deployments, certificates and controller.
No printing and no Qt: controller/fleet_cli.py prints a listing, controller/fleet_window.py draws it."""

from __future__ import annotations

import shlex
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from deskfleet.agent.link import utc_now
from deskfleet.common.wire import PROTOCOL_VERSION, StageRef, StatusReport
from deskfleet.controller import fleet_survey
from deskfleet.controller.fleet_store import FleetStore, FleetStoreError, agent_label
from deskfleet.controller.fleet_survey import (
    NEVER_REGISTERED,
    AgentView,
    SurveyOptions,
    clock_warnings,
    expiry_warnings,
)

STATES_IN_ORDER = ("serving", "available", "paused", "unavailable", "outdated", "newer", "unreachable")
# the states of a PC that can take work: a paused or unavailable one gave its stage up, which its state says
WORKING_STATES = ("serving", "available")


@dataclass(frozen=True)
class FleetListing:
    """One look at the fleet: the PCs in listing order, what each holds that no deployment placed there, and the
    lines to say below them (the PCs to upgrade, notes on the deployments, warnings)."""

    agents: list[AgentView]
    undeployed: dict[str, list[StageRef]] = field(default_factory=dict)  # by agent id: see undeployed_stages
    advice: list[str] = field(default_factory=list)  # upgrade_advice
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # each begins "warning: "
    taken_at: float = 0.0  # when the survey ended (time.time())


async def list_fleet(store: FleetStore, options: SurveyOptions) -> FleetListing:
    """Survey the fleet and say what an admin needs to know of it; never raises for an agent's fault (a store that
    is not initialised raises FleetStoreError, as a survey does)."""
    from deskfleet.controller.fleet_deploy import DeployError, undeployed_stages, unhosted_stages

    found = await fleet_survey.survey(store, options)  # looked up as it runs: a test stands in for it
    await found.close()
    agents = sorted(found.agents, key=listing_order)
    now = utc_now()
    warnings = [f"warning: {line}" for line in (*expiry_warnings(agents, store.tls_files, now),
                                                   *clock_warnings(agents, now.timestamp()))]
    # without `fleet serve` agents cannot register, nor new PCs join: said whatever the list shows (it was said only
    # where a PC was listed as never having called in, so an admin whose PCs all answered did not learn that the
    # next join would fail)
    if store.served() is False:
        never = " (a PC listed as never having called in may be running)" \
            if not agents or any(agent.problem == NEVER_REGISTERED for agent in agents) else ""
        warnings.append(f"warning: no `deskfleet fleet serve` runs on {store.data_dir}: agents cannot register with "
                        f"the controller{never}, nor new PCs join; start it")
    hosted: dict[str, Sequence[StageRef]] = {agent.agent_id: agent.report.stages for agent in agents
              if agent.agent_id is not None and agent.report is not None}
    by_id = {agent.agent_id: agent for agent in agents if agent.agent_id is not None}
    try:
        undeployed = undeployed_stages(store, hosted)
        unhosted = unhosted_stages(store, {agent_id: stages for agent_id, stages in hosted.items()
                                           if agent_state(by_id[agent_id]) in WORKING_STATES})
    except (DeployError, FleetStoreError) as error:  # the list stands without the deployments
        undeployed, unhosted = {}, {}
        warnings.append(f"warning: {error}")
    if undeployed:
        warnings.append(f"warning: {sum(map(len, undeployed.values()))} stage(s) marked 'not deployed' are held by "
                        "PCs that no deployment in deployments.json places them on (a failover re-planned without "
                        "the PC while it was unreachable, the model was exported again since, or a deploy that did "
                        "not finish could not reach the PC to release it): nothing runs on "
                        "them; `deskfleet fleet serve` releases them when the PC registers again, as do the next "
                        "`deskfleet fleet deploy` of their model and restarting the agent")
    hostnames = {**store.hostnames(), **{agent.agent_id: agent.hostname for agent in agents
                                         if agent.agent_id is not None and agent.hostname != "?"}}
    notes = left_out_notes(store, agents, unhosted, hostnames) + [
        f"note: {model_id} has {len(stages)} deployed stage(s) that the PC it was assigned to no longer hosts ("
        + ", ".join(f"[{stage.layer_start}:{stage.layer_end}] on {agent_label(stage.agent_id, hostnames)}"
                    for stage in stages)
        + "; restarted, or paused and resumed, since, or given a stage by a re-plan stopped midway, which it released"
          "): a run on the model that starts after such a PC called in "
          "(a restarted agent does as it starts, a resumed one within a minute) gives its stage back, a running "
          "`serve --fleet` at a moment with no request; `deskfleet fleet deploy` of the model does in any case"
        for model_id, stages in unhosted.items()]
    return FleetListing(agents, undeployed, upgrade_advice(agents), notes, warnings, time.time())


def state_counts(agents: Sequence[Any], undeployed: dict[str, list[StageRef]] | None = None) -> str:
    """"5 agent(s): 2 serving, 2 available, 1 unreachable": each state's count, in the listing's order.
    "serving" is the agent's own word for hosting a stage; one whose every stage is marked (not deployed) runs
    nothing, which the count says rather than let it pass for a PC at work."""
    undeployed = undeployed or {}
    counts = Counter(agent_state(agent) for agent in agents)
    states = sorted(counts, key=lambda state: (state not in STATES_IN_ORDER,
                                               STATES_IN_ORDER.index(state) if state in STATES_IN_ORDER else 0))
    idle = sum(1 for agent in agents if agent_state(agent) == "serving" and agent.report is not None
               and agent.report.stages
               and all(stage in undeployed.get(agent.agent_id or "", []) for stage in agent.report.stages))
    return f"{len(agents)} agent(s): " + ", ".join(
        f"{counts[state]} {state}" + (f" ({idle} of them holding only stages not deployed)"
                                      if state == "serving" and idle else "") for state in states)


def agent_state(agent: Any) -> str:
    """Its report's state; "outdated" or "newer" for an agent that speaks an older or newer fleet protocol than this
    controller (it takes no stage until one of the two is upgraded: it was listed "unreachable", as if it were off);
    "unreachable" for one that did not answer."""
    if agent.report:
        return str(agent.report.state.value)
    other = getattr(agent, "other_protocol", None)
    if other is not None:
        return "outdated" if other < PROTOCOL_VERSION else "newer"
    return "unreachable"


def upgrade_advice(agents: list[Any]) -> list[str]:
    """A line for the PCs of an older protocol and one for those of a newer, saying what to upgrade: a rollout
    over hundreds of PCs has to know how many are left, and in which direction."""
    lines = []
    outdated = sum(1 for agent in agents if agent_state(agent) == "outdated")
    newer = sum(1 for agent in agents if agent_state(agent) == "newer")
    if outdated:
        lines.append(f"{outdated} PC(s) run a deskfleet of an older fleet protocol than this controller's "
                     f"({PROTOCOL_VERSION}): upgrade deskfleet on them (and restart their agent); they take no "
                     "stage until then")
    if newer:
        lines.append(f"{newer} PC(s) run a deskfleet of a newer fleet protocol than this controller's "
                     f"({PROTOCOL_VERSION}): upgrade deskfleet here (and restart `deskfleet fleet serve`); they "
                     "take no stage until then")
    return lines


def listing_order(agent: Any) -> tuple[int, bool, str, str]:
    """`fleet ls`'s order, of its table and its --json alike: by state (serving first, unreachable last), then by
    hostname: with 300 PCs in agent-id order, finding one PC, or seeing how many were off, meant reading every row."""
    state = agent_state(agent)
    rank = STATES_IN_ORDER.index(state) if state in STATES_IN_ORDER else len(STATES_IN_ORDER)
    return rank, agent.hostname == "?", agent.hostname.lower(), agent.agent_id or agent.address


def left_out_notes(store: FleetStore, agents: list[Any], unhosted: dict[str, list[Any]],
                     hostnames: dict[str, str]) -> list[str]:
    """A line for each model whose deployment a run's re-plan saved without PCs of its admin's deploy: which, how
    each is now, and what takes it back (the next run on the model, for one that called in since; else a deploy).
    Such a model ran on fewer PCs than deployed with nothing in the list to say so. `unhosted`: the deployed stages
    (by model) that their PC no longer hosts, which the count of PCs it runs on leaves out; `hostnames`: the roster's,
    with those of the agents that answered."""
    from deskfleet.controller.fleet_deploy import left_out_by_replans, utc_text
    from deskfleet.controller.fleet_runs import others_driving

    found = {agent.agent_id: agent for agent in agents if agent.agent_id is not None}
    lines = []
    for record in left_out_by_replans(store):
        driving = others_driving(store, record.model_id)
        who = (f"the run that drives the model now, if it is the only one and a `serve --fleet` (when idle) or a chat "
               f"(before its next message), else the first run that starts while none does ({driving} run(s) drive "
               "it now)" if driving else "the next run on the model")
        pcs = []
        for agent_id in record.left_out:
            agent = found.get(agent_id)
            state = agent_state(agent) if agent is not None else "not found"
            if agent_id in record.called_in:
                called_in = f", called in since: {who} takes it back if it can take work"
            elif state == "available":  # a PC its user resumed calls in once it has been available 20 s
                called_in = ", not called in since: taken back if its agent calls in (one its user resumed does, " \
                            "within a minute), else by the deploy below"
            else:
                called_in = ""
            pcs.append(f"{agent_label(agent_id, hostnames)} ({state}{called_in})")
        # a PC of the deployment that restarted since hosts nothing until taken back: it is not one the model runs on
        idle = list(dict.fromkeys(stage.agent_id for stage in unhosted.get(record.model_id, ())))
        placed = len(set(record.deployed) - set(record.left_out) - set(idle))
        # a re-plan may have moved stages to PCs the deploy did not place: "runs on 0 of the 1 PCs" said nothing of them
        added = [agent_id for agent_id in record.added if agent_id not in idle]
        elsewhere = f", and on {', '.join(agent_label(agent_id, hostnames) for agent_id in added)}, which " \
            "it did not" if added else ""
        restarted = f" (not on {', '.join(agent_label(agent_id, hostnames) for agent_id in idle)}, placed but no " \
            "longer hosting its stage: see the note below)" if idle else ""
        lines.append(f"note: {record.model_id} runs on {placed} of the {len(record.deployed)} PCs its `fleet deploy` "
                     f"placed{elsewhere}{restarted}: a run's re-plan at {utc_text(record.replanned_at)} went on "
                     f"without {', '.join(pcs)}; `deskfleet fleet deploy --model {shlex.quote(record.model_dir)}"
                     f"{store.data_dir_option}{record.deploy_options}` plans over every PC that answers")
    return lines


def agent_json(agent: Any, undeployed: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """One PC as `fleet ls --json` lists it (and the fleet window's pane shows it): all the survey learned of it."""
    report = agent.report
    return {"agent_id": agent.agent_id, "hostname": agent.hostname, "address": agent.address,
            # its other addresses known (registration, mDNS), given to the stage before it with `address`
            "other_addresses": list(getattr(agent, "other_addresses", ())),
            # the IP versions it routes past itself over, which it dials over; []: not reported
            "ip_families": list(report.ip_families) if report else [],
            "sources": list(agent.sources), "problem": agent.problem,
            "version": getattr(agent, "version", None),  # the deskfleet version its Hello named; null: none
            # null: it did not answer; "outdated" / "newer": it speaks another fleet protocol (see "protocol")
            "state": None if agent_state(agent) == "unreachable" else agent_state(agent),
            # the fleet protocol it speaks, where known: this controller's for one that answered
            "protocol": PROTOCOL_VERSION if report else getattr(agent, "other_protocol", None),
            "free_memory_bytes": report.free_memory_bytes if report else None,
            # its sensors as it reported them; null: not known (a PC with no sensor the agent can read, or none there)
            "cpu_load": report.cpu_load if report else None,  # a fraction of all its cores
            "igpu_busy": report.igpu_busy if report else None,  # a fraction
            "temperature_c": report.temperature_c if report else None,
            "battery_percent": report.battery_percent if report else None,
            "on_ac_power": report.on_ac_power if report else None,
            # the weight bytes a decode step streams per second, as its speed probe measured (the planner's speed)
            "weight_gb_per_s": report.weight_gb_per_s if report else None,
            # the bytes of new shard files its shard cache can take; null: not reported
            "shard_room_bytes": report.shard_room_bytes if report else None,
            # its wall clock as it reported (seconds since the epoch); null: not reported
            "clock_s": report.clock_s if report else None,
            "reasons": [reason.value for reason in report.reasons] if report else [],
            "detail": report.detail if report else "",
            "devices": list(report.devices) if report else [],  # what OpenVINO finds there; []: not reported
            "last_error": report.last_error if report else None,  # the agent's latest error (a failed probe, a stage)
            "stages": [[s.model_id, s.layer_start, s.layer_end] for s in report.stages] if report else [],
            # hosted, but placed there by no deployment (see undeployed_stages): the next deploy releases them
            "stages_not_deployed": [[s.model_id, s.layer_start, s.layer_end]
                                    for s in (undeployed or {}).get(agent.agent_id, [])],
            # the agent's certificate as its link showed it (ISO 8601 UTC); null when no link opened
            "certificate_expires": agent.certificate_expires.isoformat() if agent.certificate_expires else None}



class AgentCells(NamedTuple):
    """One PC's row of the listing, as text: `fleet ls` prints it, the fleet window shows it."""

    agent: str  # its id's first 12 characters, "?" where not known
    host: str
    address: str
    state: str
    free: str  # its free memory
    disk: str  # what its shard cache can take of a new stage's files
    cpu: str
    igpu: str
    temperature: str
    power: str
    version: str
    found_by: str
    stages: str  # its stages and the limits it crossed, else why it did not answer


CELL_HEADINGS = AgentCells("agent", "host", "address", "state", "free", "disk", "cpu", "igpu", "temp", "power",
                           "version", "found by", "stages")


def agent_cells(agent: Any, undeployed: dict[str, list[StageRef]] | None = None) -> AgentCells:
    report = agent.report
    # GiB, as the limits beside it say theirs ("8.0 GiB free of 16.0"): "8.6G" next to them read as more
    free = f"{report.free_memory_bytes / 2 ** 30:.1f}GiB" if report else "-"
    # what its shard cache can take of a new stage's files (the wire allows a report without it: not known)
    disk = f"{report.shard_room_bytes / 2 ** 30:.1f}GiB" if report and report.shard_room_bytes is not None else "-"
    stale = (undeployed or {}).get(agent.agent_id, [])
    stages = ", ".join(f"{s.model_id}[{s.layer_start}:{s.layer_end}]{' (not deployed)' if s in stale else ''}"
                       for s in report.stages) if report else ""
    # an unavailable or paused agent's limits, with the numbers; a paused one's also who paused it
    why = f"({report.detail or ', '.join(reason.value for reason in report.reasons)})" \
        if report and (report.reasons or report.detail) else ""
    version = getattr(agent, "version", None) or "-"  # what its Hello said: the PCs not upgraded yet show
    return AgentCells((agent.agent_id or "?")[:12], agent.hostname, agent.address, agent_state(agent), free, disk,
                      percent_text(report.cpu_load if report else None),
                      percent_text(report.igpu_busy if report else None),
                      temperature_text(report), power_text(report), version, ",".join(agent.sources),
                      " ".join(part for part in (stages, why) if part) or agent.problem or "-")


def percent_text(fraction: float | None) -> str:
    """"12%"; "-" where not known (a PC whose iGPU load cannot be read, one that did not answer)."""
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


def temperature_text(report: StatusReport | None) -> str:
    """"52C" (ASCII: a console's code page may lack the degree sign); "-" where the PC has no sensor it can read."""
    return "-" if report is None or report.temperature_c is None else f"{report.temperature_c:.0f}C"


def power_text(report: StatusReport | None) -> str:
    """How the PC is powered, in one word (`fleet ls` is read, and split, by its spaces): "AC" (a desktop: no
    battery), "AC:81%" (a laptop plugged in), "battery:81%" (on its battery); "-" where not known."""
    if report is None:
        return "-"
    power = {True: "AC", False: "battery", None: None}[report.on_ac_power]
    battery = None if report.battery_percent is None else f"{report.battery_percent:.0f}%"
    return ":".join(part for part in (power, battery) if part) or "-"
