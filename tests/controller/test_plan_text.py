"""`fleet plan`'s text (controller/plan_text). Its tables' columns fit their cells in terminal columns: a whole
hostname shows (a long one, a Japanese one), as `fleet ls` shows it and `fleet remove` takes it, and the columns
stay in line. At an office's size: agents left out in a crowd for one reason (300 idle PCs a plan does
not need, a model whose layer fits none of them) show their first few and a count, not a row each (300 PCs
printed ~300 such rows); an infeasible plan's Usable line names a dozen and sums the rest; a reason shared by
few agents still lists them by name."""

from __future__ import annotations

from deskfleet.common.agent_state import AgentState
from deskfleet.common.planner import (
    RENDER_CROWD,
    RENDER_CROWD_SHOWN,
    RENDER_USABLE,
    AgentCandidate,
    ExclusionReason,
    ModelFootprint,
    plan,
)
from deskfleet.controller.plan_text import render_plan
from deskfleet.controller.text_table import display_width

GB = 10**9


def office(count: int, memory: int = 16 * GB) -> list[AgentCandidate]:
    agents = [AgentCandidate(f"{index:04d}".translate(str.maketrans("0123456789", "abcdefghij")) + "a" * 48,
                             AgentState.AVAILABLE, memory, 10.0, hostname=f"pc-{index}")
              for index in range(count)]
    agents.append(AgentCandidate("p" * 52, AgentState.PAUSED, memory, 10.0, hostname="pc-paused"))
    return agents


def test_agents_a_plan_does_not_need_are_counted_not_listed() -> None:
    result = plan(ModelFootprint.uniform("small", 8, GB, GB, GB, 0, 1024), office(300))
    unused = [e for e in result.exclusions if e.reason is ExclusionReason.NOT_NEEDED]
    assert result.feasible and len(unused) > RENDER_CROWD
    text = render_plan(result)
    assert f"and {len(unused) - RENDER_CROWD_SHOWN} more agents left out as not needed" in text
    assert "pc-paused" in text  # another reason: still named
    assert len(text.splitlines()) < 20


def test_a_few_unneeded_agents_are_still_listed_by_name() -> None:
    result = plan(ModelFootprint.uniform("small", 8, GB, GB, GB, 0, 1024), office(4))
    text = render_plan(result)
    assert "more agents left out" not in text
    assert sum("pc-" in line for line in text.splitlines()) >= 4


def test_a_layer_that_fits_no_pc_is_one_count_not_300_rows() -> None:
    result = plan(ModelFootprint.uniform("huge", 80, 20 * GB, GB, GB, 0, 1024), office(300))
    text = render_plan(result)
    assert not result.feasible and "more agents left out as too little memory" in text
    assert len(text.splitlines()) < 20


def test_an_infeasible_plans_usable_line_names_a_dozen_and_sums_the_rest() -> None:
    result = plan(ModelFootprint.uniform("70b", 80, GB, GB, GB, 0, 1024), office(20, memory=4 * GB))
    assert not result.feasible and len(result.usable) > RENDER_USABLE
    usable = next(line for line in render_plan(result).splitlines() if line.startswith("Usable: "))
    assert f"and {len(result.usable) - RENDER_USABLE} more (" in usable and usable.count(" GB") == RENDER_USABLE + 1


def _column_starts(line: str, cells: list[str]) -> list[int]:
    """The terminal column each of `cells` starts at in `line`, found left to right."""
    starts, position = [], 0
    for cell in cells:
        position = line.index(cell, position)
        starts.append(display_width(line[:position]))
        position += len(cell)
    return starts


def test_whole_hostnames_show_and_the_stage_columns_stay_in_line() -> None:
    names = ["finance-laptop-0042.corp.example", "経理部のパソコン", "pc-2"]
    agents = [AgentCandidate(chr(ord("a") + index) * 52, AgentState.AVAILABLE, 3 * GB, 10.0, hostname=name)
              for index, name in enumerate(names)]
    result = plan(ModelFootprint.uniform("m", 12, GB // 2, GB // 4, GB // 4, 0, 256), agents)
    assert result.feasible and len(result.stages) >= 2, render_plan(result)
    lines = render_plan(result).splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    rows = [line for line in lines if line.startswith("  ") and line.strip()[:1].isdigit()]
    assert len(rows) == len(result.stages)
    columns = _column_starts(header, ["agent", "host", "layers", "extras"])
    for stage, row in zip(result.stages, rows, strict=True):
        cells = [stage.agent_id[:12], stage.hostname, f"[{stage.first_layer}:{stage.stop_layer}]"]
        assert _column_starts(row, cells) == columns[:3], "\n".join(lines)
        assert display_width(row) == display_width(header), "\n".join(lines)  # right-aligned figures end alike
    shown = {stage.hostname for stage in result.stages}
    assert {"finance-laptop-0042.corp.example", "経理部のパソコン"} & shown, "\n".join(lines)


def test_the_agents_left_out_for_different_reasons_share_one_table() -> None:
    agents = office(12)
    agents.append(AgentCandidate("q" * 52, AgentState.PAUSED, GB, 10.0, hostname="reception-desk-pc-with-a-long-name"))
    result = plan(ModelFootprint.uniform("small", 8, GB, GB, GB, 0, 1024), agents)
    lines = render_plan(result).splitlines()
    left_out = lines[lines.index("Left out:") + 1:]
    rows = [line for line in left_out if not line.lstrip().startswith("and ")]
    assert any("reception-desk-pc-with-a-long-name" in row for row in rows), "\n".join(lines)
    messages = {display_width(row[:row.index(reason)]) for row in rows
                for reason in ("paused (", "not needed:") if reason in row}
    assert len(messages) == 1, "\n".join(lines)  # every why in one column, whatever the hostname's length
    more = next(index for index, line in enumerate(left_out) if "more agents left out as not needed" in line)
    assert all("not needed" in line for line in left_out[more - RENDER_CROWD_SHOWN:more])  # after its crowd
