"""`fleet serve` stops cleanly on SIGHUP (a terminal or SSH session that closes sends it), as on SIGTERM, and says
which signal stopped it: before, SIGHUP ended it on the spot (exit 129), and SIGTERM stopped it without a word."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import free_address

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on Windows")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_fleet_serve_stops_on_sighup_and_sigterm_and_says_which(tmp_path: Path, signum: int) -> None:
    address = free_address()
    controller = [sys.executable, "-m", "deskfleet.controller.cli", "fleet"]
    subprocess.run([*controller, "init", "--data-dir", str(tmp_path / "ctl"), "--address", address], check=True,
                   capture_output=True, timeout=120)
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([*controller, "serve", "--data-dir", str(tmp_path / "ctl"), "--listen", address],
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "controller listening" not in log.read_text(errors="replace"):
        assert serve.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, "fleet serve did not start listening"
        time.sleep(0.1)
    serve.send_signal(signum)
    assert serve.wait(30) == 0, log.read_text(errors="replace")
    assert f"fleet serve stopped by {signal.Signals(signum).name}" in log.read_text(errors="replace")
