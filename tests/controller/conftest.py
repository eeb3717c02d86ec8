"""Fixtures shared by the controller tests: the engine tests' models (built once per session by the checkpoint
and export factories) and a fleet's controller data dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.agent import service as agent_service
from deskfleet.agent.link import utc_now
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_store import FleetStore


@pytest.fixture
def store(tmp_path: Path) -> FleetStore:
    """A controller data dir with a fleet made in it (its addresses a placeholder: 127.0.0.1:1)."""
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    return store


@pytest.fixture(scope="module")
def target(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> Path:
    """A 4-layer random llama in f32: the engine's target."""
    return export_factory(checkpoint_factory("engine-target", num_hidden_layers=4), "f32")


@pytest.fixture(scope="module")
def other_draft(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> Path:
    """An unrelated one-layer model: it proposes mostly wrong tokens, so most rounds roll back."""
    return export_factory(checkpoint_factory("engine-draft", num_hidden_layers=1), "f32")


@pytest.fixture(scope="module")
def near_draft(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path],
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on every weight: its distributions overlap the target's but differ."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    source = checkpoint_factory("engine-target", num_hidden_layers=4)
    out = tmp_path_factory.mktemp("near-draft")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return export_factory(out, "f32")


@pytest.fixture
def no_controller_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents look for a moved controller over mDNS in vain (nothing is announced in these tests)."""
    async def nowhere(fleet_id: str, controller_id: str, interfaces: list[str]) -> list[str]:
        return []

    monkeypatch.setattr(agent_service, "find_controller", nowhere)
