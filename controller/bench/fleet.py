"""`deskfleet bench fleet`: the paper's fleet table, measured on simulated PCs over the real TLS transport.

Every simulated PC is an agent in its own process (controller/bench/fleet_agent.py), pinned to its own
core(s) with os.sched_setaffinity and compiling with INFERENCE_NUM_THREADS=1 (threads per PC
configurable). The controller deploys with the real deploy (shards pushed, stages assigned) and drives
the real engine through FleetPipeline: controller -> stage 0 -> ... -> stage n-1 -> controller over TLS
websockets. The WAN rows run on their own two PCs, dialled (by the controller and by each other) through
a DelayProxy that adds the per-hop delay; every other row's PCs are dialled directly, as on a LAN.
Configurations are interleaved round by round (after an untimed warm-up round) so drift hits all alike;
each reports its median tokens/s and the spread (min, max) over the rounds; ratios are of medians against
the row's 1-PC baseline of the same model. With `--controller-cores K` the controller process (driver,
draft model, delay proxies) is pinned to the first K cores and the PCs to the others, as in an office
where the controller is its own PC; with K = 0 (the default) it is not pinned and, on a 2-core machine,
shares the agents' cores, which counts against the fleet rows. `--pcs N` (2-4) adds the 3- and 4-PC rows;
every group of N PCs takes the first N agent cores (groups run one at a time; an idle agent sleeps).
The rows of 2 PCs serving N users also report their `ideal_split`: what two whole 1-PC servers of N/2
users each make, measured in the same run, i.e. where the fleet would land with free hops (see _Row).
`--model` gives the throughput rows and `--demo-target` (with `--demo-draft`) the drafting and WAN rows; either
may be left out. Each drafting row runs with each of DRAFTERS.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from deskfleet.agent.link import TlsFiles, utc_now
from deskfleet.agent.stage import CompileSettings, export_weight_group_size
from deskfleet.agent.stage import Precision as StagePrecision
from deskfleet.common import event_loop, pki
from deskfleet.common.arguments import path_argument, program_argument, real_number, whole_number
from deskfleet.common.atomic_file import write_atomic
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.planner import PlanOptions, PlanPolicy
from deskfleet.common.speculative import MAX_K, AdaptiveK
from deskfleet.common.wire import Precision, Role
from deskfleet.common.wire_messages import KV_CACHE_PRECISIONS
from deskfleet.controller.bench.arguments import check_genai_inputs, check_output_files
from deskfleet.controller.bench.delay_proxy import MAX_DELAY_S, MIN_BANDWIDTH_BYTES_S, DelayProxy, ProxyThread
from deskfleet.controller.bench.host import host_report
from deskfleet.controller.bench.interruption import run_bench, signals_held
from deskfleet.controller.bench.rounds import round_order
from deskfleet.controller.bench.runner_process import stop_processes
from deskfleet.controller.bench.speculative import DEFAULT_EVAL_DIR, heldout_code_prompts
from deskfleet.controller.bench.streams import GenAIUsers
from deskfleet.controller.draft import Drafter, check_draft_for, open_drafter
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_deploy import StagePlacement, deploy, model_id_of
from deskfleet.controller.fleet_pipeline import STEP_TIMEOUT_S, FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import SurveyOptions, survey
from deskfleet.controller.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

# Every PC that shortens the slowest stage, hops free: a row measures the chain of the PCs it names (priced at
# PlanOptions' default hop, the demo target, whose token costs less than a hop, would stay on one PC).
PLAN_OPTIONS = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0)
DEMO_TEXTS = ('def read_config(path):\n    """Read a configuration file."""\n',
              'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
              'def parse_args(argv=None):\n    """Parse the command line."""\n',
              'import os\n\n\ndef walk_files(top):\n    """Yield every file below top."""\n')


@dataclass(frozen=True)
class FleetBenchOptions:
    model: Path | None  # the throughput model's export folder (~1B INT4 in the brief); None: no throughput rows
    demo_target: Path | None = None  # the drafting rows' target (the demo pair's, or any target with a draft)
    demo_draft: Path | None = None
    new_tokens: int = 32
    prompt_tokens: int = 16
    rounds: int = 3
    warmup_rounds: int = 1  # untimed rounds first: the first calls of a stage compile kernels for new shapes
    threads_per_pc: int = 1
    wan_delay_s: float = 0.1
    wan_bandwidth_bytes_s: float | None = None  # None: no bandwidth limit on WAN rows
    max_pcs: int = 2  # PCs for the largest rows (3-4 need that many cores)
    controller_cores: int = 0  # cores reserved for the controller process; 0: not pinned
    genai_model: Path | None = None  # the throughput model exported by optimum-intel: GenAI CB rows
    genai_python: Path | None = None  # the GenAI venv's python (scripts/genai_venv.sh)
    drafting_kv_cache: str | None = None  # the drafting and WAN rows' KV cache (`fleet deploy --kv-cache`)
    # extra draft-model rows with K fixed at each of these, beside adaptive K's, at every PC count: where the K
    # that adaptive K chose stands against the best fixed one, measured side by side
    fixed_ks: tuple[int, ...] = ()
    drafters: tuple[str, ...] = ()  # the drafting rows' drafters (DRAFTERS' keys); empty: every one
    wan: bool = True  # the WAN rows (the naive pipeline over 100 ms hops is the slowest configuration by far)
    # each drafting configuration's adaptive K goes on from its previous round (its warm-up first), as a chat's turns
    # or a long-running server's requests would, instead of learning from the prior in every round
    carry_k: bool = False

    def __post_init__(self) -> None:
        if self.model is None and self.demo_target is None:
            raise ValueError("give --model (the throughput rows), --demo-target (the drafting rows), or both")
        for name in ("new_tokens", "prompt_tokens", "rounds", "threads_per_pc"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        if self.drafting_kv_cache not in (None, *KV_CACHE_PRECISIONS):
            raise ValueError(f"--kv-cache must be one of {', '.join(KV_CACHE_PRECISIONS)}, "
                             f"not {self.drafting_kv_cache}")
        if self.warmup_rounds < 0:
            raise ValueError(f"--warmup-rounds cannot be negative, not {self.warmup_rounds}")
        for k in self.fixed_ks:
            if not 1 <= k <= MAX_K:
                raise ValueError(f"--fixed-k takes draft lengths from 1 to {MAX_K}, not {k}")
        if len(set(self.fixed_ks)) != len(self.fixed_ks):
            raise ValueError(f"--fixed-k names a K twice: {' '.join(map(str, self.fixed_ks))}")
        if self.fixed_ks and self.demo_draft is None:
            raise ValueError("--fixed-k needs --demo-draft (its rows draft with the draft model)")
        unknown = sorted(set(self.drafters) - set(DRAFTERS))
        if unknown:
            raise ValueError(f"--drafters: unknown {', '.join(unknown)}; choose from {', '.join(DRAFTERS)}")
        needing = [name for name in self.drafters if DRAFTERS.get(name, ("", False))[1]]
        if needing and self.demo_draft is None:  # their rows were skipped, each "not run: no --demo-draft"
            raise ValueError(f"--drafters {' '.join(needing)} needs --demo-draft (the draft model drafts those rows)")
        if self.fixed_ks and self.drafters and "spec" not in self.drafters:
            raise ValueError("--fixed-k runs the draft model's rows: --drafters must keep spec")
        if not 0.0 <= self.wan_delay_s <= MAX_DELAY_S:  # NaN fails this too
            raise ValueError(f"--wan-delay-ms must be from 0 to {MAX_DELAY_S * 1000:g}, not {self.wan_delay_s * 1000}")
        bandwidth = self.wan_bandwidth_bytes_s
        if bandwidth is not None and not MIN_BANDWIDTH_BYTES_S <= bandwidth < math.inf:
            least = MIN_BANDWIDTH_BYTES_S / 125_000
            raise ValueError(f"--wan-bandwidth-mbit must be a finite number, at least {least:g} (leave it out for no "
                             f"limit), not {bandwidth / 125_000}")

    def runs_drafter(self, suffix: str) -> bool:
        """Whether the drafting rows run with this drafter (DRAFTERS' key)."""
        return not self.drafters or suffix in self.drafters


@dataclass
class _Config:
    key: str
    group: str  # the deployment it runs on
    streams: int
    max_rows: int
    micro_batches: int
    drafter: str | None = None  # one of DRAFTERS: the draft model, prompt lookup, or prompt lookup first
    return_logits: bool = False
    copies: int = 1  # independent chains run at once (group, group + "-b", ...)
    one_at_a_time: bool = False  # serve the streams one after another (a 1-stream baseline for their prompts)
    fixed_k: int | None = None  # the drafter proposes exactly this many tokens a round (None: adaptive K)
    runs: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class _Row:
    title: str
    config: str
    baseline: str | tuple[str, ...] | None  # ratio of medians against this config (a tuple: the fastest)
    paper: str
    goal: str
    # Where two PCs serving N users would land if the hops were free, as (factor, config): factor x that
    # config's tok/s over the baseline's. Their best schedule is two micro-batches of N/2 rows, each PC busy
    # with half the layers of both: the throughput of two whole 1-PC servers of N/2 users each (2 x mono_N/2).
    # Only a stage's weights fitting a cache that the whole model's do not can beat it; the two cores'
    # contention (see the 1-PC copies row) only lowers it. A goal above it asks batching to gain less.
    ideal_split: tuple[float, str] | None = None


GROUP_OF_PCS = {1: "mono", 2: "pair", 3: "trio", 4: "quad"}
GENAI_GROUP = "genai"  # no deployment: GenAI's ContinuousBatchingPipeline on the first PC's core
WAN_GROUP = "wan"  # the demo target on two PCs reached through delay proxies
# The drafting rows' drafters: config suffix -> (the rows' name for it, the drafter: `--demo-draft` or not, prompt
# lookup or not; both is prompt lookup first, controller/lookup_first.py). Those that use the draft model run
# only with `--demo-draft`.
DRAFTERS = {"spec": ("draft model", True, False), "lookup": ("prompt lookup", False, True),
            "first": ("lookup first", True, True)}
USER_COUNTS = (2, 4, 8)  # the honest baseline: the same users on 1 PC with deskfleet's own batching
MAX_PCS = max(GROUP_OF_PCS)


def fleet_rows(max_pcs: int, fixed_ks: Sequence[int] = ()) -> tuple[_Row, ...]:
    """The report's rows: the paper's table, the honest 1-PC baselines, the 3-4 PC rows up to max_pcs, and a
    draft-model row with K fixed at each of `fixed_ks` beside each adaptive one."""
    rows = [
        _Row("1 PC (monolithic)", "mono_1", None, "1.00x", "1.00x"),
        _Row("2 PCs, 1 stream", "pair_1", "mono_1", "0.67x", ">= 0.95x"),
        _Row("2 PCs, 2 streams", "pair_2", "mono_1", "1.20x", ">= 1.90x"),
        _Row("two independent 1-PC copies, 1 stream each", "copies_2", "mono_1", "-", "2 PCs 2 streams >= 0.95 of it"),
        _Row("2 PCs, 2 streams vs two 1-PC copies", "pair_2", "copies_2", "-", ">= 0.95x"),
        _Row("2 PCs, 8 users (batched micro-batches)", "pair_8", "mono_1", "not in the paper", ">= 6x",
             ideal_split=(2.0, "mono_4")),
    ]
    for users in USER_COUNTS:
        rows.append(_Row(f"1 PC, {users} users (batched)", f"mono_{users}", "mono_1", "-", "-"))
        rows.append(_Row(f"2 PCs vs 1 PC serving the same {users} users", f"pair_{users}", f"mono_{users}", "-",
                         ">= 1.6x", ideal_split=(2.0, f"mono_{users // 2}")))
    for users in USER_COUNTS:
        rows.append(_Row(f"1 PC, {users} users, OpenVINO GenAI continuous batching (no network)",
                         f"genai_{users}", "mono_1", "-", "-"))
        rows.append(_Row(f"2 PCs vs the faster 1 PC (deskfleet batching or GenAI CB), {users} users",
                         f"pair_{users}", (f"mono_{users}", f"genai_{users}"), "-", ">= 1.6x",
                         ideal_split=(2.0, f"mono_{users // 2}")))
    for pcs in range(3, max_pcs + 1):
        group = GROUP_OF_PCS[pcs]
        rows += [_Row(f"{pcs} PCs, 1 stream", f"{group}_1", "mono_1", "-", "-"),
                 _Row(f"{pcs} PCs, {pcs} streams", f"{group}_{pcs}", "mono_1", "-", "-"),
                 _Row(f"{pcs} PCs, 8 users (batched micro-batches)", f"{group}_8", "mono_1", "-", "-"),
                 _Row(f"{pcs} PCs vs 1 PC serving the same 8 users", f"{group}_8", "mono_8", "-", "-")]
    # The drafting rows' baseline serves the same prompts (their tok/s depends on the prompt): 1 PC, plain
    # decoding, the row's N streams one after another.
    # Beside each, the honest baseline the paper never ran for them: the same streams on 1 PC as rows of one
    # batched micro-batch, drafted the same way (a small model's step costs about the same for 2 rows as for 1).
    for pcs in range(2, MAX_PCS + 1):
        group = GROUP_OF_PCS[pcs]
        paper, goal = {2: ("1.79x", ">= 3.0x"), 3: ("2.64x", ">= 4.0x")}.get(pcs, ("-", "-"))
        rows.append(_Row(f"drafting target, 1 PC, the {pcs} streams' prompts one at a time",
                         f"demo_mono_seq{pcs}", None, "1.00x", "1.00x"))
        for suffix, (drafter, _, _) in DRAFTERS.items():
            rows += [
                _Row(f"{pcs} PCs, {pcs} streams + speculative ({drafter})", f"demo_{group}_{pcs}_{suffix}",
                     f"demo_mono_seq{pcs}", *((paper, goal) if suffix == "spec" else ("-", "-"))),
                _Row(f"1 PC, {pcs} streams batched + speculative ({drafter})", f"demo_mono_{pcs}_{suffix}",
                     f"demo_mono_seq{pcs}", "-", "-"),
                _Row(f"{pcs} PCs vs 1 PC, {pcs} streams batched + speculative ({drafter})",
                     f"demo_{group}_{pcs}_{suffix}", f"demo_mono_{pcs}_{suffix}", "-", "-"),
            ]
        rows += [_Row(f"{pcs} PCs, {pcs} streams + speculative (draft model, K fixed at {k})",
                      f"demo_{group}_{pcs}_spec_k{k}", f"demo_mono_seq{pcs}", "-", "-") for k in fixed_ks]
    rows += [
        _Row("100 ms per hop, full stack vs naive pipeline (drafting pair)", "wan_full", "wan_naive", "4.04x",
             ">= 6x"),
        _Row("100 ms per hop, token ids vs full logits back (drafting target)", "wan_naive_ids", "wan_naive", "8.17x",
             "report"),
    ]
    return tuple(rows)


# Public functions

def run_fleet_bench(options: FleetBenchOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start the simulated PCs, deploy, run every configuration `rounds` times interleaved; the report."""
    say = progress or (lambda text: log.info("%s", text))
    check_inputs(options)
    cores = sorted(os.sched_getaffinity(0))
    controller_cores, agent_cores = split_cores(cores, options.max_pcs, options.controller_cores,
                                                options.threads_per_pc)
    configs = bench_configs(options)
    groups = bench_groups(options)
    if controller_cores:
        os.sched_setaffinity(0, controller_cores)
    genai: GenAIUsers | None = None
    try:
        if options.genai_model is not None:  # on the first PC's core, as 1 PC serving the users itself
            # with the properties a PC's stage compiles with (--precision fast), so both run the same kernels
            assert options.model is not None  # check_inputs: --genai-model needs --model
            properties = CompileSettings(device="CPU", precision=StagePrecision.FAST,
                                         num_threads=options.threads_per_pc).properties(
                export_weight_group_size(options.model))
            genai = GenAIUsers(options.genai_model, options.genai_python, "CPU", properties, options.new_tokens,
                               set(agent_cores[:options.threads_per_pc]))
        with tempfile.TemporaryDirectory(prefix="deskfleet-bench-") as work, \
                _Fleet(Path(work), agent_layout(groups, agent_cores, options.threads_per_pc), options.threads_per_pc,
                       groups[WAN_GROUP][1] if WAN_GROUP in groups else (), options.wan_delay_s,
                       options.wan_bandwidth_bytes_s) as fleet:
            say(f"{len(fleet.names)} simulated PCs up; deploying")
            with fleet.naming_ended_pcs():
                placements = {group: fleet.deploy(model, names, options.drafting_kv_cache if _drafting(group) else None)
                              for group, (model, names) in groups.items()}
                for group, stages in placements.items():
                    if len(stages) < len(groups[group][1]):
                        say(f"{group}: the plan uses {len(stages)} of its {len(groups[group][1])} PCs")
                _run_rounds(fleet, placements, configs, options, genai, say)
    finally:
        if genai is not None:
            genai.close()
        os.sched_setaffinity(0, cores)
    deployments = {group: {"pcs": len(groups[group][1]), "stages": len(stages),
                           "layers": [[stage.layer_start, stage.layer_end] for stage in stages]}
                   for group, stages in placements.items()}
    report = build_report(options, configs, controller_cores, agent_cores, deployments)
    if genai is not None:
        report["genai_baseline"] = genai.meta  # its compile properties among them
    return report


def _run_rounds(fleet: _Fleet, placements: dict[str, tuple[StagePlacement, ...]], configs: list[_Config],
                options: FleetBenchOptions, genai: GenAIUsers | None, say: Callable[[str], None]) -> None:
    """The warm-up rounds, then the timed ones (recorded in each config's `runs`), each in its rotated order."""
    drafters: dict[str, Drafter | None] = {}
    learned_ks: dict[str, AdaptiveK] = {}  # with --carry-k: each configuration's adaptive K, round to round
    for round_index in range(-options.warmup_rounds, options.rounds):
        label = "warm-up" if round_index < 0 else f"round {round_index + 1}/{options.rounds}"
        for config in round_order(configs, round_index):
            if config.group == GENAI_GROUP:
                assert genai is not None and options.model is not None
                run = genai.run(_prompts(options.model, config.streams, options.prompt_tokens, False))
                result = {"tok_s": run.tok_s, "tokens": float(run.generated), "wall_s": run.wall_s,
                          "mean_accepted": 0.0, "mean_k": 0.0, "final_k": 0.0}
            else:
                result = _run_config(fleet, placements, config, options, drafters,
                                     learned_ks if options.carry_k else None)
            if round_index >= 0:
                config.runs.append(result)
            timing = (f" (accepted {result['mean_accepted']:.2f} of {result['mean_k']:.2f} proposed a round, "
                      f"round trip {result['round_trip_ms']:.1f} ms, "
                      f"drafting {result['draft_share']:.0%} and waiting {result['wait_share']:.0%} of the wall)"
                      if result.get("round_trip_ms") else "")
            if result.get("verify_ms"):
                timing += f", {result['verify_ms']:.2f} ms a verified position (adaptive K's fit)"
            if result.get("changed_share"):
                timing += f", {result['changed_share']:.0%} of rounds at a changed width"
            if result.get("steady_tok_s"):
                timing += f", steady {result['steady_tok_s']:.1f} tok/s"
            say(f"{label} {config.key}: {result['tok_s']:.1f} tok/s{timing}")


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["| row | the paper (iGPU, 2 PCs) | our goal | measured (median) | tok/s median (min-max) |",
             "|---|---|---|---|---|"]
    for row in report["rows"]:
        # a row not run says why ("not run: needs --pcs 3 ..."), as the JSON's note does
        ratio = f"{row['ratio']:.2f}x" if row.get("ratio") is not None else row.get("note") or "not run"
        tok = row.get("tok_s")
        spread = f"{tok['median']:.1f} ({tok['min']:.1f}-{tok['max']:.1f})" if tok else "-"
        if row.get("ideal_split") is not None:
            ratio += f" (ideal split {row['ideal_split']:.2f}x)"
        if row.get("note") and row.get("ratio") is not None:
            ratio += f" ({row['note']})"
        lines.append(f"| {row['row']} | {row['paper']} | {row['goal']} | {ratio} | {spread} |")
    return "\n".join(lines)


def check_inputs(options: FleetBenchOptions) -> None:
    """What would otherwise fail only once the simulated PCs are up, or after other configurations ran: the
    exports (manifests only, nothing compiled), the prompts' length against the model's context, the demo draft
    against the demo target, the GenAI inputs."""
    if options.drafting_kv_cache is not None and options.demo_target is None:
        raise ValueError("--kv-cache needs --demo-target (it is the drafting and WAN rows' cache; the throughput "
                         "rows keep the precision's own)")
    if options.model is not None:
        context = load_manifest(options.model).spec.max_context
        if options.prompt_tokens + options.new_tokens > context:
            raise ValueError(f"--prompt-tokens {options.prompt_tokens} + --new-tokens {options.new_tokens} exceed "
                             f"the context of --model {options.model} ({context} tokens)")
    elif options.genai_model is not None:
        raise ValueError("--genai-model needs --model (its GenAI rows serve --model's users)")
    if options.demo_draft is not None and options.demo_target is None:
        raise ValueError("--demo-draft needs --demo-target (the target it drafts for)")
    if options.demo_target is not None:
        target = load_manifest(options.demo_target).spec
        # the drafting and WAN rows' prompts are the held-out ones, as many as their most streams (8 over the WAN)
        longest = max(map(len, _prompts(options.demo_target, max(MAX_PCS, *USER_COUNTS), 0, demo=True)))
        if longest + options.new_tokens > target.max_context:
            raise ValueError(f"--new-tokens {options.new_tokens} + the longest demo prompt ({longest} tokens) exceed "
                             f"the context of --demo-target {options.demo_target} ({target.max_context} tokens)")
        if options.demo_draft is not None:
            try:
                check_draft_for(options.demo_draft, load_manifest(options.demo_draft), options.demo_target,
                                load_manifest(options.demo_target))
            except ValueError as error:
                raise ValueError(f"--demo-draft {options.demo_draft} cannot draft for --demo-target "
                                 f"{options.demo_target}: {error}") from None
    check_genai_inputs(options.genai_model, options.genai_python)


# Private functions: configurations

def split_cores(cores: Sequence[int], max_pcs: int, controller_cores: int,
                cores_per_pc: int = 1) -> tuple[list[int], list[int]]:
    """(the controller's cores, the simulated PCs' cores): the first `controller_cores` go to the controller;
    the PCs need `cores_per_pc` each (one per inference thread)."""
    if not 2 <= max_pcs <= MAX_PCS:
        raise ValueError(f"--pcs must be between 2 and {MAX_PCS}, not {max_pcs}")
    if controller_cores < 0:
        raise ValueError(f"--controller-cores must be 0 or more, not {controller_cores}")
    controller, agents = list(cores[:controller_cores]), list(cores[controller_cores:])
    if len(agents) < max_pcs * cores_per_pc:
        raise RuntimeError(f"{max_pcs} simulated PCs of {cores_per_pc} core(s) need {max_pcs * cores_per_pc} cores "
                           f"of their own beside the controller's {controller_cores}; this process may use "
                           f"{len(cores)} ({list(cores)})")
    return controller, agents


def bench_groups(options: FleetBenchOptions) -> dict[str, tuple[Path, list[str]]]:
    """Deployment group -> (model, its simulated PCs in stage order)."""
    groups: dict[str, tuple[Path, list[str]]] = {}
    if options.model is not None:
        groups |= {"mono": (options.model, ["mono"]), "mono-b": (options.model, ["mono-b"])}
    models = [(prefix, model) for prefix, model in (("", options.model), ("demo_", options.demo_target))
              if model is not None]
    for prefix, model in models:
        if prefix:
            groups[f"{prefix}mono"] = (model, [f"{prefix}mono"])
        for pcs in range(2, options.max_pcs + 1):
            group = f"{prefix}{GROUP_OF_PCS[pcs]}"
            groups[group] = (model, [f"{group}{index}" for index in range(pcs)])
    if options.demo_target is not None and options.wan:
        groups[WAN_GROUP] = (options.demo_target, [f"{WAN_GROUP}0", f"{WAN_GROUP}1"])
    return groups


def agent_layout(groups: dict[str, tuple[Path, list[str]]], agent_cores: Sequence[int],
                 cores_per_pc: int = 1) -> dict[str, tuple[int, ...]]:
    """Simulated PC -> its cores: the i-th PC of every group on the i-th `cores_per_pc` agent cores, the second
    1-PC copy on the second. Groups run one at a time (the two copies together), so no two busy PCs share a
    core."""
    layout: dict[str, tuple[int, ...]] = {}
    for group, (_, names) in groups.items():
        for index, name in enumerate(names):
            slot = 1 if group == "mono-b" else index
            layout[name] = tuple(agent_cores[slot * cores_per_pc:(slot + 1) * cores_per_pc])
    return layout


def bench_configs(options: FleetBenchOptions) -> list[_Config]:
    """Every configuration to run, in the interleaving order of a round."""
    configs: list[_Config] = []
    if options.model is not None:
        configs += [_Config("mono_1", "mono", 1, 1, 1), _Config("copies_2", "mono", 1, 1, 1, copies=2)]
        configs += [_Config(f"mono_{users}", "mono", users, users, 1) for users in USER_COUNTS]
        configs += [_Config("pair_1", "pair", 1, 1, 1), _Config("pair_2", "pair", 2, 1, 2),
                    _Config("pair_4", "pair", 4, 2, 2), _Config("pair_8", "pair", 8, 4, 2)]
        for pcs in range(3, options.max_pcs + 1):
            group = GROUP_OF_PCS[pcs]
            configs += [_Config(f"{group}_1", group, 1, 1, 1), _Config(f"{group}_{pcs}", group, pcs, 1, pcs),
                        _Config(f"{group}_8", group, 8, -(-8 // pcs), pcs)]
    if options.genai_model is not None:
        configs += [_Config(f"genai_{users}", GENAI_GROUP, users, users, 1) for users in USER_COUNTS]
    if options.demo_target is not None:
        configs += [_Config(f"demo_mono_seq{streams}", "demo_mono", streams, 1, 1, one_at_a_time=True)
                    for streams in range(2, options.max_pcs + 1)]
        if options.wan:
            configs += [_Config("wan_naive", WAN_GROUP, 1, 1, 1, return_logits=True),
                        _Config("wan_naive_ids", WAN_GROUP, 1, 1, 1)]
        for suffix, (_, uses_model, _) in DRAFTERS.items():
            if (uses_model and options.demo_draft is None) or not options.runs_drafter(suffix):
                continue
            for pcs in range(2, options.max_pcs + 1):
                group = f"demo_{GROUP_OF_PCS[pcs]}"
                configs.append(_Config(f"{group}_{pcs}_{suffix}", group, pcs, 1, pcs, drafter=suffix))
                configs.append(_Config(f"demo_mono_{pcs}_{suffix}", "demo_mono", pcs, pcs, 1, drafter=suffix))
                if suffix == "spec":
                    configs += [_Config(f"{group}_{pcs}_spec_k{k}", group, pcs, 1, pcs, drafter=suffix, fixed_k=k)
                                for k in options.fixed_ks]
        if options.wan:
            configs.append(_Config("wan_full", WAN_GROUP, 8, 4, 2,
                                   drafter="spec" if options.demo_draft is not None else None))
    return configs


@functools.cache
def _demo_texts(count: int) -> tuple[str, ...]:
    """The demo model's held-out code prompts (as `bench speculative` uses), else a few code heads."""
    try:
        return tuple(heldout_code_prompts(DEFAULT_EVAL_DIR, count))
    except (OSError, ValueError) as error:
        log.warning("held-out code prompts unavailable (%s); using built-in code prompts", error)
        return tuple(DEMO_TEXTS[index % len(DEMO_TEXTS)] for index in range(count))


def _prompts(model: Path, count: int, length: int, demo: bool) -> list[list[int]]:
    if demo:
        tokenizer = ModelTokenizer(model)
        return [tokenizer.encode(text) for text in _demo_texts(count)]
    vocab = load_manifest(model).spec.vocab_size
    rng = np.random.default_rng(1234)
    return [[int(token) for token in rng.integers(3, min(vocab, 30000), length)] for _ in range(count)]


def _run_config(fleet: _Fleet, placements: dict[str, tuple[StagePlacement, ...]], config: _Config,
                options: FleetBenchOptions, drafters: dict[str, Drafter | None],
                learned_ks: dict[str, AdaptiveK] | None = None) -> dict[str, float]:
    """One run of a configuration. `drafters` and `learned_ks` (adaptive K's, given only with --carry-k) are kept
    by configuration from round to round."""
    demo = _drafting(config.group)
    model = options.demo_target if demo else options.model
    assert model is not None
    groups = [config.group] if config.copies == 1 else [config.group, f"{config.group}-b"][: config.copies]
    results: list[dict[str, float]] = [{} for _ in groups]
    errors: list[BaseException | None] = [None for _ in groups]
    # Copies start generating together, once every chain is open (opening one is a TLS handshake per PC,
    # and a copy that ran alone for a while ran faster), and their wall is the first start to the last end.
    start_together = threading.Barrier(len(groups))

    def one(index: int, group: str) -> None:
        try:
            run_one(index, group)
        except BaseException as error:  # carried to the caller's thread: raised there with its message
            log.debug("configuration %s on %s failed", config.key, group, exc_info=True)
            errors[index] = error
            start_together.abort()  # the other copies stop waiting (BrokenBarrierError)

    def run_one(index: int, group: str) -> None:
        if config.key not in drafters:  # one per configuration: its warm-up round warms it too
            _, uses_model, uses_lookup = DRAFTERS[config.drafter] if config.drafter else ("", False, False)
            drafters[config.key] = open_drafter(options.demo_draft if uses_model else None, uses_lookup,
                                                over_fleet=True)
        draft = drafters[config.key]
        engine_options = EngineOptions(max_rows=config.max_rows, micro_batches=config.micro_batches,
                                       fixed_k=config.fixed_k)
        with FleetPipeline(placements[group], fleet.store.tls_files, return_logits=config.return_logits,
                           model_id=model_id_of(model)) as chain:
            spec = load_manifest(model).spec
            prompts = _prompts(model, config.streams, options.prompt_tokens, demo)
            # One engine for all streams, or (a 1-PC baseline serving a row's users one after another) one
            # engine per stream, run back to back.
            batches = [prompts[index:index + 1] for index in range(len(prompts))] if config.one_at_a_time \
                else [prompts]
            learned = learned_ks.get(config.key) if learned_ks is not None else None
            engines = [Engine(chain, spec, draft, engine_options, learned) for _ in batches]
            for engine, batch in zip(engines, batches, strict=True):
                for prompt in batch:
                    engine.add(StreamRequest(prompt, max_new_tokens=options.new_tokens, ignore_eos=True))
            start_together.wait(timeout=STEP_TIMEOUT_S)
            clocks: list[dict[int, list[float]]] = [{} for _ in engines]  # per engine: each stream's token times
            started = time.perf_counter()
            streams = [stream for engine, clock in zip(engines, clocks, strict=True)
                       for stream in engine.run(on_token=_token_clock(clock)).values()]
            ended = time.perf_counter()
        if draft is not None and learned_ks is not None:
            learned_ks[config.key] = engines[-1].k_policy
        results[index] = {"tokens": float(sum(len(s.tokens) for s in streams)), "started": started, "ended": ended,
                          "mean_accepted": engines[0].mean_accepted() if draft else 0.0,
                          "mean_k": engines[0].mean_k() if draft else 0.0,
                          "final_k": float(engines[0].k_policy.k) if draft else 0.0,
                          # what adaptive K learned a verified position costs (0 until two widths were measured)
                          "verify_ms": engines[0].k_policy.cost.verify_seconds_per_token * 1000 if draft else 0.0,
                          # drafted rounds at another width than the one before (each re-prepared at every stage)
                          "changed_share": engines[0].k_policy.changed_width_share() if draft else 0.0,
                          "steady_tok_s": steady_rate(clocks), **_driver_times(engines, ended - started)}

    threads = [threading.Thread(target=one, args=(index, group)) for index, group in enumerate(groups)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # the copy that failed, not the one its abort() released from the barrier
    failed = [error for error in errors if error is not None]
    error = next((error for error in failed if not isinstance(error, threading.BrokenBarrierError)),
                 failed[0] if failed else None)
    if error is not None:
        raise RuntimeError(f"configuration {config.key} failed: {type(error).__name__}: {error}") from error
    tokens = sum(result["tokens"] for result in results)
    wall = max(result["ended"] for result in results) - min(result["started"] for result in results)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": round(wall, 4),
            "mean_accepted": results[0]["mean_accepted"], "mean_k": results[0]["mean_k"],
            "final_k": results[0]["final_k"], "verify_ms": results[0]["verify_ms"],
            "changed_share": results[0]["changed_share"],
            # copies run at once: their steady rates add up
            "steady_tok_s": sum(result["steady_tok_s"] for result in results),
            **{key: results[0][key] for key in DRIVER_TIMES}}


DRIVER_TIMES = ("draft_share", "wait_share", "round_trip_ms")


def _token_clock(clock: dict[int, list[float]]) -> Callable[[int, int], None]:
    """An engine's on_token callback that records when each stream's every token came (perf_counter)."""
    def record(stream_id: int, token: int) -> None:
        clock.setdefault(stream_id, []).append(time.perf_counter())
    return record


def steady_rate(clocks: Sequence[dict[int, list[float]]]) -> float:
    """Tokens a second while every stream of a run was generating: from the moment the last stream's first
    token came (every prompt prefilled, every stream running) to the moment the first stream's last one did
    (before any ended and left the pipeline part empty), for runs of engines one after another (`clocks`: per
    engine, each stream's token times). That is the rate a server with a steady flow of users would run at,
    without a short run's start and end; 0.0 when no engine had such a window (a stream that ended before
    another began)."""
    tokens, seconds = 0, 0.0
    for clock in clocks:
        times = [stream_times for stream_times in clock.values() if stream_times]
        if not times:
            continue
        begin = max(stream_times[0] for stream_times in times)
        end = min(stream_times[-1] for stream_times in times)
        if end <= begin:
            continue
        tokens += sum(1 for stream_times in times for moment in stream_times if begin < moment <= end)
        seconds += end - begin
    return tokens / seconds if seconds > 0 else 0.0


def _driver_times(engines: Sequence[Engine], wall: float) -> dict[str, float]:
    """Where the controller's driver thread spent a run (controller/engine.py, EngineTimings): the share of the
    wall proposing draft tokens and waiting for the chain, and a drafted step's mean round trip (0 when none)."""
    draft = sum(engine.timings.draft_seconds for engine in engines)
    wait = sum(engine.timings.wait_seconds for engine in engines)
    rounds = sum(engine.timings.drafted_rounds for engine in engines)
    trips = sum(engine.timings.round_trip_seconds for engine in engines)
    return {"draft_share": draft / wall if wall > 0 else 0.0, "wait_share": wait / wall if wall > 0 else 0.0,
            "round_trip_ms": 1000.0 * trips / rounds if rounds else 0.0}


def build_report(options: FleetBenchOptions, configs: list[_Config], controller_cores: list[int],
                 agent_cores: list[int], deployments: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Medians, spreads and each row's ratio; a row whose group the planner put on fewer PCs than its title
    says carries a note (`deployments`: group -> {"pcs", "stages", "layers"})."""
    deployments = deployments or {}
    by_key = {config.key: config for config in configs}
    summary: dict[str, dict[str, Any]] = {}
    for config in configs:
        speeds = [run["tok_s"] for run in config.runs]
        summary[config.key] = {"median": statistics.median(speeds), "min": min(speeds), "max": max(speeds),
                               "runs": [round(speed, 3) for speed in speeds],
                               "mean_accepted": statistics.median(run["mean_accepted"] for run in config.runs),
                               "mean_k": statistics.median(run.get("mean_k", 0.0) for run in config.runs),
                               "final_k": statistics.median(run["final_k"] for run in config.runs),
                               **{key: round(statistics.median(run.get(key, 0.0) for run in config.runs), 4)
                                  for key in ("steady_tok_s", "verify_ms", "changed_share", *DRIVER_TIMES)}}
    rows: list[dict[str, Any]] = []
    delay = f"{options.wan_delay_s * 1000:.0f} ms per hop"
    for row in (replace(row, title=row.title.replace("100 ms per hop", delay))
                for row in fleet_rows(MAX_PCS, options.fixed_ks)):
        baselines = _baselines(row)
        if row.config not in by_key or any(baseline not in by_key for baseline in baselines):
            rows.append({"row": row.title, "paper": row.paper, "goal": row.goal, "ratio": None, "tok_s": None,
                         "config": row.config, "note": _not_run_reason(row, options)})
            continue
        tok = summary[row.config]
        baseline = max(baselines, key=lambda key: summary[key]["median"]) if baselines else None
        ratio = 1.0 if baseline is None else tok["median"] / summary[baseline]["median"]
        entry = {"row": row.title, "paper": row.paper, "goal": row.goal, "ratio": round(ratio, 3),
                 "tok_s": {key: round(tok[key], 3) for key in ("median", "min", "max")},
                 "config": row.config, "baseline": baseline}
        if baseline is not None and tok["steady_tok_s"] > 0 and summary[baseline]["steady_tok_s"] > 0:
            # the same ratio between the two configurations' steady rates (steady_rate): reported, not the goal's
            entry["steady_ratio"] = round(tok["steady_tok_s"] / summary[baseline]["steady_tok_s"], 3)
        if row.ideal_split is not None and baseline is not None and row.ideal_split[1] in summary:
            factor, reference = row.ideal_split
            entry["ideal_split"] = round(factor * summary[reference]["median"] / summary[baseline]["median"], 3)
        deployed = deployments.get(by_key[row.config].group)
        if deployed is not None and deployed["stages"] < deployed["pcs"]:
            entry["note"] = f"the plan used {deployed['stages']} of its {deployed['pcs']} PCs"
        elif row.config == "wan_full" and by_key[row.config].drafter is None:
            entry["note"] = "no --demo-draft: the full stack ran without drafting"
        rows.append(entry)
    cpus = len(controller_cores) + len(agent_cores)
    return {"machine": {"cpus": cpus, "controller_cores": controller_cores or "not pinned (shares the PCs' cores)",
                        "pc_cores": agent_cores, "platform": platform.platform(),
                        "event_loop": event_loop.chosen_loop()},
            "host": host_report(),  # allocator: the PCs' processes follow the same rule
            "options": {"model": _path_or_none(options.model), "demo_target": _path_or_none(options.demo_target),
                        "demo_draft": _path_or_none(options.demo_draft), "drafting_kv_cache": options.drafting_kv_cache,
                        "new_tokens": options.new_tokens,
                        "prompt_tokens": options.prompt_tokens, "rounds": options.rounds,
                        "warmup_rounds": options.warmup_rounds,
                        "threads_per_pc": options.threads_per_pc, "wan_delay_s": options.wan_delay_s,
                        "max_pcs": options.max_pcs, "controller_cores": options.controller_cores,
                        "genai_model": _path_or_none(options.genai_model),
                        "wan_bandwidth_bytes_s": options.wan_bandwidth_bytes_s,
                        "fixed_ks": list(options.fixed_ks), "drafters": list(options.drafters or DRAFTERS),
                        "wan": options.wan, "carry_k": options.carry_k},
            "configs": summary, "rows": rows, "deployments": deployments}


def _path_or_none(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _drafting(group: str) -> bool:
    """Whether a deployment group serves the drafting or WAN rows (--demo-target), not the throughput rows."""
    return group.startswith("demo_") or group == WAN_GROUP


def _baselines(row: _Row) -> tuple[str, ...]:
    return (row.baseline,) if isinstance(row.baseline, str) else row.baseline or ()


def _not_run_reason(row: _Row, options: FleetBenchOptions) -> str:
    # the model first: without --model, --genai-model is refused (its rows serve --model's users)
    if row.config.startswith(("demo_", "wan_")) and options.demo_target is None:
        return "not run: no --demo-target"
    if row.config.startswith("wan_") and not options.wan:
        return "not run: --no-wan"
    if not row.config.startswith(("demo_", "wan_")) and options.model is None:
        return "not run: no --model"
    if any(key.startswith(f"{GENAI_GROUP}_") for key in (row.config, *_baselines(row))) \
            and options.genai_model is None:
        return "not run: no --genai-model"
    if row.config.endswith(("_spec", "_first")) and options.demo_draft is None:
        return "not run: no --demo-draft"
    drafted = re.fullmatch(r"demo_\w+?_\d+_(spec|lookup|first)(?:_k\d+)?", row.config)
    if drafted and not options.runs_drafter(drafted.group(1)):
        return f"not run: --drafters leaves out {drafted.group(1)}"
    return f"not run: needs --pcs {max(_pcs_needed(key) for key in (row.config, *_baselines(row)))} (one core " \
           "per simulated PC)"


def _pcs_needed(config: str) -> int:
    """The simulated PCs a configuration's group needs beside it in the bench: its own, or (the 1-PC baselines of
    the drafting rows, demo_mono_seqN and demo_mono_N_*) those of the N-PC row it stands beside."""
    beside = re.fullmatch(r"demo_mono_(?:seq)?(\d+)(?:_\w+)?", config)
    if beside:
        return int(beside.group(1))
    return next((pcs for pcs, group in GROUP_OF_PCS.items() if re.match(rf"(?:demo_)?{group}(?:_|-|$)", config)), 1)


# Private: the simulated PCs

class _Fleet:
    """A fleet CA, one agent process per simulated PC (pinned), a delay proxy in front of each `proxied` PC."""

    def __init__(self, work: Path, agents: dict[str, tuple[int, ...]], threads: int, proxied: Sequence[str] = (),
                 delay_s: float = 0.0, bandwidth_bytes_s: float | None = None) -> None:
        self.work = work
        self.names = list(agents)
        self.store = FleetStore(work / "controller")
        init_fleet(self.store, "bench", ("127.0.0.1:1",), utc_now())
        ca = load_ca(self.store)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for name, pc_cores in agents.items():
                self._start_agent(name, pc_cores, threads, ca)
        except BaseException:  # Ctrl-C among the starts: no `with` holds this fleet yet to stop those begun
            self._stop()
            raise
        self.proxied = set(proxied)
        self.delay_s, self.bandwidth_bytes_s = delay_s, bandwidth_bytes_s
        self.address_of: dict[str, str] = {}  # how the controller and the other PCs dial each PC
        self.proxy_of: dict[str, DelayProxy] = {}

    def __enter__(self) -> _Fleet:
        try:
            for name, process in self.processes.items():
                port = _wait_port_file(self.work / f"{name}.port", process, self.work / f"{name}.log")
                self.address_of[name] = f"127.0.0.1:{port}"
                if name in self.proxied:
                    self.proxy_of[name] = DelayProxy(self.address_of[name])
            self.proxies = ProxyThread(list(self.proxy_of.values()))
            self.proxies.set_delay(self.delay_s, self.bandwidth_bytes_s)
            self.proxies.__enter__()
            for name, proxy in self.proxy_of.items():
                self.address_of[name] = proxy.address
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.proxies.__exit__()
        finally:
            self._stop()

    def _start_agent(self, name: str, pc_cores: tuple[int, ...], threads: int, ca: pki.FleetCa) -> None:
        """Start one simulated PC's process, logging to NAME.log, and record it in `processes`; it ends when this
        process does (its stdin: a pipe that the kernel closes however this process ends, even by SIGKILL)."""
        files = TlsFiles.in_folder(self.work / name, "agent")
        with signals_held():  # a signal's exception raised inside cryptography's code came back as a bad signature
            _issue(ca, files, name)
        # the child has its own copy of the log file; a signal in Popen would leave a child no Popen names
        with (self.work / f"{name}.log").open("wb") as log_file, signals_held():
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "deskfleet.controller.bench.fleet_agent", "--tls-dir", str(self.work / name),
                 "--name", "agent", "--listen", "127.0.0.1:0", "--port-file", str(self.work / f"{name}.port"),
                 "--cores", ",".join(map(str, pc_cores)), "--cache", str(self.work / name / "cache"),
                 "--threads", str(threads), "--stop-on-stdin-eof"],
                stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT)

    def deploy(self, model: Path, names: Sequence[str], kv_cache: str | None = None) -> tuple[StagePlacement, ...]:

        async def run() -> tuple[StagePlacement, ...]:
            peers = tuple(self.address_of[name] for name in names)
            found = await survey(self.store, SurveyOptions(peers=peers, discover_seconds=0, use_roster=False))
            try:
                _, report = await deploy(self.store, model, found, PLAN_OPTIONS, Precision.DEVICE_DEFAULT,
                                         kv_cache=kv_cache)
            finally:
                await found.close()
            return report.stages

        # The planner may leave a PC out when a share of the layers would not shorten the slowest stage
        # (the demo target's head weighs two layers: 3 stages are as fast as 4); the report says so.
        return event_loop.run(run())

    @contextlib.contextmanager
    def naming_ended_pcs(self) -> Iterator[None]:
        """An error in the block also names each simulated PC whose process has ended and how: the error itself
        (a link that closed) names the PC by an agent id the user never saw, and the PC's log goes with the
        temporary folder."""
        try:
            yield
        except Exception as error:
            ended = self.ended_pcs()
            if not ended:
                raise
            raise RuntimeError(f"{error}; {'; '.join(ended)}") from error

    def ended_pcs(self) -> list[str]:
        """For each simulated PC whose process has ended: its name, how it ended, its log's last line."""
        ended = []
        for name, process in self.processes.items():
            status = process.poll()
            if status is None:
                continue
            how = f"was killed by {_signal_name(-status)}" if status < 0 else f"exited with status {status}"
            last_line = _last_line(self.work / f"{name}.log")
            ended.append(f"simulated PC {name} {how}" + (f" (its log ends: {last_line})" if last_line else ""))
        return ended

    def _stop(self) -> None:
        stop_processes(self.processes.values())
        for process in self.processes.values():
            if process.stdin is not None:
                process.stdin.close()


def _issue(ca: pki.FleetCa, files: TlsFiles, name: str) -> None:
    files.cert_path.parent.mkdir(parents=True, exist_ok=True)
    key = pki.create_private_key()
    certificate = pki.sign_csr(ca, pki.create_csr(key, name), utc_now(), role=Role.AGENT)
    files.ca_path.write_bytes(pki.certificate_pem(ca.certificate))
    files.cert_path.write_bytes(pki.certificate_pem(certificate))
    pki.write_private_key(files.key_path, key)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name
        return f"signal {signum}"


def _last_line(path: Path) -> str:
    """The last non-empty line of a text file (a PC's log), or "" when there is none to read."""
    try:
        with path.open("rb") as stream:
            stream.seek(max(0, stream.seek(0, os.SEEK_END) - 4096))
            tail = stream.read().decode(errors="replace")
    except OSError:
        return ""
    return next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")


def _wait_port_file(port_file: Path, process: subprocess.Popen[bytes], log_path: Path,
                    timeout: float = 120.0) -> int:
    """The port a bench agent listens on, once it has written it (it writes after it listens)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"a bench agent exited ({process.returncode}): {log_path.read_text()[-2000:]}")
        if port_file.is_file():
            return int(port_file.read_text())
        time.sleep(0.2)
    raise RuntimeError(f"a bench agent did not listen within {timeout:.0f} s (see {log_path})")


def write_outputs(report: dict[str, Any], json_path: Path | None, markdown_path: Path | None) -> None:
    """Each file written whole or not at all (an existing one stays as it was when a write fails)."""
    for option, path, text in (("--json-out", json_path, lambda: json.dumps(report, indent=2)),
                               ("--markdown-out", markdown_path, lambda: render_markdown(report))):
        if path is None:
            continue
        try:
            write_atomic(path, (text() + "\n").encode())
        except OSError as error:
            raise RuntimeError(f"cannot write {option} {path}: {error} (the report is on stdout)") from error


__all__ = ["FleetBenchOptions", "add_fleet_bench_command", "agent_layout", "bench_configs", "bench_groups",
           "build_report", "check_inputs", "fleet_rows", "render_markdown", "run_fleet_bench", "split_cores",
           "write_outputs"]


def add_fleet_bench_command(benches: Any) -> None:
    """`deskfleet bench fleet` on the CLI's bench subparsers."""
    import argparse

    from deskfleet.controller.decoding_options import non_negative_int, positive_int

    parser: argparse.ArgumentParser = benches.add_parser(
        "fleet", help="the fleet's throughput table (1-4 PCs, streams, drafting, WAN hops) on simulated PCs")
    parser.add_argument("--model", type=path_argument, default=None,
                        help="throughput model export (about 1B INT4); left out, only the drafting and WAN rows run")
    parser.add_argument("--demo-target", type=path_argument, default=None,
                        help="the drafting and WAN rows' target export (the demo pair's, or a larger target)")
    parser.add_argument("--demo-draft", type=path_argument, default=None,
                        help="its draft export (the target's vocabulary, a context at least the target's)")
    parser.add_argument("--kv-cache", choices=KV_CACHE_PRECISIONS, default=None,
                        help="the KV cache of the drafting and WAN rows' PCs, plain baselines included (as `fleet "
                             "deploy --kv-cache`; default: the precision's own, u8 on a CPU). f32 makes a real "
                             "target's verification calls cheaper on a CPU, and drafted output token-identical to "
                             "plain decoding")
    parser.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=positive_int, default=32,
                              help="tokens each stream generates")
    parser.add_argument("--prompt-tokens", type=positive_int, default=16,
                        help="random prompt length of the --model rows (the demo rows use the held-out prompts)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed rounds, each running every configuration once")
    parser.add_argument("--warmup-rounds", type=non_negative_int, default=1,
                        help="untimed rounds before the timed ones")
    parser.add_argument("--threads-per-pc", type=positive_int, default=1,
                        help="inference threads of each simulated PC, each on a core of its own (default 1)")
    parser.add_argument("--pcs", type=whole_number, default=2, help="simulated PCs in the largest rows (2-4)")
    parser.add_argument("--controller-cores", type=non_negative_int, default=0,
                        help="pin the controller to the first N cores and the PCs to the rest (0: not pinned)")
    parser.add_argument("--wan-delay-ms", type=real_number, default=100.0, help="one-way delay per hop on WAN rows")
    parser.add_argument("--wan-bandwidth-mbit", type=real_number, default=None, help="per-link bandwidth on WAN rows")
    parser.add_argument("--genai-model", type=path_argument, default=None,
                        help="--model's checkpoint exported by optimum-intel: adds GenAI continuous-batching rows")
    parser.add_argument("--genai-python", type=program_argument, default=None, help="the GenAI venv's python")
    parser.add_argument("--no-wan", dest="wan", action="store_false",
                        help="leave out the WAN rows (their naive pipeline, ~3 tok/s over 100 ms hops, takes longest)")
    parser.add_argument("--drafters", nargs="+", choices=list(DRAFTERS), default=[],
                        help="run the drafting rows with these drafters only (default: all; spec: the draft model, "
                             "lookup: prompt lookup, first: prompt lookup first)")
    parser.add_argument("--fixed-k", type=positive_int, nargs="+", default=[], metavar="K",
                        help="also run the draft model's rows with K fixed at each of these, beside adaptive K's, "
                             "at every PC count (does adaptive K find the best K on this fleet?)")
    parser.add_argument("--carry-k", action="store_true",
                        help="each drafting configuration's adaptive K goes on from its previous round (as a chat's "
                             "turns or a server's requests would) instead of learning from the prior every round; "
                             "the rounds run the same prompts, so it has learned on the text it runs again")
    parser.add_argument("--json-out", type=path_argument, default=None,
                        help="also write the JSON here (checked before the bench runs; written whole or not at all)")
    parser.add_argument("--markdown-out", type=path_argument, default=None, help="also write the markdown table here")
    # the draft model, on this process's CPU; the demo prompts' tokenizer
    parser.set_defaults(handler=_bench_command, runs_models=True, extras=("controller",))


def _bench_command(args: Any) -> int:
    # Checked before the bench runs: a path found wrong only afterwards would lose the whole run.
    check_output_files(json_out=args.json_out, markdown_out=args.markdown_out)
    options = FleetBenchOptions(
        model=args.model, demo_target=args.demo_target, demo_draft=args.demo_draft, new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens, rounds=args.rounds, warmup_rounds=args.warmup_rounds,
        threads_per_pc=args.threads_per_pc,
        max_pcs=args.pcs, controller_cores=args.controller_cores, genai_model=args.genai_model,
        genai_python=args.genai_python, drafting_kv_cache=args.kv_cache, fixed_ks=tuple(args.fixed_k),
        drafters=tuple(args.drafters), wan=args.wan, carry_k=args.carry_k,
        wan_delay_s=args.wan_delay_ms / 1000.0,
        wan_bandwidth_bytes_s=args.wan_bandwidth_mbit * 125_000 if args.wan_bandwidth_mbit is not None else None)
    # the JSON first, whole: a file that cannot be written then loses nothing
    outputs = _AfterTheJson(args.json_out, args.markdown_out)
    return run_bench("fleet", lambda: run_fleet_bench(options, progress=lambda text: print(text, file=sys.stderr,
                                                                                            flush=True)),
                     lambda report: print(json.dumps(report, indent=2), flush=True),
                     then=outputs.write, then_what=outputs.left,
                     cleaned_up="; its simulated PCs are stopped and its temporary folder removed")


@dataclass
class _AfterTheJson:
    """What `bench fleet` writes once its JSON is out, in order, and what a signal kept it from (`left`)."""

    json_out: Path | None
    markdown_out: Path | None
    done: int = 0  # of the steps below

    def steps(self) -> list[tuple[str, Callable[[dict[str, Any]], None]]]:
        steps: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
            ("the markdown table", lambda report: print(render_markdown(report), file=sys.stderr))]
        if self.json_out is not None:
            steps.append((f"--json-out {self.json_out}", lambda report: write_outputs(report, self.json_out, None)))
        if self.markdown_out is not None:
            steps.append((f"--markdown-out {self.markdown_out}",
                          lambda report: write_outputs(report, None, self.markdown_out)))
        return steps

    def write(self, report: dict[str, Any]) -> None:
        for _, step in self.steps()[self.done:]:
            step(report)
            self.done += 1

    def left(self) -> str:
        return " and ".join(name for name, _ in self.steps()[self.done:])
