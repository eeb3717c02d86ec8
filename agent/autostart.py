"""`deskfleet-agent autostart`: start this PC's agent, and its tray, with the user's session, from this very install.

On Linux the agent becomes a systemd user service and the tray an XDG autostart entry (autostart_linux.py); on
Windows both become Task Scheduler tasks run at the user's logon (autostart_windows.py). Either runs the Python that
deskfleet is installed in, with `-m deskfleet.agent`, never a `deskfleet-agent` looked up on a PATH that the login
session may not have, and gives it the data dir this command was given. A file or a task that this command did not
write is never replaced or removed: it names the file and leaves it to whoever wrote it.
"""

from __future__ import annotations

import locale
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from deskfleet.common.arguments import option_text

MARK = "deskfleet-agent autostart"  # in every file and task this command writes: what it may replace and remove
# systemctl and schtasks answer in well under a second; `python -m deskfleet.agent --help` in one or two, a cold disk
# on a busy PC in more
COMMAND_TIMEOUT_S = 60.0
# how long `enable` waits for the agent it started to publish its status (agent/status_file.py): a few seconds on an
# idle PC (OpenVINO's import), more on a busy one; one that fails at once is told by its service manager before that
AGENT_START_WAIT_S = 60.0
AGENT_START_POLL_S = 0.25
# -P: the folder it starts in is not put first on the module path; `-m` would put it there, and a clone of this repo at
# ~/deskfleet (a namespace package: no __init__.py) would run instead of the installed deskfleet
SAFE_MODULE_RUN = ("-P", "-m", "deskfleet.agent")

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[bytes]"]  # output kept as bytes: see output_text


class AutostartError(Exception):
    """Autostart cannot be set up, or taken away, as asked; the message names what is wrong and what to do."""


@dataclass(frozen=True)
class Launch:
    """A command line of this install's agent: the program and its arguments, each one word."""

    program: Path
    arguments: tuple[str, ...]

    @property
    def argv(self) -> list[str]:
        return [str(self.program), *self.arguments]


@dataclass(frozen=True)
class AutostartTarget:
    """What autostart starts: the agent and the tray of the install that runs this command, on one data dir."""

    python: Path  # this install's interpreter (a venv's own: never resolved through its links)
    data_dir: Path | None  # absolute; None: the platform's folders

    @classmethod
    def this_install(cls, data_dir: Path | None, python: str | None = None) -> AutostartTarget:
        """The install running this command. `data_dir` is made absolute: a login session starts in another folder."""
        interpreter = Path(python or sys.executable)
        if not interpreter.is_absolute():  # an empty sys.executable reads as "."
            raise AutostartError(f"cannot tell which Python runs deskfleet (sys.executable is {str(interpreter)!r}): "
                                 "run `deskfleet-agent autostart` from the installed `deskfleet-agent` command")
        return cls(interpreter, None if data_dir is None else data_dir.expanduser().resolve())

    def agent(self, program: Path | None = None, log_file: Path | None = None) -> Launch:
        """`--headless` (a program other than `python`: Windows' console-less pythonw.exe)."""
        return self._launch(program, log_file, ("--headless", *self._data_dir_option()))

    def tray(self, program: Path | None = None, log_file: Path | None = None) -> Launch:
        return self._launch(program, log_file, ("tray", *self._data_dir_option()))

    def _launch(self, program: Path | None, log_file: Path | None, command: tuple[str, ...]) -> Launch:
        logging = () if log_file is None else ("--log-file", str(log_file))
        return Launch(program or self.python, (*SAFE_MODULE_RUN, *logging, *command))

    def _data_dir_option(self) -> tuple[str, ...]:
        return () if self.data_dir is None else ("--data-dir", str(self.data_dir))

    def tray_command(self) -> str:
        """`deskfleet-agent tray` for this data dir, as the user would type it."""
        return "deskfleet-agent tray" + ("" if self.data_dir is None else
                                         " " + option_text("--data-dir", str(self.data_dir)))


@dataclass(frozen=True)
class AutostartReport:
    """What `status` found: whether both start with the session from this install and data dir, and in words."""

    enabled: bool
    lines: list[str]


class Autostart(Protocol):
    """One platform's way of starting the agent and the tray with the user's session."""

    def enable(self) -> list[str]:
        """Set both up (again, pointed at this install and data dir), start the agent now; what was done, in lines."""
        ...

    def disable(self) -> list[str]:
        """Take both away (what this command wrote only); what was done, in lines."""
        ...

    def status(self) -> AutostartReport:
        ...


