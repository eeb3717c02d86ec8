"""Stopping the agent through its state folder (agent/stop_request.py, `deskfleet-agent stop`): how an agent with no
console, started by Windows' autostart, is stopped as Ctrl-C would stop it. A real agent process is stopped here, and a
request left for another process stops none."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent.autostart import agent_running_pid, wait_for_agent
from deskfleet.agent.cli import main
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.status_file import STATUS_FILE, this_process_started_at
from deskfleet.agent.stop_request import (
    STOP_REQUEST_FILE,
    Outcome,
    StopRequest,
    StopRequestWatch,
    _ended_check,
    clear_stop_request,
    read_stop_request,
    request_stop,
    stop_agent,
)
from deskfleet.common.json_file import JsonFileError
from tests.agent.test_autostart_linux import joined_data_dir

THIS = StopRequest(os.getpid(), this_process_started_at())


def test_a_request_is_for_one_process_its_pid_and_start_and_a_damaged_one_stops_none(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    watch = StopRequestWatch(tmp_path, THIS.pid, THIS.process_started_at)
    assert read_stop_request(tmp_path) is None and not watch.asked()
    request_stop(tmp_path, THIS)
    assert read_stop_request(tmp_path) == THIS and watch.asked()
    # the same pid, another process (a container's PID 1, a pid Windows reused): a request left for it stops none
    request_stop(tmp_path, replace(THIS, process_started_at=THIS.process_started_at - 60))
    assert not watch.asked()
    request_stop(tmp_path, replace(THIS, pid=THIS.pid + 1))
    assert not watch.asked()
    clear_stop_request(tmp_path)
    assert read_stop_request(tmp_path) is None
    for damaged in ("{not json", '{"pid": "4242", "process_started_at": 1.0}', '{"pid": true, "process_started_at": 1}',
                    '{"pid": 4242}', "[4242]"):
        (tmp_path / STOP_REQUEST_FILE).write_text(damaged)
        with pytest.raises(JsonFileError, match=re.escape(STOP_REQUEST_FILE)):
            read_stop_request(tmp_path)
    caplog.clear()
    for _ in range(5):  # looked at every second: said once, not 86,400 times a day
        assert not watch.asked()
    assert len([record for record in caplog.records if "stop-request.json" in record.getMessage()]) == 1


def test_a_request_not_taken_within_the_wait_is_taken_back(tmp_path: Path) -> None:
    assert stop_agent(tmp_path, THIS, timeout=0.3, ended=lambda: False) is Outcome.NOT_TAKEN
    assert read_stop_request(tmp_path) is None  # a later agent must not find it
    assert stop_agent(tmp_path, THIS, timeout=0.3, ended=lambda: True) is Outcome.STOPPED


def test_an_agent_that_took_the_request_but_is_still_closing_is_not_called_hung(tmp_path: Path) -> None:
    taker = threading.Timer(0.2, clear_stop_request, (tmp_path,))  # the agent takes it, then closes for long
    taker.start()
    began = time.monotonic()
    assert stop_agent(tmp_path, THIS, timeout=0.3, grace=0.5, ended=lambda: False) is Outcome.STOPPING
    assert time.monotonic() - began >= 0.8  # it was given the grace
    taker.join()


def test_an_ended_process_is_one_that_is_gone_a_zombie_or_its_pid_reused() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ended = _ended_check(child.pid)
    deadline = time.monotonic() + 30
    while not ended():  # a zombie until waited for: ended all the same
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.wait()
    assert ended() and _ended_check(child.pid)()


def test_stop_cannot_tell_from_a_status_file_it_cannot_read(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = joined_data_dir(tmp_path / "agent")
    state_dir = AgentPaths.resolve(data_dir).state_dir
    (state_dir / STATUS_FILE).write_text("{damaged")
    assert main(["stop", "--data-dir", str(data_dir)]) == 2  # "no agent runs" would be a guess
    assert "cannot tell whether an agent runs on this data dir" in capsys.readouterr().err


@pytest.mark.slow
def test_deskfleet_agent_stop_stops_a_running_agent_as_ctrl_c_would(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = joined_data_dir(tmp_path / "agent")
    state_dir = AgentPaths.resolve(data_dir).state_dir
    request_stop(state_dir, StopRequest(1, 0.0))  # left for an agent that ran before: the next one clears it, and runs
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "deskfleet.agent", "--log-file", str(log), "--headless",
                              "--data-dir", str(data_dir)])
    try:
        pid = wait_for_agent(state_dir, lambda: agent.poll() is not None)
        assert pid == agent.pid, log.read_text()
        assert read_stop_request(state_dir) is None  # the stale request cleared, and this agent left running
        capsys.readouterr()
        assert main(["stop", "--data-dir", str(data_dir)]) == 0
        assert capsys.readouterr().out.startswith(f"stopped the agent (pid {agent.pid}); autostart")
        assert agent.wait(30) == 0  # its own end, not a signal's
        said = log.read_text()
        assert "stopping: asked to through" in said and re.search(r"agent \w{12} stopped", said), said
        assert agent_running_pid(state_dir) is None and read_stop_request(state_dir) is None
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert main(["stop", "--data-dir", str(data_dir)]) == 0  # none runs: nothing to do, said
    assert capsys.readouterr().out == f"no agent runs on {state_dir}: nothing to stop\n"
