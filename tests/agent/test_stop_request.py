"""Stopping the agent through its state folder (agent/stop_request.py, `deskfleet-agent stop`): how an agent with no
console, started by Windows' autostart, is stopped as Ctrl-C would stop it. A real agent process is stopped here, and a
request left for another process stops none."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deskfleet.agent.autostart import agent_running_pid, wait_for_agent
from deskfleet.agent.cli import main
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.stop_request import (
    STOP_REQUEST_FILE,
    clear_stop_request,
    process_ended,
    request_stop,
    requested_pid,
    stop_agent,
)
from tests.agent.test_autostart_linux import joined_data_dir


def test_a_request_names_its_agent_and_a_damaged_one_stops_none(tmp_path: Path) -> None:
    assert requested_pid(tmp_path) is None
    request_stop(tmp_path, 4242)
    assert requested_pid(tmp_path) == 4242
    clear_stop_request(tmp_path)
    assert requested_pid(tmp_path) is None
    for damaged in ("{not json", '{"pid": "4242"}', '{"pid": true}', '{"pid": -1}', "[4242]"):
        (tmp_path / STOP_REQUEST_FILE).write_text(damaged)
        assert requested_pid(tmp_path) is None, damaged


def test_a_request_not_taken_within_the_wait_is_taken_back(tmp_path: Path) -> None:
    assert not stop_agent(tmp_path, 4242, timeout=0.3, ended=lambda pid: False)
    assert requested_pid(tmp_path) is None  # a later agent of that pid must not find it
    assert stop_agent(tmp_path, 4242, timeout=0.3, ended=lambda pid: True)


def test_an_ended_process_is_one_that_is_gone_or_a_zombie() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not process_ended(child.pid):  # a zombie until waited for: ended all the same
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.wait()
    assert process_ended(child.pid)


@pytest.mark.slow
def test_deskfleet_agent_stop_stops_a_running_agent_as_ctrl_c_would(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = joined_data_dir(tmp_path / "agent")
    state_dir = AgentPaths.resolve(data_dir).state_dir
    request_stop(state_dir, 1)  # left for an agent that ran before: the next one clears it, and runs
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "deskfleet.agent", "--log-file", str(log), "--headless",
                              "--data-dir", str(data_dir)])
    try:
        pid = wait_for_agent(state_dir, lambda: agent.poll() is not None)
        assert pid == agent.pid, log.read_text()
        assert requested_pid(state_dir) is None  # the stale request cleared, and this agent left running
        capsys.readouterr()
        assert main(["stop", "--data-dir", str(data_dir)]) == 0
        assert capsys.readouterr().out.startswith(f"stopped the agent (pid {agent.pid}); autostart")
        assert agent.wait(30) == 0  # its own end, not a signal's
        said = log.read_text()
        assert "stopping: asked to through" in said and re.search(r"agent \w{12} stopped", said), said
        assert agent_running_pid(state_dir) is None and requested_pid(state_dir) is None
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert main(["stop", "--data-dir", str(data_dir)]) == 0  # none runs: nothing to do, said
    assert capsys.readouterr().out == f"no agent runs on {state_dir}: nothing to stop\n"
