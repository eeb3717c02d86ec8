"""The planner: which agent hosts which contiguous layers, and why the others were left out.

Pure code over numbers the caller measured: a model's byte footprint (from an export manifest, or typed
in for a model we do not have) and each candidate agent's state, free memory and relative speed. Stage 0
also holds `embed`, the last stage also holds `head`. Every stage reserves KV memory for the full context
of `streams` rows, a fixed runtime overhead, and leaves a safety margin of the agent's free memory.

The split minimises the slowest stage's estimated time (decode work per token / speed), which makes
layer counts proportional to speed wherever memory allows, by dynamic programming over contiguous ranges.
Under ALL_BY_SPEED every stage also costs a token its hop (`hop_cost`): the plan minimises the slowest stage plus
a hop per stage, so a PC is added only where it shortens the slowest stage by more than a hop; of each chain
order, every leading part is weighed (a PC late in the order, the slowest, is dropped when its share saves less
than its hop).
The chain runs from the fastest agent to the slowest; when no split fits in that order (tight memory: the
fastest agent may have no room for the embed beside a layer, the slowest none for the head), other orders
are searched, every order of up to EVERY_ORDER_UP_TO agents, else every choice of first and last agent, the
rest by speed, within `max_reordered_splits`; where none of those fits a fleet of up to EVERY_CHAIN_UP_TO agents,
the chains that fit are found outright (a search over the subsets of agents used: a middle PC may suit one
position only), so such a fleet is called infeasible only when no chain fits.
A link known broken (`broken_links`: agent A cannot dial agent B, e.g. a firewall between two desks) never joins
two neighbouring stages: the split tracks who holds the stage before, and where an order puts A before B, orders
that keep them apart are tried too (every order of up to EVERY_ORDER_UP_TO agents, else A and B moved round each
other); where no chain over both is as good as one without one of them, that one is left out (BROKEN_LINK).
A unit's work is its weight bytes (decoding reads every weight once) unless the caller knows better: the
head's `head_work` (controller/fleet_deploy.py prices it by parameters on a CPU, where unpacking INT4
weights, not reading them, sets the pace; see `footprint_of`). The embed is a lookup: no work.
A stage's memory is its weights times the model's `resident_factor` (on the CPU plugin 1.3: the weights once,
and where the plugin runs them in place, the part it repacks besides; controller/fleet_deploy.py), its KV cache
times the model's `kv_growth` (the CPU plugin grows a cache by doubling it: up to 2x its tokens' bytes), the
scratch its largest prefill leaves held (`prefill_bytes_per_token` for `streams` prompts of the whole context:
the engine sends a prompt in one call, and prompts that arrive together as one call) and the runtime overhead.
A stage's files (ModelFootprint.sent_files), less those its agent's hosted stages hold, must also fit the room its
agent's shard cache reports (`disk_room_bytes`), where it reports one.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from deskfleet.common.agent_state import AgentState, UnavailableReason
from deskfleet.common.devices import lists_device
from deskfleet.common.wire_messages import is_agent_id

GB = 1_000_000_000
MIB = 1 << 20
EVERY_ORDER_UP_TO = 4  # agents in a chain whose every order the search may try (4! = 24)
EVERY_CHAIN_UP_TO = 10  # eligible agents whose every chain a search for one that fits covers (by subsets: 2^10)
ENDING_FAST = 3  # all_by_speed also tries the chain by speed with each of this many of its fastest moved to its end


@dataclass(frozen=True)
class ModelFiles:
    """The bytes of the files a deploy sends, per export unit (its IR's .xml and .bin), and of those every stage
    gets (the manifest, the RoPE table's IR): what a PC's shard cache must take for a stage."""

    layers: tuple[int, ...]
    embed: int
    head: int
    every_stage: int

    def __post_init__(self) -> None:
        if min((*self.layers, self.embed, self.head, self.every_stage), default=0) < 0:
            raise ValueError("file bytes must be 0 or more")

    @functools.cached_property
    def layer_prefix(self) -> tuple[int, ...]:
        """The layers' bytes summed: layers [start, stop) have layer_prefix[stop] - layer_prefix[start]."""
        return (0, *itertools.accumulate(self.layers))


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes a model needs, per export unit. `layer_bytes[i]` is decoder layer i's weights.

    head_work: the head's decode work per token in the layers' unit (their bytes); None: its bytes.
    resident_factor: the memory a loaded stage holds per byte of its weight files (see footprint_of).
    kv_bytes_per_token_per_layer: as the cache stores a token (the KV precision's bytes, with any scales).
    kv_growth: the memory a KV cache may hold per byte of the tokens in it (a cache grown by doubling: 2).
    prefill_bytes_per_token: the scratch a stage keeps after a prefill, per token of that call (rows x tokens);
    first_prefill_bytes_per_token: the same for the first stage (fed token ids, not hidden states); None: as others.
    kv_precision: the KV cache's precision where known ("u8", "f32"...), shown by the plan's
        text (controller/plan_text); never planned on.
    files: what a deploy sends (see ModelFiles); None: the weights stand for them (a model on paper).
    """

    name: str
    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    kv_bytes_per_token_per_layer: int
    context: int
    head_work: float | None = None
    resident_factor: float = 1.0
    kv_growth: float = 1.0
    prefill_bytes_per_token: int = 0
    kv_precision: str = ""
    first_prefill_bytes_per_token: int | None = None
    files: ModelFiles | None = None

    def __post_init__(self) -> None:
        if self.head_work is not None and not 0 <= self.head_work < math.inf:
            raise ValueError(f"head_work must be 0 or more and finite, got {self.head_work}")
        if not 1.0 <= self.resident_factor < math.inf:
            raise ValueError(f"resident_factor must be 1 or more and finite, got {self.resident_factor}")
        if not 1.0 <= self.kv_growth < math.inf:
            raise ValueError(f"kv_growth must be 1 or more and finite, got {self.kv_growth}")
        for scratch in (self.prefill_bytes_per_token, self.first_prefill_bytes_per_token or 0):
            if scratch < 0:
                raise ValueError(f"prefill bytes per token must be 0 or more, got {scratch}")
        if not self.layer_bytes:
            raise ValueError("the model has no decoder layers")
        sizes = {"layer bytes": min(self.layer_bytes), "embed bytes": self.embed_bytes,
                 "head bytes": self.head_bytes, "KV bytes per token": self.kv_bytes_per_token_per_layer}
        for what, size in sizes.items():
            if size < 0:
                raise ValueError(f"{what} must be 0 or more, got {size}")
        if self.context < 1:
            raise ValueError(f"the context must be at least 1 token, got {self.context}")
        if self.files is not None and len(self.files.layers) != len(self.layer_bytes):
            raise ValueError(f"the files name {len(self.files.layers)} layers, the model has {len(self.layer_bytes)}")

    @classmethod
    def uniform(cls, name: str, num_layers: int, layer_bytes: int, embed_bytes: int, head_bytes: int,
                kv_bytes_per_token_per_layer: int, context: int) -> ModelFootprint:
        """A model of identical layers: how to plan on paper (e.g. 80 layers of a 70B INT4)."""
        return cls(name, (layer_bytes,) * num_layers, embed_bytes, head_bytes, kv_bytes_per_token_per_layer,
                   context)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def head_cost(self) -> float:
        """The head's decode work per token (see head_work)."""
        return float(self.head_bytes) if self.head_work is None else self.head_work

    def kv_bytes_per_layer(self, streams: int) -> int:
        """The KV memory one layer of a stage may hold with `streams` rows at the full context (x kv_growth)."""
        return math.ceil(self.kv_bytes_per_token_per_layer * self.context * streams * self.kv_growth)

    def prefill_scratch_bytes(self, streams: int, first: bool = False) -> int:
        """The scratch a stage (`first`: the first one) holds after its largest prefill: `streams` prompts of the
        whole context in one call (a stream resumed on a new chain is prefilled with its prompt and every token it
        generated)."""
        per_token = self.prefill_bytes_per_token
        if first and self.first_prefill_bytes_per_token is not None:
            per_token = self.first_prefill_bytes_per_token
        return per_token * self.context * streams

    @functools.cached_property
    def sent_files(self) -> ModelFiles:
        """What a deploy sends: `files`, or the weights where they are not known."""
        return self.files or ModelFiles(self.layer_bytes, self.embed_bytes, self.head_bytes, 0)

    def resident(self, weight_bytes: int) -> int:
        """The memory `weight_bytes` of weight files take once a stage holding them is loaded."""
        return math.ceil(weight_bytes * self.resident_factor)


@dataclass(frozen=True)
class AgentCandidate:
    """One agent as the registry sees it. `speed` is relative (higher is faster); 0 means unmeasured."""

    agent_id: str
    state: AgentState
    free_memory_bytes: int
    speed: float
    reason: UnavailableReason | None = None  # set when state is UNAVAILABLE
    detail: str = ""  # the monitor's numbers, e.g. "battery 41%, unplugged" or "CPU 97 °C"
    hostname: str = ""  # the name the agent joined with, where the caller knows it (shown, never planned on)
    # The layer ranges of this model the agent hosts now: its free memory already lacks them, and an agent
    # assigned a range it hosts keeps that stage as it is, so that range is planned with their weights and
    # runtime counted back (its KV cache must still fit), and a plan that keeps every hosted range is kept.
    hosted: tuple[tuple[int, int], ...] = ()
    devices: tuple[str, ...] = ()  # the devices OpenVINO finds on it ("CPU", "GPU.0", "NPU"); (): not reported
    # The bytes of new shard files its shard cache can take (its limit, or its disk's free space less what the cache
    # keeps for the PC's user, less what its hosted stages pin); a stage's files beyond the hosted ranges' must fit.
    # None: not known (a PC typed in for `fleet plan --assume-agent`), not checked.
    disk_room_bytes: int | None = None


class PlanPolicy(str, Enum):
    FEWEST_AGENTS = "fewest_agents"  # the fewest agents that fit; among those, the fastest split
    ALL_BY_SPEED = "all_by_speed"  # every eligible agent that shortens the slowest stage


@dataclass(frozen=True)
class PlanOptions:
    policy: PlanPolicy = PlanPolicy.FEWEST_AGENTS
    margin_fraction: float = 0.10  # of each agent's free memory, left to its user
    margin_min_bytes: int = 512 * MIB  # ... and never less than this
    # What a loaded stage holds beyond its weights (x resident_factor), KV cache and prefill scratch (the model's
    # own terms): the compiled graph, the plugin's runtime and a decode call's buffers. Measured on the CPU plugin
    # (fresh process, RssAnon after compiling, the warm-up and 16 decode tokens, less the weights' files): 20 /
    # 48 / 29 MB for the whole 170M / 330M / 1.1B INT4 models, 38 / 47 MB for stages fed hidden states (330M
    # [12:24), 1.1B [4:12)); 96 MiB covers twice the largest. It was 256 MiB when it also stood for a prefill's
    # activations, which ModelFootprint.prefill_bytes_per_token now counts.
    stage_overhead_bytes: int = 96 * MIB
    streams: int = 1  # rows whose KV is reserved at full context
    use_serving: bool = True  # SERVING agents may take more stages (their free memory is what is left)
    max_subsets: int = 2000  # FEWEST_AGENTS: agent subsets tried per size before taking the best found
    max_reordered_splits: int = 500  # splits tried in chain orders other than by speed, when none fits by speed
    # ALL_BY_SPEED: what a stage's hop adds to a token, in the unit of a stage's relative_time (its work bytes over
    # its speed: with speeds in weight GB/s, as a deploy plans, nanoseconds). Measured over TLS websockets in
    # Python (README, docs/benchmark-runs.md): the agents and the controller add 0.6 + 0.75 ms a token for an
    # extra PC on a 2-core VM (1.3 ms with uvloop, a model of negligible compute), 0.65 ms a hop on a Zen 4 VM,
    # 0.85 on a 16-core Xeon; a LAN's wire adds 0.1-0.3 ms. 1 ms, against steps of 5-40 ms: a PC whose share
    # shortens the slowest stage by less is left out. 0: stages are free (the slowest stage alone decides).
    hop_cost: float = 1_000_000.0
    # Links known broken, as (from, to) agent ids: `from` cannot dial `to` (a firewall or a network fault between
    # two desks, or no IP family in common), so no plan puts `from` directly before `to`; `to` before `from` is
    # another link, dialled the other way. A failover adds one where a stage could not reach its next hop while the
    # controller reaches both; a plan over a survey, one between PCs whose addresses share no IP family.
    broken_links: frozenset[tuple[str, str]] = frozenset()
    # The device the stages will compile on: an agent whose OpenVINO lists none is left out (one that reports no
    # devices, its probe having failed, is not). None: not checked (a plan on paper).
    device: str | None = None


# what a dial says where the dialling PC's own network is down: no route, no network (Linux, macOS, Windows)
NETWORK_DOWN_WORDS = re.compile(r"\[(?:Errno|WinError) (?:51|65|101|113|10051|10065)\]")

# what bounds a shard cache's room, as an exclusion or a problem says it
DISK_ROOM_BOUNDS = ("its cache_limit_bytes, or its disk's free space less what the cache keeps free for the PC's user, "
                    "less the files of the stages it hosts")

# how much of a long list the plan's text shows (`--json` has it all)
RENDER_USABLE = 12  # agents listed on an infeasible plan's Usable line
SEE_LEFT_OUT = " (see the agents left out)"  # a problem's pointer to the plan's list; an error that lists them drops it
RESUME_COMMAND = "`deskfleet-agent resume`"  # what lets a PC its user paused take work again
RENDER_CROWD = 8  # agents left out for one reason listed one per row; more show the first few and a count
RENDER_CROWD_SHOWN = 3


class ExclusionReason(str, Enum):
    PAUSED = "paused"
    UNAVAILABLE = "unavailable"
    SERVING = "serving"
    SPEED_UNKNOWN = "speed_unknown"
    TOO_LITTLE_MEMORY = "too_little_memory"
    TOO_LITTLE_DISK = "too_little_disk"  # its shard cache has no room for the smallest stage's files
    NOT_NEEDED = "not_needed"
    UNREACHABLE = "unreachable"  # found (roster, mDNS, --peer) but did not answer: never a candidate
    OTHER_PROTOCOL = "other_protocol"  # answered in another fleet protocol (one side is to upgrade): never a candidate
    BROKEN_LINK = "broken_link"  # usable, but only in chains where a PC would dial one it cannot reach
    NO_DEVICE = "no_device"  # OpenVINO finds no PlanOptions.device on it


# the agents a plan lists as left out without having asked them anything (plan's `unreachable`)
NOT_ASKED = (ExclusionReason.UNREACHABLE, ExclusionReason.OTHER_PROTOCOL)


@dataclass(frozen=True)
class Exclusion:
    agent_id: str
    reason: ExclusionReason
    message: str  # for humans, with the numbers behind the decision
    hostname: str = ""  # the name the agent joined with, where the caller knows it


@dataclass(frozen=True)
class Stage:
    """Agent `agent_id` hosts decoder layers [first_layer, stop_layer) (+ embed / head where set)."""

    agent_id: str
    first_layer: int
    stop_layer: int
    has_embed: bool
    has_head: bool
    weight_bytes: int  # of its weight files (what a deploy sends)
    kv_bytes: int
    memory_bytes: int  # weights as held (x the model's resident_factor) + KV + prefill scratch + runtime overhead
    usable_bytes: int  # the agent's free memory less its safety margin
    relative_time: float  # decode work per token / speed: the slowest stage sets the pace
    hostname: str = ""  # the agent's, where known
    prefill_bytes: int = 0  # the scratch its largest prefill leaves held (see ModelFootprint.prefill_scratch_bytes)

    @property
    def num_layers(self) -> int:
        return self.stop_layer - self.first_layer


@dataclass(frozen=True)
class Plan:
    """Stages in chain order, every candidate not used, and why the plan fails when it does."""

    model: ModelFootprint
    policy: PlanPolicy
    stages: tuple[Stage, ...]
    exclusions: tuple[Exclusion, ...]
    problems: tuple[str, ...]  # empty when the plan is feasible
    usable: tuple[tuple[str, int], ...] = ()  # (agent id, usable bytes) of every agent that could work
    streams: int = 1  # rows whose KV (and prefill) each stage reserves

    @property
    def feasible(self) -> bool:
        return bool(self.stages) and not self.problems


# Public functions


def usable_bytes(agent: AgentCandidate, options: PlanOptions) -> int:
    """Free memory less the safety margin (never negative)."""
    margin = max(options.margin_min_bytes, int(agent.free_memory_bytes * options.margin_fraction))
    return max(0, agent.free_memory_bytes - margin)


def plan(model: ModelFootprint, agents: list[AgentCandidate] | tuple[AgentCandidate, ...],
         options: PlanOptions | None = None, unreachable: Sequence[Exclusion] = ()) -> Plan:
    """Split `model` over `agents`. Never raises for a fleet that cannot hold it: read `problems`.

    `unreachable`: the agents the caller found but could not ask (never candidates); they are listed as left
    out, and when the plan fails for want of agents the problem says they exist and why they did not answer.
    """
    options = options or PlanOptions()
    if model.num_layers < 1:
        raise ValueError(f"model {model.name!r} has no decoder layers")
    if options.streams < 1:
        raise ValueError(f"streams must be at least 1, got {options.streams}")
    if not 0 <= options.hop_cost < math.inf:
        raise ValueError(f"hop_cost must be 0 or more and finite, got {options.hop_cost}")
    for link in options.broken_links:
        if not (isinstance(link, tuple) and len(link) == 2 and all(isinstance(end, str) for end in link)
                and link[0] != link[1]):
            raise ValueError(f"a broken link is (from agent id, to agent id) of two agents, got {link!r}")
    exclusions: list[Exclusion] = []
    eligible: list[AgentCandidate] = []
    smallest = _smallest_stage_bytes(model, options)
    for agent in agents:
        excluded = _screen(agent, options, smallest, model)
        if excluded is None:
            eligible.append(agent)
        else:
            exclusions.append(replace(excluded, hostname=agent.hostname))
    eligible.sort(key=lambda a: (-a.speed, a.agent_id))
    if options.broken_links:  # only the links between two eligible agents constrain a chain
        ids = {agent.agent_id for agent in eligible}
        options = replace(options, broken_links=frozenset(
            (source, target) for source, target in options.broken_links if source in ids and target in ids))
    best = _search(model, eligible, options)
    # without the broken links, as the planner would have it: who was left out for them, or that they alone
    # keep the model from fitting (planned only where a link's end is unused)
    free: list[Stage] | None = None
    used = {stage.agent_id for stage in best or ()}
    if any(end not in used for link in options.broken_links for end in link):
        free = _search(model, eligible, replace(options, broken_links=frozenset()))
    # left out for a link: an end of one that the plan without them uses, where that plan does better (else the
    # links cost nothing, and the search with them, which weighs more orders, merely found another as good)
    ends = {end for link in options.broken_links for end in link}
    apart = set() if free is None or (best is not None and _rank(best, options) <= _rank(free, options)) else \
        ({stage.agent_id for stage in free} - used) & ends
    for agent in eligible:
        if agent.agent_id not in used and best is not None:
            exclusions.append(_cut_off(agent, eligible, options) if agent.agent_id in apart
                              else _not_needed(agent, best, options))
    problems = () if best is not None else (_no_chain_apart(eligible, options, unreachable),) if free else \
        _diagnose(model, agents, eligible, options, unreachable, exclusions)
    usable = tuple((agent.agent_id, usable_bytes(agent, options)) for agent in eligible)
    return Plan(model, options.policy, tuple(best or ()), (*exclusions, *unreachable), problems, usable,
                options.streams)


def left_out_text(result: Plan, shown: int = RENDER_CROWD) -> str:
    """The agents the plan left out and why, on one line (for an error that shows no plan): "left out: ab12cd34ef56
    (pc-1) no GPU: OpenVINO finds CPU on it; ..." and how many more past `shown`; "" when none was. The unreachable
    ones are not listed: the problems name them."""
    listed = [e for e in result.exclusions if e.reason not in NOT_ASKED]
    parts = [f"{_label(e.agent_id, e.hostname)} {e.message}" for e in listed[:shown]]
    more = len(listed) - shown
    return "" if not parts else "left out: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def in_gb(size: float) -> str:
    return f"{size / GB:.2f} GB"


def short_agent_id(agent_id: str) -> str:
    """An agent id's first 12 characters, as `fleet ls` shows it (a --peer address that did not answer: whole)."""
    return agent_id[:12] if is_agent_id(agent_id) else agent_id


def kv_cache_note(model: ModelFootprint) -> str:
    """How the KV figures count the cache, where not as plain tokens' bytes of an unnamed precision."""
    parts = [model.kv_precision] if model.kv_precision else []
    if model.kv_growth != 1.0:
        parts.append(f"x{model.kv_growth:g} as the cache grows")
    return f" ({', '.join(parts)})" if parts else ""


def share_of_slowest(time: float, slowest: float) -> float:
    """A stage's time over the slowest stage's; a plan whose stages take no time (a model of zero bytes on
    paper) or overflow (a speed near 0) has no ratio to show: 1 for the slowest, 0 for the others."""
    if 0.0 < slowest < math.inf:
        return time / slowest
    return 1.0 if time == slowest else 0.0


# Private functions


def _held(factor: float) -> str:
    """How a stage's memory counts its weights, where not as their files' bytes."""
    return "" if factor == 1.0 else f" held x{factor:g}"


def _smallest_stage_bytes(model: ModelFootprint, options: PlanOptions) -> int:
    return model.resident(min(model.layer_bytes)) + model.kv_bytes_per_layer(options.streams) \
        + min(_per_stage_bytes(model, options), _per_stage_bytes(model, options, first=True))


def _chain_stage_bytes(model: ModelFootprint, options: PlanOptions, stages: int) -> int:
    """The per-stage memory of a chain of `stages` stages (one of them the first)."""
    return _per_stage_bytes(model, options, first=True) + (stages - 1) * _per_stage_bytes(model, options)


def _runtime_parts(model: ModelFootprint, options: PlanOptions) -> str:
    return "prefill scratch + runtime" if _per_stage_bytes(model, options) > options.stage_overhead_bytes \
        else "runtime"


def _per_stage_bytes(model: ModelFootprint, options: PlanOptions, first: bool = False) -> int:
    """What a stage (`first`: the first one) holds whatever its layers: the runtime overhead and its largest
    prefill's scratch."""
    return options.stage_overhead_bytes + model.prefill_scratch_bytes(options.streams, first)


def _screen(agent: AgentCandidate, options: PlanOptions, smallest: int, model: ModelFootprint) -> Exclusion | None:
    if agent.state is AgentState.PAUSED:
        # a report names who paused it first ("paused by its user"); an older agent's only the limits it crossed
        detail = agent.detail if agent.detail.startswith("paused") else \
            "; ".join(part for part in ("paused (by its user or in its settings)", agent.detail) if part)
        return Exclusion(agent.agent_id, ExclusionReason.PAUSED, detail)
    if agent.state is AgentState.UNAVAILABLE:
        why = agent.reason.describe() if agent.reason is not None else "reason not reported"
        detail = f" ({agent.detail})" if agent.detail else ""
        return Exclusion(agent.agent_id, ExclusionReason.UNAVAILABLE, f"unavailable: {why}{detail}")
    if options.device is not None and agent.devices and not lists_device(options.device, agent.devices):
        return Exclusion(agent.agent_id, ExclusionReason.NO_DEVICE,
                         f"no {options.device}: OpenVINO finds {', '.join(agent.devices)} on it")
    if agent.state is AgentState.SERVING and not options.use_serving:
        return Exclusion(agent.agent_id, ExclusionReason.SERVING, "already serving (serving agents not used)")
    if not agent.speed > 0:
        return Exclusion(agent.agent_id, ExclusionReason.SPEED_UNKNOWN, "speed not measured yet")
    if agent.speed == math.inf:
        return Exclusion(agent.agent_id, ExclusionReason.SPEED_UNKNOWN, "speed inf is not a measurement")
    usable = usable_bytes(agent, options)
    if usable < smallest and not agent.hosted:  # a hosted range is counted back (see AgentCandidate.hosted)
        return Exclusion(agent.agent_id, ExclusionReason.TOO_LITTLE_MEMORY,
                         f"too little memory: {in_gb(agent.free_memory_bytes)} free, "
                         f"{in_gb(usable)} usable after the safety margin, "
                         f"the smallest stage (one layer{_held(model.resident_factor)} + KV + "
                         f"{_runtime_parts(model, options)}) needs "
                         f"{in_gb(smallest)}")
    smallest_files = min(model.sent_files.layers) + model.sent_files.every_stage
    if agent.disk_room_bytes is not None and agent.disk_room_bytes < smallest_files and not agent.hosted:
        return Exclusion(agent.agent_id, ExclusionReason.TOO_LITTLE_DISK,
                         f"too little disk: its shard cache can take {in_gb(agent.disk_room_bytes)} more "
                         f"({DISK_ROOM_BOUNDS}), the smallest stage's files (one layer) are {in_gb(smallest_files)}")
    return None


ChainOrders = Callable[[list[AgentCandidate]], Iterable[list[AgentCandidate]]]


def _search(model: ModelFootprint, eligible: list[AgentCandidate], options: PlanOptions) -> list[Stage] | None:
    """The stages of the plan over `eligible` (sorted by speed), or None when no split fits."""
    orders: ChainOrders = _by_speed
    if options.broken_links:
        def orders(agents: list[AgentCandidate]) -> Iterable[list[AgentCandidate]]:
            return _apart_orders(agents, options.broken_links)
    # A subset's split in speed order is a split of every eligible agent in speed order, the others given no
    # layers: when all of them have none, no subset has one, and the subsets need not be tried one by one
    # (with 300 PCs and an embed that fits none, that took 254 s).
    fits = any(_split(model, order, options) for order in orders(eligible))
    best = _best_split(model, eligible, options, orders) if fits else None
    if best is not None and options.policy is PlanPolicy.ALL_BY_SPEED:
        # the order by speed gives the embed to the fastest PC and the head to the last that gets layers, a slower
        # one: where the head is dear (a large vocabulary), a chain that ends on a fast PC is faster (a walk's
        # three PCs: a slow one's first layer, then the fastest with the rest and the head, 10% faster than the
        # fastest alone, which the plan took, saying the others would not shorten the slowest stage)
        other = _fastest_in_orders(model, _orders_ending_fast(eligible, orders), options)
        if other is not None and _pace(other, options) < _pace(best, options):
            best = other
    if best is None:
        budget = _SplitBudget(options.max_reordered_splits)
        best = _best_split(model, eligible, options, lambda agents: _other_orders(agents, budget), budget)
    if best is None and EVERY_ORDER_UP_TO < len(eligible) <= EVERY_CHAIN_UP_TO and options.max_reordered_splits > 0:
        # the orders above fix all but the first and last agent: where the fit needs another middle (layers of
        # unequal sizes, an agent with room for a small layer only), find the chains that fit outright
        best = _fastest_in_orders(model, _fitting_chains(model, eligible, options), options)
    return _keep_deployed(model, eligible, options, best)


# (the state before, where its chain ended, the agent) of a stage found by _fitting_chains; None: the empty chain
_ChainStep = tuple[tuple[int, int], int, int] | None


def _fitting_chains(model: ModelFootprint, agents: list[AgentCandidate], options: PlanOptions,
                    ) -> Iterator[list[AgentCandidate]]:
    """Chains (some of `agents` in some order) in which some split fits, found exhaustively by dynamic programming
    over the subsets of agents used (2^agents of them), one chain per subset; under FEWEST_AGENTS only those of
    the fewest agents that have one, else every size (the most agents first) up to max_reordered_splits chains.

    level[(used, tag)]: the layers j at which the chains over the agents `used` can end their last stage (tag: that
    stage's agent where it is a broken link's source, else -1), each with how it was reached. Where no agent
    hosts a range (whose memory is counted back only for that exact range) and no link is broken, a stage's memory
    grows with its layers, so only the furthest j is kept: whatever follows a nearer one also follows it (with a
    broken link it may not: from the nearer one, an agent given a layer there can pass the next to one the agent
    before cannot dial)."""
    layers = model.num_layers
    prefix = [0, *itertools.accumulate(model.layer_bytes)]
    kv_per_layer = model.kv_bytes_per_layer(options.streams)
    per_stage = (_per_stage_bytes(model, options), _per_stage_bytes(model, options, first=True))
    links = options.broken_links
    sources = {source for source, _ in links}
    furthest_only = not links and not any(agent.hosted for agent in agents)

    def stops(agent: AgentCandidate, start: int) -> list[int]:
        usable = usable_bytes(agent, options)
        return [stop for stop in range(start + 1, layers + 1)
                if _fits(model, prefix, agent, start, stop, options, usable, kv_per_layer, per_stage)]

    fits = [[stops(agent, start) for start in range(layers)] for agent in agents]
    level: dict[tuple[int, int], dict[int, _ChainStep]] = {(0, -1): {0: None}}
    history: list[dict[tuple[int, int], dict[int, _ChainStep]]] = []
    found: list[list[AgentCandidate]] = []
    for _ in agents:
        history.append(level)
        after: dict[tuple[int, int], dict[int, _ChainStep]] = {}
        whole: dict[int, list[AgentCandidate]] = {}
        for (used, last), ends in level.items():
            for a, agent in enumerate(agents):
                if used >> a & 1 or (last >= 0 and (agents[last].agent_id, agent.agent_id) in links):
                    continue
                state = (used | 1 << a, a if agent.agent_id in sources else -1)
                for start in ends:
                    for stop in fits[a][start]:
                        if stop == layers:
                            if state[0] not in whole:
                                whole[state[0]] = _chain_back(agents, history, (used, last), start, a)
                            continue
                        into = after.setdefault(state, {})
                        if furthest_only:
                            if not into or stop > next(iter(into)):
                                into.clear()
                                into[stop] = ((used, last), start, a)
                        else:
                            into.setdefault(stop, ((used, last), start, a))
        found.extend(whole.values())
        if whole and options.policy is PlanPolicy.FEWEST_AGENTS:
            break
        level = after
    found.sort(key=len, reverse=True)
    yield from found[:options.max_reordered_splits]


def _chain_back(agents: list[AgentCandidate], history: list[dict[tuple[int, int], dict[int, _ChainStep]]],
                state: tuple[int, int], end: int, last: int) -> list[AgentCandidate]:
    """The chain that reached layer `end` in `state` (of len(history) - 1 agents), then agent `last`."""
    chain = [agents[last]]
    for level in reversed(history[1:]):
        step = level[state][end]
        assert step is not None  # only the empty chain's entry has no stage before it
        state, end, agent = step
        chain.append(agents[agent])
    return chain[::-1]


class _SplitBudget:
    """How many more splits the search in other chain orders may try."""

    def __init__(self, splits: int) -> None:
        self.left = splits

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _by_speed(agents: list[AgentCandidate]) -> Iterable[list[AgentCandidate]]:
    """The chain order of a feasible fleet: fastest first (ties by id)."""
    yield sorted(agents, key=lambda a: (-a.speed, a.agent_id))


def _orders_ending_fast(agents: list[AgentCandidate], orders: ChainOrders) -> Iterator[list[AgentCandidate]]:
    """Chain orders besides `orders`' that end on a fast PC, which then takes the head: every order of a short
    chain; else the order by speed with one of its ENDING_FAST fastest moved to its end (a few more splits, not the
    n^2 of every first and last: those made a plan of 10 PCs 46x slower, 4.3 s, and a failover waits on it)."""
    tried = {tuple(agent.agent_id for agent in order) for order in orders(agents)}
    by_speed = next(iter(_by_speed(agents)))
    candidates: Iterable[Sequence[AgentCandidate]]
    if len(by_speed) <= EVERY_ORDER_UP_TO:
        candidates = itertools.permutations(by_speed)
    else:
        candidates = ([*by_speed[:index], *by_speed[index + 1:], by_speed[index]]
                      for index in range(min(ENDING_FAST, len(by_speed) - 1)))
    for order in candidates:
        if tuple(agent.agent_id for agent in order) not in tried:
            yield list(order)


def _apart_orders(agents: list[AgentCandidate], links: frozenset[tuple[str, str]]) -> Iterator[list[AgentCandidate]]:
    """The order by speed, then, where it puts the source of a broken link before its target (the split could make
    them neighbours), other orders: every one of a short chain (each chain over some of its agents, in any order,
    is a split of one of them), else orders with no broken link between neighbours: each link's target moved to
    just before its source and its source to just after its target, and a repair of the order by speed that
    moves each agent the one before cannot dial back to the latest place where it joins no broken link."""
    by_speed = next(iter(_by_speed(agents)))
    yield by_speed
    place = {agent.agent_id: index for index, agent in enumerate(by_speed)}
    forward = [(place[source], place[target]) for source, target in links
               if source in place and target in place and place[source] < place[target]]
    if not forward:
        return  # every target comes first: no split of this order joins a broken link
    candidates: Iterable[Sequence[AgentCandidate]]
    if len(by_speed) <= EVERY_ORDER_UP_TO:
        candidates = itertools.permutations(by_speed)
    else:
        moved: list[Sequence[AgentCandidate]] = []
        for source, target in forward:
            rest = [agent for index, agent in enumerate(by_speed) if index != target]
            moved.append([*rest[:source], by_speed[target], *rest[source:]])
            rest = [agent for index, agent in enumerate(by_speed) if index != source]
            moved.append([*rest[:target], by_speed[source], *rest[target:]])
        candidates = [*moved, _repaired(by_speed, links)]
    seen = {tuple(place)}
    for order in candidates:
        key = tuple(agent.agent_id for agent in order)
        if key not in seen and (len(order) <= EVERY_ORDER_UP_TO or not _joins_broken(order, links)):
            seen.add(key)
            yield list(order)


def _repaired(order: list[AgentCandidate], links: frozenset[tuple[str, str]]) -> list[AgentCandidate]:
    """`order` with each agent that the one before cannot dial moved back to the latest place between two agents
    it can be joined to (left where it is when there is none)."""
    chain: list[AgentCandidate] = []
    for agent in order:
        if chain and (chain[-1].agent_id, agent.agent_id) in links:
            fits = (place for place in range(len(chain) - 1, -1, -1)
                    if (place == 0 or (chain[place - 1].agent_id, agent.agent_id) not in links)
                    and (agent.agent_id, chain[place].agent_id) not in links)
            chain.insert(next(fits, len(chain)), agent)
        else:
            chain.append(agent)
    return chain


def _joins_broken(order: Sequence[AgentCandidate], links: frozenset[tuple[str, str]]) -> bool:
    return any((before.agent_id, after.agent_id) in links for before, after in itertools.pairwise(order))


def _other_orders(agents: list[AgentCandidate], budget: _SplitBudget) -> Iterator[list[AgentCandidate]]:
    """Chain orders other than by speed, while the budget lasts: every order of a short chain, else every
    choice of the first agent (it holds the embed) and the last (the head), the rest by speed."""
    by_speed = next(iter(_by_speed(agents)))
    if len(by_speed) <= EVERY_ORDER_UP_TO:
        orders: Iterable[tuple[AgentCandidate, ...]] = itertools.permutations(by_speed)
    else:
        orders = ((by_speed[first], *(a for i, a in enumerate(by_speed) if i not in (first, last)), by_speed[last])
                  for first, last in itertools.permutations(range(len(by_speed)), 2))
    for order in orders:
        if list(order) != by_speed:
            if not budget.take():
                return
            yield list(order)


def _best_split(model: ModelFootprint, eligible: list[AgentCandidate], options: PlanOptions,
                orders: ChainOrders, budget: _SplitBudget | None = None) -> list[Stage] | None:
    """The policy's split of `eligible` (sorted by speed), trying the chain orders `orders` gives; the search
    ends when `budget` (the orders' own) is spent."""
    if options.policy is PlanPolicy.ALL_BY_SPEED:
        return _fastest_in_orders(model, orders(eligible), options)
    for size in range(1, len(eligible) + 1):
        if budget is not None and budget.left <= 0:
            return None
        best = _fewest(model, eligible, size, options, orders, budget)
        if best is not None:
            return best
    return None


def _fastest_in_orders(model: ModelFootprint, orders: Iterable[list[AgentCandidate]],
                       options: PlanOptions) -> list[Stage] | None:
    best: list[Stage] | None = None
    for order in orders:
        stages = _split(model, order, options)
        if stages is not None and (best is None or _pace(stages, options) < _pace(best, options)):
            best = stages
    return best


def _fewest(model: ModelFootprint, eligible: list[AgentCandidate], size: int, options: PlanOptions,
            orders: ChainOrders, budget: _SplitBudget | None = None) -> list[Stage] | None:
    """The fastest split over exactly `size` agents, trying subsets with the most usable memory first. A subset
    whose speeds cannot beat the best split found (the model's work over their sum bounds its slowest stage
    from below) is not split."""
    need = model.resident(sum(model.layer_bytes) + model.embed_bytes + model.head_bytes)
    need += model.num_layers * model.kv_bytes_per_layer(options.streams) + _chain_stage_bytes(model, options, size)
    by_memory = sorted(eligible, key=lambda a: -usable_bytes(a, options))
    if sum(usable_bytes(a, options) for a in by_memory[:size]) < need:
        return None  # no subset of this size has the memory
    work = sum(model.layer_bytes) + model.head_cost
    best: list[Stage] | None = None
    for tried, subset in enumerate(itertools.combinations(by_memory, size)):
        if tried >= options.max_subsets or (budget is not None and budget.left <= 0):
            break
        if sum(usable_bytes(a, options) for a in subset) < need:
            continue
        if best is not None and work / sum(a.speed for a in subset) > _pace(best, options)[0] * (1 + 1e-9):
            continue
        stages = _fastest_in_orders(model, orders(list(subset)), options)
        if stages is not None and (best is None or _pace(stages, options) < _pace(best, options)):
            best = stages
    return best


def _hop(options: PlanOptions) -> float:
    """What a stage's hop costs the plan: hop_cost under ALL_BY_SPEED; under FEWEST_AGENTS nothing (the fewest
    agents are taken first, and the split of a given number of them is chosen by its slowest stage)."""
    return options.hop_cost if options.policy is PlanPolicy.ALL_BY_SPEED else 0.0


def _pace(stages: list[Stage], options: PlanOptions) -> tuple[float, int]:
    """What a split costs a token (the slowest stage, plus a hop a stage under ALL_BY_SPEED), then its stages."""
    return (max(stage.relative_time for stage in stages) + _hop(options) * len(stages), len(stages))


def _rank(stages: list[Stage], options: PlanOptions) -> tuple[float, ...]:
    """How the policy ranks a plan (less is better): under FEWEST_AGENTS its stages, then its pace; else its pace."""
    pace = _pace(stages, options)[0]
    return (len(stages), pace) if options.policy is PlanPolicy.FEWEST_AGENTS else (pace,)


def _split(model: ModelFootprint, agents: list[AgentCandidate], options: PlanOptions) -> list[Stage] | None:
    """Contiguous ranges over `agents` in chain order (an agent may get none): minimise the slowest stage, plus
    the hops of its stages (see _hop) over the leading parts of the order; no stage follows one whose agent cannot
    dial it (PlanOptions.broken_links).

    best[s][i][j]: the best (slowest stage time, stages) covering layers [0, j) with the first i agents, the stage
    ending at j held by `sources[s]`, the source of a broken link (s = 0: by none, or by an agent that is no broken
    link's source). The split ends at the row i whose (best[s][i][layers]'s slowest stage + a hop a stage, stages)
    is least, the last of equals: with free hops, the last row (all the agents).
    """
    layers = model.num_layers
    prefix = [0, *itertools.accumulate(model.layer_bytes)]
    kv_per_layer = model.kv_bytes_per_layer(options.streams)
    per_stage = (_per_stage_bytes(model, options), _per_stage_bytes(model, options, first=True))
    ids = {agent.agent_id for agent in agents}
    sources: list[str | None] = [None, *sorted({source for source, target in options.broken_links
                                                 if source in ids and target in ids})]
    tags = {source: s for s, source in enumerate(sources)}
    states = range(len(sources))
    best: list[list[list[tuple[float, int] | None]]] = [
        [[None] * (layers + 1) for _ in range(len(agents) + 1)] for _ in states]
    back: dict[tuple[int, int, int], tuple[int, int]] = {}  # (state, agents used, stop) -> (start, state before)
    best[0][0][0] = (0.0, 0)
    for i, agent in enumerate(agents):
        usable = usable_bytes(agent, options)
        tag = tags.get(agent.agent_id, 0)
        into = best[tag][i + 1]
        barred = {s for s in states if (sources[s], agent.agent_id) in options.broken_links}
        for j in range(layers + 1):
            ranges: list[tuple[int, float]] | None = None  # (stop, stage time) of each range from j it holds
            for s in states:
                here = best[s][i][j]
                if here is None:
                    continue
                if _better(here, best[s][i + 1][j]):
                    best[s][i + 1][j] = here
                    back.pop((s, i + 1, j), None)
                if s in barred:
                    continue  # the agent before cannot dial this one
                if ranges is None:  # once for every state before: the ranges are the agent's own
                    ranges = _ranges_from(model, prefix, agent, j, options, usable, kv_per_layer, per_stage)
                for k, time in ranges:
                    candidate = (max(here[0], time), here[1] + 1)
                    if _better(candidate, into[k]):
                        into[k] = candidate
                        back[(tag, i + 1, k)] = (j, s)
    hop = _hop(options)
    ends = []
    for s, row in itertools.product(states, range(1, len(agents) + 1)):
        end = best[s][row][layers]
        if end is not None:
            ends.append((end[0] + hop * end[1], end[1], -row, s))
    if not ends:
        return None
    stages: list[Stage] = []
    _, _, row, s = min(ends)
    i, k = -row, layers
    while k > 0:
        if (s, i, k) in back:
            j, s = back[(s, i, k)]
            stages.append(_stage(model, prefix, agents[i - 1], j, k, options))
            k = j
        i -= 1
    return stages[::-1]


def _keep_deployed(model: ModelFootprint, eligible: list[AgentCandidate], options: PlanOptions,
                   best: list[Stage] | None) -> list[Stage] | None:
    """The deployed split (the eligible agents' hosted ranges, when they cover the model) instead of `best`
    when it still fits and `best` is no faster (nor, for FEWEST_AGENTS, on fewer agents): a redeploy pushes
    shards and rebuilds stages, and equally good plans differ by a few MB of free memory between surveys."""
    hosts = sorted(((first, stop, agent) for agent in eligible for first, stop in agent.hosted),
                   key=lambda hosted: hosted[:2])
    if not hosts or hosts[0][0] != 0 or hosts[-1][1] != model.num_layers:
        return best
    if any(before[1] != after[0] for before, after in itertools.pairwise(hosts)):
        return best
    if len({id(agent) for _, _, agent in hosts}) != len(hosts):
        return best  # an agent hosting two ranges of the chain: not a chain this planner makes
    if _joins_broken([agent for _, _, agent in hosts], options.broken_links):
        return best  # a stage of it cannot dial the next one
    prefix = [0, *itertools.accumulate(model.layer_bytes)]
    kept = [_stage(model, prefix, agent, first, stop, options) for first, stop, agent in hosts]
    if any(stage.memory_bytes > stage.usable_bytes + _credit(model, prefix, agent, stage.first_layer,
                                                               stage.stop_layer, options)
           for stage, (_, _, agent) in zip(kept, hosts, strict=True)):
        return best
    if best is not None:
        if _pace(kept, options)[0] > _pace(best, options)[0] * (1 + 1e-9):
            return best
        if options.policy is PlanPolicy.FEWEST_AGENTS and len(kept) > len(best):
            return best
    return kept


def _ranges_from(model: ModelFootprint, prefix: list[int], agent: AgentCandidate, start: int, options: PlanOptions,
                 usable: int, kv_per_layer: int, per_stage: tuple[int, int]) -> list[tuple[int, float]]:
    """(stop, the stage's time) of every range [start, stop) `agent` holds, in order."""
    ranges = []
    for stop in range(start + 1, model.num_layers + 1):
        if not _fits(model, prefix, agent, start, stop, options, usable, kv_per_layer, per_stage):
            if stop < model.num_layers and not any(first == start and end > stop for first, end in agent.hosted):
                break  # more layers only need more memory (unless a hosted range is counted back)
            continue
        ranges.append((stop, _work(model, prefix, start, stop) / agent.speed))
    return ranges


def _fits(model: ModelFootprint, prefix: list[int], agent: AgentCandidate, start: int, stop: int,
          options: PlanOptions, usable: int, kv_per_layer: int, per_stage: tuple[int, int]) -> bool:
    """Whether `agent` (with `usable` bytes) holds layers [start, stop): their weights as held, their KV cache, a
    stage's scratch and runtime (per_stage[True]: the first stage's), less what a range it hosts counts back; and
    whether its shard cache has room for the range's files that its hosted ranges do not hold already."""
    if agent.disk_room_bytes is not None and \
            _new_files(model, agent, start, stop) > agent.disk_room_bytes:
        return False
    credit = _credit(model, prefix, agent, start, stop, options) if agent.hosted else 0
    return model.resident(_weights(model, prefix, start, stop)) + (stop - start) * kv_per_layer \
        + per_stage[start == 0] <= usable + credit


def _new_files(model: ModelFootprint, agent: AgentCandidate, start: int, stop: int) -> int:
    """The bytes of the files a stage of layers [start, stop) needs (ModelFootprint.sent_files) that `agent` must
    receive: those of a unit (a layer, the embed, the head) one of its hosted stages holds, and those every stage
    gets where it hosts one, are on its disk, pinned."""
    files = model.sent_files
    if not agent.hosted:
        return files.layer_prefix[stop] - files.layer_prefix[start] + (files.embed if start == 0 else 0) + \
            (files.head if stop == model.num_layers else 0) + files.every_stage
    layers = {layer for first, end in agent.hosted for layer in range(first, end)}
    embed = start == 0 and not any(first == 0 for first, _ in agent.hosted)
    head = stop == model.num_layers and not any(end == model.num_layers for _, end in agent.hosted)
    return sum(files.layers[layer] for layer in range(start, stop) if layer not in layers) + \
        (files.embed if embed else 0) + (files.head if head else 0)


def _credit(model: ModelFootprint, prefix: list[int], agent: AgentCandidate, start: int, stop: int,
            options: PlanOptions) -> int:
    """The memory counted back for layers [start, stop) on `agent`: what its stage of that range took from
    the free memory it reported (its weights as held, its runtime and the scratch its prefills left held, which
    a stage kept on that range uses again), when it hosts that range now. A stage that has served holds its
    scratch (up to the whole context's: ModelFootprint.prefill_scratch_bytes); not counted back, a re-plan or a
    second deploy reserved it twice, and a PC could be called too small for the stage it serves."""
    if (start, stop) not in agent.hosted:
        return 0
    return model.resident(_weights(model, prefix, start, stop)) + _per_stage_bytes(model, options, start == 0)


def _better(candidate: tuple[float, int], current: tuple[float, int] | None) -> bool:
    """A split that beats the best found so far, or the first one: one whose time overflowed to inf (a speed
    near 0) is still a split, where comparing with (inf, 0) said nothing fits."""
    return current is None or candidate < current


def _work(model: ModelFootprint, prefix: list[int], start: int, stop: int) -> float:
    """Decode work per token of layers [start, stop): their bytes, plus the head's work (the embed: none)."""
    return prefix[stop] - prefix[start] + (model.head_cost if stop == model.num_layers else 0.0)


def _weights(model: ModelFootprint, prefix: list[int], start: int, stop: int) -> int:
    extras = (model.embed_bytes if start == 0 else 0) + (model.head_bytes if stop == model.num_layers else 0)
    return prefix[stop] - prefix[start] + extras


def _stage(model: ModelFootprint, prefix: list[int], agent: AgentCandidate, start: int, stop: int,
           options: PlanOptions) -> Stage:
    weights = _weights(model, prefix, start, stop)
    kv = (stop - start) * model.kv_bytes_per_layer(options.streams)
    time = _work(model, prefix, start, stop) / agent.speed
    return Stage(agent.agent_id, start, stop, start == 0, stop == model.num_layers, weights, kv,
                 model.resident(weights) + kv + _per_stage_bytes(model, options, start == 0),
                 usable_bytes(agent, options), time, agent.hostname,
                 model.prefill_scratch_bytes(options.streams, start == 0))


def _not_needed(agent: AgentCandidate, stages: list[Stage], options: PlanOptions) -> Exclusion:
    if options.policy is PlanPolicy.FEWEST_AGENTS:  # what to give to use it anyway: a walk found no way from --help
        message = f"not needed: {len(stages)} agent(s) hold the model (--policy all_by_speed splits it over more)"
    else:
        slowest = max(stage.relative_time for stage in stages)
        hop = (f" by more than a hop costs ({share_of_slowest(_hop(options), slowest):.2f} of the slowest stage; "
               "--hop-ms 0 counts hops as free)" if _hop(options) else "")
        message = (f"not used: with speed {agent.speed:.3g} GB/s and {in_gb(usable_bytes(agent, options))} usable, "
                   f"a share of the layers would not shorten the slowest stage{hop}")
    return Exclusion(agent.agent_id, ExclusionReason.NOT_NEEDED, message, agent.hostname)


def _cut_off(agent: AgentCandidate, eligible: list[AgentCandidate], options: PlanOptions) -> Exclusion:
    """Why `agent`, which a plan without the broken links would use, is left out."""
    names = {other.agent_id: _label(other.agent_id, other.hostname) for other in eligible}
    ends = [f"agent {names[source]} cannot dial agent {names[target]}"
            for source, target in sorted(options.broken_links) if agent.agent_id in (source, target)]
    return Exclusion(agent.agent_id, ExclusionReason.BROKEN_LINK,
                     f"broken link: {', '.join(ends)} (a firewall or a network fault between them, or no IP family in "
                     "common), "
                     "and no chain that keeps it, with no PC dialling one it cannot reach, does as well as one "
                     "without it", agent.hostname)


def _no_chain_apart(eligible: list[AgentCandidate], options: PlanOptions, unreachable: Sequence[Exclusion]) -> str:
    """The problem of a fleet that holds the model only in chains that join a broken link."""
    names = {agent.agent_id: _label(agent.agent_id, agent.hostname) for agent in eligible}
    links = ", ".join(f"{names[source]} -> {names[target]}" for source, target in sorted(options.broken_links))
    silent = f", and {len(unreachable)} more found did not answer" if unreachable else ""
    return (f"the {len(eligible)} usable agent(s) hold the model only in chains where a PC dials one it cannot "
            f"reach (broken links: {links}){silent}: mend the network between those PCs (or give them addresses of "
            "one IP family), or join more PCs")


def _not_asked_remedy(unreachable: Sequence[Exclusion]) -> str:
    """What to do about the agents found but not asked: start those that did not answer; upgrade deskfleet where one
    speaks another protocol (its message says on which side: it was told to start an agent that was running)."""
    steps = []
    if unreachable and all(NETWORK_DOWN_WORDS.search(e.message) for e in unreachable):  # none has a route from here
        steps.append("check this PC's own network: every PC is unreachable from it for want of a route or a network")
    elif any(e.reason is not ExclusionReason.OTHER_PROTOCOL for e in unreachable):
        steps.append("start `deskfleet-agent --headless` on them")
    if any(e.reason is ExclusionReason.OTHER_PROTOCOL for e in unreachable):
        steps.append("upgrade deskfleet where one speaks another fleet protocol, as its message says")
    return "; ".join(steps)


def _diagnose(model: ModelFootprint, agents: list[AgentCandidate] | tuple[AgentCandidate, ...],
              eligible: list[AgentCandidate], options: PlanOptions,
              unreachable: Sequence[Exclusion] = (), excluded: Sequence[Exclusion] = ()) -> tuple[str, ...]:
    if not agents and unreachable:
        return (f"no reachable agents: {len(unreachable)} found but unreachable ("
                + "; ".join(f"{_label(e.agent_id, e.hostname)} {e.message}" for e in unreachable)
                + f"): {_not_asked_remedy(unreachable)}",)
    if not agents:
        return ("no agents in the fleet",)
    silent = (f", and {len(unreachable)} more found did not answer ({_not_asked_remedy(unreachable)})"
              if unreachable else "")
    if not eligible:  # what keeps them out, counted: "the model does not fit" alone read as a size problem
        reasons = Counter(exclusion.reason.value.replace("_", " ") for exclusion in excluded)
        counted = f" ({', '.join(f'{count} {reason}' for reason, count in sorted(reasons.items()))})" if reasons \
            else ""
        resume = f" ({RESUME_COMMAND} on a PC its user paused)" if ExclusionReason.PAUSED.value in reasons else ""
        return (f"none of the {len(agents)} agent(s) that answered can take work{counted}{resume}{silent}"
                f"{SEE_LEFT_OUT}",)
    kv_total = model.num_layers * model.kv_bytes_per_layer(options.streams)
    weights = model.resident(sum(model.layer_bytes) + model.embed_bytes + model.head_bytes)
    need = weights + kv_total + _chain_stage_bytes(model, options, len(eligible))
    have = sum(usable_bytes(agent, options) for agent in eligible)
    if have < need:
        scratch = model.prefill_scratch_bytes(options.streams)
        first = model.prefill_scratch_bytes(options.streams, first=True)
        per_stage = "" if not (scratch or first) else f"prefill scratch {in_gb(scratch)} + " if scratch == first else \
            f"prefill scratch {in_gb(first)} on the first stage, {in_gb(scratch)} on each other + "
        return (f"memory short by {in_gb(need - have)}: the model needs {in_gb(need)} "
                f"({in_gb(weights)} weights{_held(model.resident_factor)} + {in_gb(kv_total)} "
                f"KV{kv_cache_note(model)} for "
                f"{options.streams} stream(s) at context "
                f"{model.context} + {per_stage}runtime {in_gb(options.stage_overhead_bytes)} per stage) and the "
                f"{len(eligible)} usable agent(s) have {in_gb(have)} after safety margins{silent}",)
    if any(agent.disk_room_bytes is not None for agent in eligible) and \
            _search(model, [replace(agent, disk_room_bytes=None) for agent in eligible], options) is not None:
        return (_short_of_disk(model, eligible) + silent,)
    bounded = "" if len(eligible) <= EVERY_CHAIN_UP_TO else (
        f" (of {len(eligible)} agents, beyond the order by speed only chains that differ from it in their first "
        f"and last agent were tried, at most {options.max_reordered_splits}: another order may fit)")
    return (f"the {len(eligible)} usable agent(s) have {in_gb(have)} for {in_gb(need)} in all, but no split into "
            "contiguous layer ranges fits each agent (the embed/head or the largest layers do not fit "
            f"beside their neighbours){bounded}; free memory on the largest agents would help{silent}",)


def _short_of_disk(model: ModelFootprint, eligible: list[AgentCandidate]) -> str:
    """The problem of a fleet whose memory holds the model but whose shard caches have no room for its files."""
    rooms = sorted(eligible, key=lambda agent: -(agent.disk_room_bytes or 0))
    listed = ", ".join(f"{_label(agent.agent_id, agent.hostname)} "
                       f"{'not reported' if agent.disk_room_bytes is None else in_gb(agent.disk_room_bytes)}"
                       for agent in rooms[:RENDER_USABLE])
    more = f" and {len(rooms) - RENDER_USABLE} more" if len(rooms) > RENDER_USABLE else ""
    sent = model.sent_files
    files = sum(sent.layers) + sent.embed + sent.head + sent.every_stage
    return (f"the {len(eligible)} usable agent(s) hold the model in memory, but no split's files ({in_gb(files)} in "
            f"all) fit their shard caches, which can take {listed}{more} more (each: {DISK_ROOM_BOUNDS}): free "
            "disk space on them, raise cache_limit_bytes where it bounds the room, or join more PCs")


def _label(agent_id: str, hostname: str) -> str:
    """An agent as `fleet ls` shows it: its id's first 12 characters, and its hostname where known."""
    return f"{short_agent_id(agent_id)} ({hostname})" if hostname and hostname != "?" else short_agent_id(agent_id)
