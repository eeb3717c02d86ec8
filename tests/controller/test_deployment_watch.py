"""DeploymentWatch: a running chain's look whether the model's deployment on record still places its stages."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.controller import fleet_deploy
from deskfleet.controller.fleet_deploy import DeploymentWatch, DeployReport, DeploySettings, model_id_of
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_rejoin import ADMINS, WITHOUT_B


def _save(store: FleetStore, model: Path, stages: tuple[fleet_deploy.StagePlacement, ...],
          model_id: str | None = None) -> None:
    report = DeployReport(model_id or model_id_of(model), stages, {}, {})
    fleet_deploy._save_deployment(store, model, report, DeploySettings())


def test_a_watch_says_replaced_once_the_record_places_other_stages(store: FleetStore, tiny_export: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_deploy, "DEPLOYMENT_WATCH_S", 0.0)
    _save(store, tiny_export, ADMINS)
    watch = DeploymentWatch(store, tiny_export, ADMINS)
    assert not watch()
    _save(store, tiny_export, ADMINS)  # deployed again as it was (a second `fleet deploy`): the chain is whole
    assert not watch()
    _save(store, tiny_export, WITHOUT_B)
    assert watch()
    assert watch() is False  # said once per change of the file: the chain it was said to has failed


def test_another_models_deploy_or_a_record_that_cannot_be_read_is_no_replacement(
        store: FleetStore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_deploy, "DEPLOYMENT_WATCH_S", 0.0)
    watch = DeploymentWatch(store, tiny_export, ADMINS)
    assert not watch()  # nothing on record yet
    _save(store, tiny_export, ADMINS)
    deployments = store.read("deployments", {})
    deployments["other@model"] = {"stages": "whatever"}  # another model deployed
    store.write("deployments", deployments)
    assert not watch()
    store.write("deployments", [])  # damaged: the chain's own steps tell
    assert not watch()


def test_a_watch_looks_at_the_file_at_most_every_so_often(store: FleetStore, tiny_export: Path) -> None:
    # a decode step asks at every token: a stat per token is nothing, a read per token would be
    clock = [100.0]
    _save(store, tiny_export, ADMINS)
    watch = DeploymentWatch(store, tiny_export, ADMINS, clock=lambda: clock[0])
    assert not watch()
    _save(store, tiny_export, WITHOUT_B)
    clock[0] += fleet_deploy.DEPLOYMENT_WATCH_S / 2
    assert not watch()  # not looked yet
    clock[0] += fleet_deploy.DEPLOYMENT_WATCH_S
    assert watch()
