"""Fixtures shared by the controller tests: the engine tests' models (built once per session by the checkpoint
and export factories), a fleet's controller data dir, and the fleet window's office of real agents."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import shiboken6
from PySide6.QtWidgets import QApplication

from deskfleet.agent import service as agent_service
from deskfleet.agent.link import utc_now
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_window import FleetWindow, FleetWindowOptions
from tests.controller.windows import Office, Opener


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


# The windows' (tests/controller/windows.py, test_chat_window.py, test_fleet_window.py)

@pytest.fixture(scope="module")
def app() -> QApplication:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # no display here: Qt's xcb plugin would abort the process
    existing = QApplication.instance()
    return existing if isinstance(existing, QApplication) else QApplication([])


@pytest.fixture
def open_window(app: QApplication) -> Iterator[Opener]:
    """Opens fleet windows, each closed and deleted after the test: a window that a failed test's traceback keeps
    would otherwise be deleted at the interpreter's exit, after the QApplication, which crashes the process."""
    opened: list[FleetWindow] = []

    def open_one(store: FleetStore, options: FleetWindowOptions) -> FleetWindow:
        window = FleetWindow(store, options)
        opened.append(window)
        return window

    yield open_one
    for window in opened:
        window.close()
        shiboken6.delete(window)


@pytest.fixture
def office(tmp_path: Path) -> Iterator[Office]:
    with Office(tmp_path) as running:
        yield running
