"""A simulated PC of `deskfleet bench fleet` that dies mid-run: the bench stops with an error naming the
configuration and the PC and how it ended (the PC's log goes with the temporary folder, and the link error
alone names it by an agent id the user never saw), and leaves no process or folder behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.controller.test_review_bench_signals import DEADLINE_S, BenchRun


def test_a_simulated_pc_killed_mid_run_is_named_with_how_it_ended(tiny_export: Path, tmp_path: Path) -> None:
    run = BenchRun(tiny_export, tmp_path, new_tokens=48)
    try:
        # round 1 runs mono_1 first and reaches the pair's configurations after the 1-PC ones
        run.wait_for(lambda: "round 1/3 mono_1:" in run.stderr(), "first configuration")
        victims = [pid for pid in run.simulated_pcs() if b"/pair1.port" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        try:
            status = run.process.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the bench did not end within {DEADLINE_S:.0f} s of a PC's death") from None
        last_line = run.stderr().strip().splitlines()[-1]
        assert status == 2, run.stderr()[-2000:]
        assert last_line.startswith("deskfleet: error: configuration pair_"), last_line
        assert "simulated PC pair1 was killed by SIGKILL" in last_line
        assert run.simulated_pcs() == []
        assert list(run.temporary.iterdir()) == []
    finally:
        run.end()
