"""The console scripts' entry points: a Ctrl-C while a command's modules import ends it with 130, quietly."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

from deskfleet.common import launch


def test_a_ctrl_c_while_the_command_imports_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(name: str) -> types.ModuleType:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert launch.deskfleet() == 130
    assert launch.deskfleet_agent() == 130


@pytest.mark.parametrize(("entry", "module"), [(launch.deskfleet, "deskfleet.controller.cli"),
                                               (launch.deskfleet_agent, "deskfleet.agent.cli")])
def test_each_entry_runs_its_commands_main(monkeypatch: pytest.MonkeyPatch, entry: object, module: str) -> None:
    monkeypatch.setattr(importlib.import_module(module), "main", lambda: 7)
    assert callable(entry) and entry() == 7


def test_launching_imports_nothing_heavy() -> None:
    code = "import sys, deskfleet.common.launch; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('openvino', 'numpy', 'websockets', 'cryptography')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
