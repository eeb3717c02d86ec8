"""A deploy or a failover over PCs that run a release of another fleet protocol: they were told to start the agent
they were running, or "bring the lost PC back"; they are told to upgrade."""

from __future__ import annotations

from deskfleet.common.planner import ExclusionReason, ModelFootprint, PlanOptions
from deskfleet.controller.fleet_deploy import plan_survey
from deskfleet.controller.fleet_failover import _remedy
from deskfleet.controller.fleet_survey import AgentView, Survey


def test_a_surveyed_pc_of_another_protocol_is_left_out_as_such() -> None:
    old = AgentView("o" * 52, "pc-old", "10.0.0.8:7431", ("registration",), None,
                    "agent oooooooooooo at 10.0.0.8:7431 speaks fleet protocol 7 (deskfleet 0.1.0), this controller 8 "
                    "(deskfleet 0.8.0): upgrade deskfleet on agent oooooooooooo", version="0.1.0", other_protocol=7)
    off = AgentView("f" * 52, "pc-off", "10.0.0.9:7431", ("registration",), None, "cannot reach 10.0.0.9:7431")
    model = ModelFootprint.uniform("m", 4, 1 << 20, 0, 0, kv_bytes_per_token_per_layer=0, context=64)
    result = plan_survey(model, Survey([old, off], {}), PlanOptions())
    reasons = {exclusion.agent_id: (exclusion.reason, exclusion.message) for exclusion in result.exclusions}
    assert reasons["o" * 52][0] is ExclusionReason.OTHER_PROTOCOL
    assert reasons["o" * 52][1].startswith("agent oooooooooooo at 10.0.0.8:7431 speaks fleet protocol 7")
    assert reasons["f" * 52][0] is ExclusionReason.UNREACHABLE
    (problem,) = result.problems
    assert problem.endswith("start `deskfleet-agent --headless` on them; upgrade deskfleet where one speaks another "
                            "fleet protocol, as its message says")


def test_a_failover_that_found_no_chain_says_to_upgrade_the_pcs_of_another_protocol() -> None:
    said = _remedy(True, frozenset({ExclusionReason.OTHER_PROTOCOL}))
    assert said == ("upgrade deskfleet where a PC speaks another fleet protocol (the reason says on which side), bring "
                    "the lost PC back, or join more PCs")
    assert "upgrade" not in _remedy(True, frozenset({ExclusionReason.UNREACHABLE}))
