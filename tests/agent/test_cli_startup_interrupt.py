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


def test_a_ctrl_c_that_openvino_wraps_in_its_import_error_exits_130(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: object) -> None:
    # OpenVINO's package turns a KeyboardInterrupt in its import into `ImportError: initialization failed`
    from deskfleet.agent import cli

    def wrapped(*args: object) -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as error:
            raise ImportError("initialization failed") from error

    monkeypatch.setattr(cli, "_refuse_controller_dir", wrapped)
    assert main(["--headless", "--data-dir", str(tmp_path)]) == 130
