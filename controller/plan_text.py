"""A plan as text, for `deskfleet fleet plan` and `fleet deploy`: the stages' table, or why no split fits, and the
agents left out and why. The tables' columns are as wide as their cells, in terminal columns
(controller/text_table), so a whole hostname shows, as `fleet ls` shows it and `fleet remove` takes it."""

from __future__ import annotations

from deskfleet.common.planner import (
    RENDER_CROWD,
    RENDER_CROWD_SHOWN,
    RENDER_USABLE,
    Exclusion,
    Plan,
    in_gb,
    kv_cache_note,
    share_of_slowest,
    short_agent_id,
)
from deskfleet.controller.text_table import format_table

INDENT = "  "
STAGE_HEADER = ("#", "agent", "host", "layers", "extras", "weights", "KV", "total", "usable", "rel.time")
STAGE_NUMBERS = frozenset({0, 5, 6, 7, 8, 9})  # the columns right-aligned


def render_plan(result: Plan) -> str:
    """The plan as text. Agents are shown as `fleet ls` shows them (the id's first 12 characters and the hostname),
    layers as the half-open [start:stop] that `fleet ls` and the chain's messages use."""
    model = result.model
    lines = [f"Model {model.name}: {model.num_layers} layers, "
             f"{in_gb(sum(model.layer_bytes) + model.embed_bytes + model.head_bytes)} of weights, "
             f"context {model.context} (policy: {result.policy.value.replace('_', ' ')})"]
    if result.feasible:
        lines.append(f"{len(result.stages)} stage(s):")
        scratch = sorted({stage.prefill_bytes for stage in result.stages})
        if model.resident_factor != 1.0 or model.kv_growth != 1.0 or model.kv_precision or any(scratch):
            held = (f"the weights x{model.resident_factor:g} as held"
                    if model.resident_factor != 1.0 else "the weights")
            prefill = (f" + prefill scratch {' / '.join(in_gb(size) for size in scratch)} ({model.context} tokens "
                       f"x {result.streams} stream(s))" if any(scratch) else "")
            lines.append(f"{INDENT}(total: {held} + KV{kv_cache_note(model)}{prefill} + runtime)")
        lines.extend(INDENT + line for line in format_table(_stage_rows(result), STAGE_NUMBERS))
    else:
        lines.append("Infeasible:")
        lines.extend(f"{INDENT}- {problem}" for problem in result.problems)
        if result.usable:
            shown = ", ".join(f"{short_agent_id(agent)} {in_gb(size)}"
                              for agent, size in result.usable[:RENDER_USABLE])
            rest = result.usable[RENDER_USABLE:]
            if rest:
                shown += f", and {len(rest)} more ({in_gb(sum(size for _, size in rest))} in all)"
            lines.append("Usable: " + shown)
    if result.exclusions:
        lines.append("Left out:")
        lines.extend(_left_out_lines(result.exclusions))
    return "\n".join(lines)


def _stage_rows(result: Plan) -> list[tuple[str, ...]]:
    slowest = max(stage.relative_time for stage in result.stages)
    rows: list[tuple[str, ...]] = [STAGE_HEADER]
    for index, stage in enumerate(result.stages):
        extras = "+".join(name for name, on in (("embed", stage.has_embed), ("head", stage.has_head)) if on)
        rows.append((str(index), short_agent_id(stage.agent_id), stage.hostname or "-",
                     f"[{stage.first_layer}:{stage.stop_layer}]", extras or "-", in_gb(stage.weight_bytes),
                     in_gb(stage.kv_bytes), in_gb(stage.memory_bytes), in_gb(stage.usable_bytes),
                     f"{share_of_slowest(stage.relative_time, slowest):.2f}"))
    return rows


def _left_out_lines(exclusions: tuple[Exclusion, ...]) -> list[str]:
    """One line per agent left out (id, hostname, why), in one table; an office's PCs are left out in crowds for
    one reason (300 idle PCs that a plan does not need, a model whose layer fits none of them): a crowd shows its
    first few, then a count."""
    crowds = []
    for reason in dict.fromkeys(e.reason for e in exclusions):
        crowd = [e for e in exclusions if e.reason is reason]
        crowds.append((crowd, crowd if len(crowd) <= RENDER_CROWD else crowd[:RENDER_CROWD_SHOWN]))
    listed = [e for _, shown in crowds for e in shown]
    table = iter(format_table([(short_agent_id(e.agent_id), e.hostname or "-", e.message) for e in listed]))
    lines: list[str] = []
    for crowd, shown in crowds:
        lines.extend(INDENT + next(table) for _ in shown)
        if len(shown) < len(crowd):
            lines.append(f"{INDENT}and {len(crowd) - len(shown)} more agents left out as "
                         f"{crowd[0].reason.value.replace('_', ' ')} (`--json` lists each and why)")
    return lines
