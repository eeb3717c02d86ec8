"""A Ctrl-C while deskfleet-agent imports what its commands need (numpy, asyncio) ends it with 130, quietly."""

from __future__ import annotations

import sys
import types

import pytest

from deskfleet.agent.cli import main


class Interrupting(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        raise KeyboardInterrupt


def test_a_ctrl_c_while_the_agent_imports_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deskfleet.agent.enroll", Interrupting("deskfleet.agent.enroll"))
    assert main(["--headless"]) == 130
