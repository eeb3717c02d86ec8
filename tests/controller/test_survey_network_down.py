"""A controller whose own network drops: its run's re-plan surveys again for a while instead of ending, and a plan
over PCs that are all unreachable for want of a route says to check this PC's network (from an exploratory test of
laptops that sleep and networks that drop: a 20 s drop on the controller ended `generate --fleet` after 184 of 700
tokens, with failovers to spare, telling the user to start agents that were running)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deskfleet.common.planner import Exclusion, ExclusionReason, ModelFootprint, plan
from deskfleet.controller import fleet_survey
from deskfleet.controller.fleet_survey import (
    NEVER_REGISTERED,
    NO_ADDRESS,
    AgentView,
    Survey,
    SurveyOptions,
    network_down,
    survey_through_outage,
)

NO_ROUTE = "cannot reach 10.0.0.{}:7431: [Errno 113] No route to host"
NO_NETWORK = "cannot reach 10.0.0.{}:7431: [Errno 101] Network is unreachable"


def unreachable(problems: list[str], never_called_in: bool = False) -> Survey:
    agents = [AgentView(chr(ord("a") + index) * 52, f"pc-{index}", f"10.0.0.{index}:7431", ("registration",), None,
                        problem.format(index)) for index, problem in enumerate(problems)]
    if never_called_in:
        agents.append(AgentView("z" * 52, "pc-new", NO_ADDRESS, ("roster",), None, NEVER_REGISTERED))
    return Survey(agents, {})


def test_network_down_is_every_pc_dialled_failing_for_want_of_a_route() -> None:
    assert network_down(unreachable([NO_ROUTE, NO_NETWORK], never_called_in=True))
    assert not network_down(unreachable([NO_ROUTE, "cannot reach 10.0.0.{}:7431: [Errno 111] Connection refused"]))
    assert not network_down(unreachable([]))
    answered = unreachable([NO_ROUTE])
    answered.agents.append(AgentView("y" * 52, "pc-up", "10.0.0.9:7431", ("registration",),
                                     SimpleNamespace(), None))  # type: ignore[arg-type]
    answered.links["y" * 52] = SimpleNamespace()  # type: ignore[assignment]
    assert not network_down(answered)


def test_a_re_plans_survey_waits_out_a_short_outage_of_this_pcs_network(monkeypatch: pytest.MonkeyPatch) -> None:
    surveys = [unreachable([NO_ROUTE, NO_ROUTE]), unreachable([NO_NETWORK, NO_ROUTE]), unreachable(["fine"])]
    told: list[str] = []

    async def survey(store: object, options: SurveyOptions) -> Survey:
        return surveys.pop(0)

    found = asyncio.run(survey_through_outage(Any, SurveyOptions(), told.append, wait_s=5.0, retry_s=0.01,
                                              surveyor=survey))
    assert not surveys and found.agents[0].problem == "fine"  # the third survey's
    assert told == ["no PC answers, each for want of a route or a network: this PC's network may be down; looking "
                    "again every 0 s for up to 5 s"]
    # an outage that outlasts the wait: the last survey goes to the plan, which says what to check
    monkeypatch.setattr(fleet_survey, "survey", lambda store, options: asyncio.sleep(0, unreachable([NO_ROUTE])))
    assert network_down(asyncio.run(survey_through_outage(Path(), SurveyOptions(), told.append, wait_s=0.05,
                                                          retry_s=0.01)))  # survey() by default


def test_a_plan_over_pcs_no_route_reaches_says_to_check_this_pcs_network() -> None:
    model = ModelFootprint.uniform("toy", 4, 10**9, 0, 0, 0, 16)
    lost = [Exclusion(f"{letter * 52}", ExclusionReason.UNREACHABLE, f"unreachable at 10.0.0.{index}:7431: "
                      + NO_ROUTE.format(index)) for index, letter in enumerate("ab")]
    (problem,) = plan(model, [], unreachable=lost).problems
    assert "check this PC's own network: every PC is unreachable from it for want of a route or a network" in problem
    assert "start `deskfleet-agent" not in problem
    refused = [*lost, Exclusion("c" * 52, ExclusionReason.UNREACHABLE, "unreachable at 10.0.0.3:7431: cannot reach "
                                "10.0.0.3:7431: [Errno 111] Connection refused")]
    assert "start `deskfleet-agent --headless` on them" in plan(model, [], unreachable=refused).problems[0]
