"""A benchmark variant running in a process of its own, spoken to in lines over stdin/stdout.

The OpenVINO GenAI baselines need their own venv (optimum-intel pins other versions), so the benchmarks
start a small runner script there; `bench parity` also runs deskfleet's own variants this way, one fresh
process each. Each request is one line; each answer is one JSON object per line, with "error" set when
the runner failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .interruption import signals_held, stopping


class RunnerProcess:
    """The runner `script` under `python` (default: this interpreter). Call close() when done."""

    def __init__(self, script: Path, python: Path | None, environment: dict[str, str] | None = None) -> None:
        self.python = str(python or sys.executable)
        self.script = Path(script).name
        # A session of its own: a Ctrl-C at the terminal reaches only the bench, which stops its runners as it
        # unwinds (close()); sent to the runners too, each printed a KeyboardInterrupt traceback under its line.
        process: subprocess.Popen[str] | None = None
        try:
            with signals_held():  # a Ctrl-C inside Popen, after its fork, would leave a child nothing stops
                process = subprocess.Popen([self.python, str(script)], env=environment, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        except BaseException:  # the held signal, raised as the block ends: no caller gets this object to close
            if process is not None:
                _end(process)
            raise
        self.process = process

    def start(self, config_line: str) -> dict[str, Any]:
        """Send the runner its configuration and wait for its ready answer (a model's load: seconds); a failure
        or a signal meanwhile ends the runner, whose object the caller may not have kept yet."""
        try:
            self.send_line(config_line)
            return self.receive()
        except BaseException:
            _end(self.process)
            raise

    def send_line(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        """The runner's next answer; RuntimeError when it exited or reported an error."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"the runner {self.script} exited ({code}) without an answer; see its stderr above")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"runner {self.script}: {reply['error']}")
        return reply

    def close(self, quit_line: str) -> None:
        """Ask the runner to quit, once it has finished what it is doing; when a signal is stopping the bench, end
        it at once instead (a runner busy with a long generation reads its quit line only when that is done)."""
        if stopping():
            _end(self.process)  # nothing to do for one that has exited
        elif self.process.poll() is None:
            try:
                self.send_line(quit_line)
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


def _end(process: subprocess.Popen[Any]) -> None:
    stop_processes([process], timeout=5.0)


def stop_processes(processes: Iterable[subprocess.Popen[Any]], timeout: float = 10.0) -> None:
    """Terminate every process still running, give each `timeout` seconds to exit, then kill what is left."""
    processes = list(processes)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
