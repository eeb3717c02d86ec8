"""The agent stops cleanly on SIGHUP (a terminal or SSH session that closes sends it), as on SIGTERM: before, the
default handling ended the process on the spot, with no `agent ... stopped` line, its lock file left holding its
pid, and its stages as they were. Under nohup, which sets SIGHUP to be ignored, it keeps running. A real agent
process: what is tested is how one process takes a signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deskfleet.agent.enroll import Membership
from deskfleet.agent.paths import AgentPaths
from deskfleet.agent.service import LOCK_FILE
from deskfleet.common import pki
from deskfleet.common.file_lock import pid_lock
from tests.fleet_pki import make_ca, make_member
from tests.ports import free_address

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on Windows")


def _start_agent(data_dir: Path, log: Path, ignore_hangup: bool = False) -> subprocess.Popen[bytes]:
    state = AgentPaths.resolve(data_dir).state_dir
    files = make_member(make_ca(data_dir / "ca"), state, "agent")
    state.chmod(0o700)
    Membership(pki.fleet_id(files.ca_certificate()), files.own_identity().agent_id, "c" * 52,
               ("127.0.0.1:1",)).save(state)  # a controller that is not there: the agent serves meanwhile

    def nohup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    agent = subprocess.Popen([sys.executable, "-m", "deskfleet.agent.cli", "--headless", "--data-dir", str(data_dir),
                              "--listen", free_address()], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                             preexec_fn=nohup if ignore_hangup else None)
    deadline = time.monotonic() + 60
    while "listening on" not in log.read_text(errors="replace"):
        assert agent.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "the agent did not start listening"
        time.sleep(0.1)
    return agent


@pytest.mark.slow
def test_sighup_stops_the_agent_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    agent = _start_agent(tmp_path / "agent", log)
    agent.send_signal(signal.SIGHUP)
    assert agent.wait(30) == 0, log.read_text(errors="replace")
    text = log.read_text(errors="replace")
    assert " stopped" in text.splitlines()[-1], text
    with pid_lock(AgentPaths.resolve(tmp_path / "agent").state_dir / LOCK_FILE,
                  lambda pid, holder: AssertionError(f"the agent's lock is still held, by {pid}")):
        pass


@pytest.mark.slow
def test_an_agent_under_nohup_keeps_running_on_sighup(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    agent = _start_agent(tmp_path / "agent", log, ignore_hangup=True)
    try:
        agent.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert agent.poll() is None, log.read_text(errors="replace")
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
