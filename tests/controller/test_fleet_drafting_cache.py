"""A drafted run over the fleet warns when the deployment's KV cache is not f32 (its output can then part from plain
decoding, where a local run switches to f32 for drafting by itself): at the start, and when a re-plan goes on on a
deployment that keeps another cache."""

from __future__ import annotations

import logging
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import pytest

from deskfleet.agent.stage import CompileSettings
from deskfleet.common.planner import PlanPolicy
from deskfleet.common.wire_messages import Precision
from deskfleet.controller import chat, fleet_deploy, fleet_failover, fleet_pipeline
from deskfleet.controller.chat import ChatOptions
from deskfleet.controller.fleet_deploy import DeployError, DeploySettings
from deskfleet.controller.fleet_failover import FleetFailover
from deskfleet.controller.fleet_pipeline import ChainError
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.run import GenerateOptions

MODEL = Path("/models/target-int4")


@pytest.mark.parametrize(("settings", "cache", "kept"), [
    (DeploySettings(), "u8", ""),  # the defaults on a CPU: the fast precision's u8 cache
    (DeploySettings(PlanPolicy.ALL_BY_SPEED, kv_cache="f16", hop_cost=0.0), "f16", " --policy all_by_speed --hop-ms 0"),
    (DeploySettings(kv_cache="f32"), None, ""),
    (DeploySettings(precision=Precision.F32), None, ""),  # exact: f32 compute and cache
    (DeploySettings(device="GPU"), None, ""),  # the device's own cache, not known here: nothing claimed
])
def test_a_drafted_run_is_warned_of_a_deployed_cache_other_than_f32(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, store: FleetStore,
        settings: DeploySettings, cache: str | None, kept: str) -> None:
    monkeypatch.setattr(fleet_deploy, "load_deploy_settings", lambda store, model: settings)
    with caplog.at_level(logging.WARNING):
        FleetFailover(store, MODEL, 1, drafting=True).check_cache()
        FleetFailover(store, MODEL, 1).check_cache()  # a plain run: never told
    if cache is None:
        assert caplog.records == []
    else:
        (record,) = caplog.records
        message = record.getMessage()
        assert f"keep a {cache} KV cache" in message and "drafted output can part from plain decoding" in message
        # a command to paste: this data dir, and the deploy's other options kept (a walk's paste hit the platform's
        # default data dir, and would have re-planned with the default policy)
        assert f"fleet deploy --model {MODEL} --data-dir {store.data_dir}{kept} --kv-cache f32`" in message


def test_an_unreadable_deployment_is_left_to_opening_the_chain(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def unreadable(store: object, model: Path) -> DeploySettings:
        raise DeployError("unreadable settings")

    monkeypatch.setattr(fleet_deploy, "load_deploy_settings", unreadable)
    assert fleet_deploy.inexact_cache_note(object(), MODEL) is None  # type: ignore[arg-type]


class _Failover:
    checked: ClassVar[list[bool]] = []  # the drafting flag of every cache check

    def __init__(self, *args: object, drafting: bool = False, own_network: object = None, **kwargs: object) -> None:
        self.drafting = drafting
        self.model_id: str | None = None  # the run is not counted among those driving the model
        self.own_network = own_network

    def check_cache(self) -> None:
        _Failover.checked.append(self.drafting)

    def rejoin(self) -> None:  # no PC is back: the deployed chain opens
        return None

    def __enter__(self) -> _Failover:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        pass


def _undeployed_fleet(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A fleet whose chain of any model fails to open (never deployed) after the cache check; returns the drafting
    flag of every cache check made (one a run)."""
    _Failover.checked = []
    monkeypatch.setattr(chat, "controller_store", lambda data_dir: object())
    monkeypatch.setattr(fleet_failover, "FleetFailover", _Failover)

    def never_deployed(store: object, model: Path, **options: object) -> object:
        raise ChainError(f"{model} is not deployed")

    monkeypatch.setattr(fleet_pipeline.FleetPipeline, "from_store", staticmethod(never_deployed))
    return _Failover.checked


@pytest.mark.parametrize(("decoding", "warned"), [
    ({"draft": Path("/models/draft-int4")}, True),
    ({"prompt_lookup": True}, True),
    ({}, False),
])
def test_generate_on_the_fleet_checks_the_cache_only_when_it_drafts(
        monkeypatch: pytest.MonkeyPatch, decoding: dict[str, Any], warned: bool) -> None:
    checked = _undeployed_fleet(monkeypatch)
    with pytest.raises(ChainError, match="is not deployed"):
        chat.generate_on_fleet(GenerateOptions(model=MODEL, prompts=["x"], **decoding), None)
    assert checked == [warned]


@pytest.mark.parametrize(("decoding", "warned"), [({"draft": Path("/models/draft-int4")}, True), ({}, False)])
def test_a_chat_on_the_fleet_checks_the_cache_only_when_it_drafts(
        monkeypatch: pytest.MonkeyPatch, decoding: dict[str, Any], warned: bool) -> None:
    checked = _undeployed_fleet(monkeypatch)
    options = ChatOptions(model=MODEL, fleet_dir=Path("/fleet"), **decoding)
    with pytest.raises(ChainError, match="is not deployed"), chat._open_chain(options, CompileSettings()):
        pass
    assert checked == [warned]
