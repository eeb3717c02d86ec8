"""`fleet ls` at an office's size: 300 rows in agent-id order, with nothing after them, meant reading every row
to find one PC or to see how many were off. The rows are grouped by state (serving first, unreachable last),
by hostname within each, and a line counts each state."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from deskfleet.common.agent_state import AgentState
from deskfleet.controller.fleet_cli import _print_agents


def agent(agent_id: str, hostname: str, state: AgentState | None) -> SimpleNamespace:
    report = SimpleNamespace(state=state, free_memory_bytes=8 << 30, cpu_load=0.0, igpu_busy=None, temperature_c=None,
                             battery_percent=None, on_ac_power=None, weight_gb_per_s=None,
                             shard_room_bytes=None, clock_s=None, stages=(), reasons=(), detail="", ip_families=()) \
        if state is not None else None
    return SimpleNamespace(agent_id=agent_id, hostname=hostname, address="10.0.0.1:7431", sources=("registration",),
                           report=report, problem=None if state else "cannot reach 10.0.0.1:7431: timed out")


def test_300_rows_are_grouped_by_state_and_hostname_and_counted(capsys: pytest.CaptureFixture[str]) -> None:
    generator = random.Random(3)
    states = [AgentState.AVAILABLE] * 200 + [AgentState.SERVING] * 5 + [AgentState.PAUSED] * 3 + \
        [AgentState.UNAVAILABLE] * 12 + [None] * 80
    agents = [agent("".join(generator.choice("abcdefghijklmnopqrstuvwxyz234567") for _ in range(52)),
                    f"desk-{index:03d}", state) for index, state in enumerate(states)]
    agents.sort(key=lambda row: row.agent_id)  # the survey's order
    _print_agents(agents)
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[1:-1]]
    assert len(rows) == 300
    listed = [(row[3], row[1]) for row in rows]
    rank = {"serving": 0, "available": 1, "paused": 2, "unavailable": 3, "unreachable": 4}
    assert listed == sorted(listed, key=lambda pair: (rank[pair[0]], pair[1]))
    assert lines[-1] == "300 agent(s): 5 serving, 200 available, 3 paused, 12 unavailable, 80 unreachable"


def test_a_paused_row_says_who_paused_it(capsys: pytest.CaptureFixture[str]) -> None:
    paused = agent("a" * 52, "desk-001", AgentState.PAUSED)
    paused.report.detail = "paused by its user, until `deskfleet-agent resume`"  # no limit crossed: no reasons
    _print_agents([paused])
    assert capsys.readouterr().out.splitlines()[1].endswith("(paused by its user, until `deskfleet-agent resume`)")


def test_the_json_lists_the_agents_in_the_tables_order(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # the docs said `--json` keeps the table's order; it kept the survey's
    import json

    from deskfleet.controller.cli import main

    agents = [agent("c" * 52, "desk-b", None), agent("a" * 52, "desk-c", AgentState.SERVING),
              agent("b" * 52, "desk-a", AgentState.PAUSED), agent("d" * 52, "desk-a", AgentState.SERVING)]
    for row in agents:
        row.certificate_expires, row.report = None, row.report and SimpleNamespace(
            **vars(row.report), devices=(), last_error=None)

    data = _initialised_with_survey(tmp_path, monkeypatch, agents)
    capsys.readouterr()
    assert main(["fleet", "ls", "--discover-seconds", "0", "--json", *data]) == 0
    listed = [(row["state"], row["hostname"]) for row in json.loads(capsys.readouterr().out)]
    assert listed == [("serving", "desk-a"), ("serving", "desk-c"), ("paused", "desk-a"), (None, "desk-b")]


def test_a_deployed_stage_its_pc_no_longer_hosts_is_noted(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # every agent restarted: each listed no stage, and nothing said the deployed model ran on none of them
    from pathlib import Path

    from deskfleet.common.wire import StageRef
    from deskfleet.controller.cli import main
    from deskfleet.controller.fleet_store import FleetStore

    kept, restarted, off = agent("a" * 52, "desk-a", AgentState.SERVING), \
        agent("b" * 52, "desk-b", AgentState.AVAILABLE), agent("c" * 52, "desk-c", None)
    paused = agent("e" * 52, "desk-e", AgentState.PAUSED)  # gave its stage up: its state says so, no note
    kept.report.stages = (StageRef("m@1", 0, 2),)
    agents = [kept, restarted, off, paused]
    for row in agents:
        row.certificate_expires = None

    data = _initialised_with_survey(tmp_path, monkeypatch, agents)
    FleetStore(Path(str(tmp_path)) / "ctl").write("deployments", {"m@1": {"stages": [
        {"agent_id": row.agent_id, "address": "10.0.0.1:7431", "layer_start": start, "layer_end": start + 2}
        for row, start in ((kept, 0), (restarted, 2), (off, 4), (paused, 6))]}})
    capsys.readouterr()
    assert main(["fleet", "ls", "--discover-seconds", "0", *data]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: m@1")]
    assert len(notes) == 1 and "has 1 deployed stage(s) that the PC it was assigned to no longer hosts ([2:4] on " \
        in notes[0] and "desk-b" in notes[0]  # not the one that hosts its stage, nor the one that did not answer
    assert "a run on the model that starts after such a PC called in" in notes[0] and "desk-e" not in notes[0]


def test_the_columns_line_up_past_a_long_address_or_hostname(capsys: pytest.CaptureFixture[str]) -> None:
    # fixed widths: an IPv6 address (over 22 characters) pushed the rest of its row right, and a hostname was cut
    # to 16 characters, so the name that `fleet remove` takes was not on the screen
    wide = agent("a" * 52, "経理部-desk-0123456789", None)
    wide.address = "[fd00:1234:5678:9abc::42]:7431"
    rows = [wide, agent("b" * 52, "desk-1", AgentState.AVAILABLE), agent("c" * 52, "d", AgentState.SERVING)]
    _print_agents(rows)
    lines = capsys.readouterr().out.splitlines()[:4]
    assert "経理部-desk-0123456789" in lines[3]
    for header, cells in (("address", ["10.0.0.1:7431", "10.0.0.1:7431", wide.address]),
                          ("state", ["serving", "available", "unreachable"]),
                          ("version", ["-", "-", "-"]), ("stages", ["-", "-", "cannot reach"])):
        start = lines[0].index(header)
        assert [on_screen(line)[start:start + len(cell)] for line, cell in zip(lines[1:], cells, strict=True)] \
            == cells, header


def on_screen(line: str) -> str:
    """The line as a terminal draws it, a wide character followed by a filler, so an index is a column."""
    from deskfleet.controller.text_table import display_width

    return "".join(char + "\0" * (display_width(char) - 1) for char in line)


def _initialised_with_survey(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                             agents: list[SimpleNamespace]) -> list[str]:
    """A controller data dir made by `fleet init` under tmp_path, whose survey finds `agents`; its --data-dir."""
    from pathlib import Path

    from deskfleet.controller import fleet_survey
    from deskfleet.controller.cli import main

    async def survey(*args: object, **kwargs: object) -> SimpleNamespace:
        async def close() -> None:
            pass
        return SimpleNamespace(agents=agents, close=close)

    monkeypatch.setattr(fleet_survey, "survey", survey)
    data = ["--data-dir", str(Path(str(tmp_path)) / "ctl")]
    assert main(["fleet", "init", "--address", "127.0.0.1:1", *data]) == 0
    return data
