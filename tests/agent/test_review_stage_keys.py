"""Every model id gets a stage key the shard cache takes, one of its own: a model named in any script or
starting with a dot is hosted, and two models whose ids share a long start (two exports of a checkpoint
whose folder name is 80 characters or more: the ids differ only in the manifest digest at their end) are
hosted side by side on one agent, neither one's assignment taking the other's pin or view."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from deskfleet.agent.core import AgentCore
from deskfleet.common.wire import AssignStage, ReleaseStage, Role, StageReady
from tests.agent.test_core import _host_tiny_stage, handle
from tests.agent.test_core import core as agent  # noqa: F401 (a fixture)

CHECKPOINT = "Some-Organisation_Meta-Llama-3.1-8B-Instruct-abliterated-uncensored-distilled-v2-128k"  # 84 characters


def _as_model(assignment: AssignStage, model_id: str) -> AssignStage:
    return replace(assignment, stage=replace(assignment.stage, model_id=model_id))


def _evicts_nothing_of(core: AgentCore, assignment: AssignStage) -> bool:
    core.cache.evict(0)
    return all(core.cache.has(entry.sha256) for entry in assignment.manifest)


def test_two_models_with_a_long_common_name_keep_their_own_pins_and_views(agent: AgentCore,  # noqa: F811
                                                                          tiny_export: Path) -> None:
    pushed = _host_tiny_stage(agent, tiny_export)
    handle(agent, Role.CONTROLLER, ReleaseStage(pushed.stage))
    int4, int8 = _as_model(pushed, f"{CHECKPOINT}@0123456789ab"), _as_model(pushed, f"{CHECKPOINT}@ba9876543210")
    for assignment in (int4, int8):
        assert isinstance(handle(agent, Role.CONTROLLER, assignment), StageReady)
    keys = {hosted.cache_key for hosted in agent.stages.values()}
    assert len(keys) == 2 and set(agent.cache._pins) == keys
    assert all((agent.cache.root / "views" / key).is_dir() for key in keys)
    handle(agent, Role.CONTROLLER, ReleaseStage(int8.stage))
    assert set(agent.cache._pins) == {agent.stages[int4.stage].cache_key}  # int4's files are still pinned
    assert _evicts_nothing_of(agent, int4)


def test_a_model_named_in_any_script_or_starting_with_a_dot_is_hosted(agent: AgentCore,  # noqa: F811
                                                                      tiny_export: Path) -> None:
    pushed = _host_tiny_stage(agent, tiny_export)
    for model_id in ("Qwen2.5-中文-Chat@0123456789ab", "Модель@0123456789ab", ".hidden..checkpoint@0123456789ab"):
        assert isinstance(handle(agent, Role.CONTROLLER, _as_model(pushed, model_id)), StageReady)
    assert len(agent.stages) == 4