def autostart_for_this_pc(target: AutostartTarget, state_dir: Path, platform: str = sys.platform,
                          run: Runner | None = None) -> Autostart:
    """The platform's Autostart for `target`, whose agent keeps its state in `state_dir`."""
    runner = run or run_command
    if platform.startswith("linux"):
        from deskfleet.agent.autostart_linux import LinuxAutostart

        return LinuxAutostart(target, state_dir, config_home(os.environ), runner)
    if platform == "win32":
        from deskfleet.agent.autostart_windows import WindowsAutostart

        return WindowsAutostart(target, state_dir, windows_user(os.environ), runner)
    raise AutostartError(f"autostart is made for Linux and Windows, not {platform}: start `deskfleet-agent --headless` "
                         "and `deskfleet-agent tray` with the session the way this system does")


def config_home(environment: Mapping[str, str]) -> Path:
    """$XDG_CONFIG_HOME, else ~/.config (the XDG base directory spec: a relative value is to be ignored)."""
    given = environment.get("XDG_CONFIG_HOME", "")
    if given and Path(given).is_absolute():
        return Path(given)
    return Path(environment.get("HOME") or Path.home()) / ".config"


def windows_user(environment: Mapping[str, str]) -> str:
    """DOMAIN\\user, as a task's logon trigger and principal name the user (the computer's name for a local one)."""
    user = environment.get("USERNAME", "")
    if not user:
        raise AutostartError("USERNAME is not set: run `deskfleet-agent autostart` in the user's own logon session")
    domain = environment.get("USERDOMAIN", "")
    return f"{domain}\\{user}" if domain else user


def check_launch(target: AutostartTarget, run: Runner) -> None:
    """Refuse a Python that cannot run deskfleet outside this shell (one that imports it only thanks to the shell's
    PYTHONPATH, or a venv since deleted): the session would start nothing, and say so nowhere the user looks."""
    argv = [str(target.python), *SAFE_MODULE_RUN, "--help"]
    try:
        done = run(argv)
    except OSError as error:
        raise AutostartError(f"cannot run {target.python}: {error.strerror or error}") from None
    if done.returncode != 0:
        raise AutostartError(f"`{' '.join(argv)}` fails outside this shell (exit {done.returncode}: {said_by(done)}): "
                             "install deskfleet with pip into that Python, or run autostart from the Python it is "
                             "installed in")


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[bytes]:
    """Run a system command (systemctl, schtasks, this install's Python) as a login session would: without this shell's
    PYTHONPATH or PYTHONHOME, which the session will not have, and from the home folder."""
    environment = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        return subprocess.run(list(argv), capture_output=True, env=environment, cwd=Path.home(),
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise AutostartError(f"`{' '.join(argv)}` did not answer within {COMMAND_TIMEOUT_S:.0f} s") from None


def said_by(done: subprocess.CompletedProcess[bytes]) -> str:
    """A failed command's own words (its last line of standard error, else of output), for an error message."""
    lines = output_text(done.stderr).strip().splitlines() or output_text(done.stdout).strip().splitlines()
    return lines[-1].strip() if lines else f"exit {done.returncode}, no message"


def output_text(output: bytes | None) -> str:
    """A system command's output: UTF-16 where it starts with a byte order mark, else UTF-8 (systemctl's), else the
    console's code page (schtasks writes to a pipe in it, whatever encoding its XML declares)."""
    if not output:
        return ""
    if output.startswith((b"\xff\xfe", b"\xfe\xff")):
        return output.decode("utf-16")
    try:
        return output.decode("utf-8")
    except UnicodeDecodeError:
        return output.decode(_console_code_page(), errors="replace")


def agent_running_pid(state_dir: Path) -> int | None:
    """The pid of the agent that runs on this data dir now, as its status file tells (None: none runs, or it cannot
    be told)."""
    from deskfleet.agent.status_file import StatusFileError
    from deskfleet.agent.stop_request import running_agent

    try:
        running = running_agent(state_dir)
    except StatusFileError:
        return None
    return running.pid if running is not None else None


def wait_for_agent(state_dir: Path, gave_up: Callable[[], bool], other_than: int | None = None,
                   timeout: float = AGENT_START_WAIT_S) -> int | None:
    """The pid of the agent once it runs on this data dir (one other than `other_than`, an agent being stopped); None
    where `gave_up()` (called at every look: the agent ended, as its service manager or its log says) or `timeout`
    passed first."""
    deadline = time.monotonic() + timeout
    while (pid := agent_running_pid(state_dir)) is None or pid == other_than:
        if gave_up() or time.monotonic() >= deadline:
            return None
        time.sleep(AGENT_START_POLL_S)
    return pid


def _console_code_page() -> str:
    """The console's (OEM) code page on Windows (cp437, cp850, ...); elsewhere the locale's encoding."""
    try:
        import ctypes

        return f"cp{ctypes.windll.kernel32.GetOEMCP()}"  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return locale.getpreferredencoding(False)
