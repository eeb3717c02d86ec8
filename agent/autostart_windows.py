"""Autostart on Windows: two Task Scheduler tasks of the user's own, run at their logon (no admin rights, no password).

`\\deskfleet-agent` runs the agent with the install's console-less pythonw.exe, logging to agent.log in its state
folder (it has no console to log to); `\\deskfleet-tray` runs the tray the same way (tray.log). Both sit at the
library's root: a standard user may not be allowed to make a folder there.

What Task Scheduler does not do, and how the tasks make up for it (Microsoft's MS-TSCH and the schema's docs):
- RestartOnFailure restarts a task whose program failed to START, never one that exited with an error. The agent's
  trigger repeats every AGENT_RETRY (with MultipleInstancesPolicy IgnoreNew, a repeat while it runs does nothing), so
  an agent that crashed is back within that time. An agent that refused to start (exit 2: not joined, bad settings)
  is tried again as often, each time a line in agent.log.
- By default a task does not start on battery, is stopped when the PC goes on battery, and is stopped after 72
  hours: the agent judges battery itself (its availability policy) and runs for the whole session.
- The XML is UTF-16 with a byte order mark: schtasks refuses a UTF-8 file that declares UTF-16, and a file that
  declares none is read as the ANSI code page (a path in C:\\Users\\Zoë would be another path).
- A logon trigger names its user (DOMAIN\\user): left out, it means any user's logon, which only an admin may set.
- `schtasks /Query /XML` prints in the console's code page, not UTF-16 (read_query_xml).
Nothing here has run on Windows yet: the tests check the XML against these rules and drive a stand-in schtasks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deskfleet.agent.autostart import (
    MARK,
    AutostartError,
    AutostartReport,
    AutostartTarget,
    Launch,
    Runner,
    agent_running_pid,
    check_launch,
    output_text,
    said_by,
    wait_for_agent,
)
from deskfleet.agent.status_file import StatusFileError
from deskfleet.agent.stop_request import running_agent, stop_agent

TASK_NAMESPACE = "http://schemas.microsoft.com/windows/2004/02/mit/task"
MADE_HERE = re.compile(re.escape(f"({MARK} ") + r"([0-9a-f]{16})\)$")  # the end of the description `enable` writes
log = logging.getLogger(__name__)

AGENT_TASK = "\\deskfleet-agent"
TRAY_TASK = "\\deskfleet-tray"
AGENT_LOG = "agent.log"
TRAY_LOG = "tray.log"
AGENT_RETRY = "PT5M"  # how soon a crashed agent is started again
AGENT_PRIORITY = 7  # BELOW_NORMAL_PRIORITY_CLASS: Microsoft's for background work; the PC is its user's first
TRAY_PRIORITY = 6  # NORMAL: an interactive program's
RUN_AGAIN_S = 2.0  # after /End: how often /Run is sent again until the new agent runs
NO_SCHTASKS = "schtasks is not on this PC's PATH (it is in C:\\Windows\\System32)"


@dataclass(frozen=True)
class TaskAction:
    """What a task runs, as read back from Task Scheduler."""

    command: str
    arguments: str
    description: str

    @property
    def made_here(self) -> bool:
        """Whether `enable` made the task: its description ends naming it, with its command line's digest."""
        return MADE_HERE.search(self.description) is not None

    def runs(self, launch: Launch) -> bool:
        """Whether the task runs `launch`: the digest `enable` put in its description says it wrote that, and the
        command read back is it (an admin may have edited the task since). What schtasks prints is in the console's
        code page, which may lack a letter of the path (Łukasz in cp437): such a letter, printed as ?, passes."""
        found = MADE_HERE.search(self.description)
        return found is not None and found.group(1) == launch_digest(launch) and \
            _printed_as(self.command, str(launch.program)) and \
            _printed_as(self.arguments, subprocess.list2cmdline(launch.arguments))


def _printed_as(printed: str, text: str) -> bool:
    """Whether `printed` is `text` as a console may print it: a non-ASCII letter it lacks replaced by ? (or U+FFFD)."""
    return len(printed) == len(text) and all(shown == wanted or (shown in "?\ufffd" and not wanted.isascii())
                                             for shown, wanted in zip(printed, text, strict=True))


def launch_digest(launch: Launch) -> str:
    return hashlib.sha256("\0".join(launch.argv).encode("utf-8")).hexdigest()[:16]


def task_description(what: str, launch: Launch) -> str:
    return f"{what} ({MARK} {launch_digest(launch)})"


def task_xml(description: str, launch: Launch, user: str, priority: int, retry: str | None,
             working_dir: Path) -> str:
    """A task run at `user`'s logon, with their rights, for as long as the session lasts, on battery too; repeated
    every `retry` (an ISO 8601 duration) while the session lasts where given."""
    ElementTree.register_namespace("", TASK_NAMESPACE)
    task = ElementTree.Element(_tag("Task"), version="1.2")
    _sub(_sub(task, "RegistrationInfo"), "Description", description)
    trigger = _sub(_sub(task, "Triggers"), "LogonTrigger")
    _sub(trigger, "Enabled", "true")  # the trigger base type's sequence: Enabled, Repetition, then UserId
    if retry is not None:
        repetition = _sub(trigger, "Repetition")
        _sub(repetition, "Interval", retry)
        _sub(repetition, "StopAtDurationEnd", "false")  # no Duration: for as long as the session lasts
    _sub(trigger, "UserId", user)
    principal = _sub(_sub(task, "Principals"), "Principal", id="Author")
    _sub(principal, "UserId", user)
    _sub(principal, "LogonType", "InteractiveToken")  # runs in the user's session while they are logged on
    _sub(principal, "RunLevel", "LeastPrivilege")
    settings = _sub(task, "Settings")
    for name, value in (("MultipleInstancesPolicy", "IgnoreNew"), ("DisallowStartIfOnBatteries", "false"),
                        ("StopIfGoingOnBatteries", "false"), ("AllowHardTerminate", "true"),
                        ("StartWhenAvailable", "false"), ("RunOnlyIfNetworkAvailable", "false"),
                        ("AllowStartOnDemand", "true"), ("Enabled", "true"), ("Hidden", "false"),
                        ("RunOnlyIfIdle", "false"), ("WakeToRun", "false"), ("ExecutionTimeLimit", "PT0S"),
                        ("Priority", str(priority))):
        _sub(settings, name, value)
    idle = _sub(settings, "IdleSettings")
    _sub(idle, "StopOnIdleEnd", "false")
    _sub(idle, "RestartOnIdle", "false")
    execute = _sub(_sub(task, "Actions", Context="Author"), "Exec")
    _sub(execute, "Command", str(launch.program))
    _sub(execute, "Arguments", subprocess.list2cmdline(launch.arguments))
    _sub(execute, "WorkingDirectory", str(working_dir))
    body = ElementTree.tostring(task, encoding="unicode")
    return '<?xml version="1.0" encoding="UTF-16"?>\n' + body + "\n"


def task_file_bytes(xml: str) -> bytes:
    """What schtasks /XML reads: UTF-16 little-endian with its byte order mark."""
    return "\ufeff".encode("utf-16-le") + xml.encode("utf-16-le")


def read_query_xml(output: bytes) -> TaskAction:
    """The action and description of `schtasks /Query /XML`'s output: UTF-16 where it has a byte order mark, else
    UTF-8, else the console's (OEM) code page. ValueError where it is not a task."""
    text = output_text(output).lstrip("\ufeff")
    if text.startswith("<?xml"):  # ElementTree refuses a str that still declares an encoding
        text = text.partition("?>")[2]
    try:
        task = ElementTree.fromstring(text)
    except ElementTree.ParseError as error:
        raise ValueError(f"schtasks printed no task XML ({error})") from None
    return TaskAction(command=_text(task, "Actions/Exec/Command"), arguments=_text(task, "Actions/Exec/Arguments"),
                      description=_text(task, "RegistrationInfo/Description"))


class WindowsAutostart:
    """The user's two logon tasks, made and taken away with schtasks."""

    def __init__(self, target: AutostartTarget, state_dir: Path, user: str, run: Runner) -> None:
        self.target = target
        self.state_dir = state_dir
        self.user = user
        self.run = run

    def agent_launch(self) -> Launch:
        return _expanded_by_nothing(self.target.agent(self._windowless(), self.state_dir / AGENT_LOG))

    def tray_launch(self) -> Launch:
        return _expanded_by_nothing(self.target.tray(self._windowless(), self.state_dir / TRAY_LOG))

    def enable(self) -> list[str]:
        agent, tray = self.agent_launch(), self.tray_launch()
        agent_before = self._ours(AGENT_TASK)  # both refused before either is made
        self._ours(TRAY_TASK)
        check_launch(self.target, self.run)
        home = Path.home()
        self._create(AGENT_TASK, task_xml(task_description("deskfleet agent: hosts model stages for the office's fleet",
                                                           agent), agent, self.user, AGENT_PRIORITY, AGENT_RETRY, home))
        self._create(TRAY_TASK, task_xml(task_description("deskfleet tray: this PC's agent and its pause toggle", tray),
                                         tray, self.user, TRAY_PRIORITY, None, home))
        changed = agent_before is not None and not agent_before.runs(agent)
        running = agent_running_pid(self.state_dir)
        ending = running if changed else None
        if changed:  # the instance running now runs the old command line, and IgnoreNew would keep it
            self._end_agent()
        elif running is not None:
            return self._enabled_lines(f"already running (pid {running}): the task starts it from your next logon")
        log = self.state_dir / AGENT_LOG
        log_start = log.stat().st_size if log.is_file() else 0
        self._schtasks("/Run", "/TN", AGENT_TASK)
        last_run = time.monotonic()

        def ended() -> bool:
            nonlocal last_run
            if changed and time.monotonic() - last_run >= RUN_AGAIN_S:  # /End returns before the old one has ended,
                self.run(["schtasks", "/Run", "/TN", AGENT_TASK])  # and a /Run meanwhile was ignored (IgnoreNew)
                last_run = time.monotonic()
            return _refusal_in(log, log_start) is not None

        running = wait_for_agent(self.state_dir, ended, other_than=ending)
        if running is None:
            said = _refusal_in(log, log_start)
            raise AutostartError(f"autostart is set up, but the agent has not come up"
                                 f"{f' ({said})' if said else ''}: its log says why: {log}")
        return self._enabled_lines(f"running now (pid {running})")

    def _enabled_lines(self, started: str) -> list[str]:
        return [f"The agent starts at your logon (task {AGENT_TASK}), and again within 5 minutes if it stops; "
                f"{started}.",
                f"Its log: {self.state_dir / AGENT_LOG}",
                f"The tray starts at your logon (task {TRAY_TASK}); to show it now: schtasks /Run /TN {TRAY_TASK}"]

    def disable(self) -> list[str]:
        agent = self._ours(AGENT_TASK)
        tray = self._ours(TRAY_TASK)
        lines = []
        if agent is not None:
            self._end_agent()
            self._schtasks("/Delete", "/TN", AGENT_TASK, "/F")
            lines.append(f"The agent is stopped and no longer starts at your logon (task {AGENT_TASK} deleted).")
        else:
            lines.append(f"The agent did not start at logon (no task {AGENT_TASK}): nothing to stop.")
        if tray is not None:
            self._schtasks("/Delete", "/TN", TRAY_TASK, "/F")
            lines.append(f"The tray no longer starts at your logon (task {TRAY_TASK} deleted); one showing now stays "
                         "until it is quit.")
        else:
            lines.append(f"The tray did not start at logon (no task {TRAY_TASK}).")
        return lines

    def status(self) -> AutostartReport:
        try:
            launches = (("agent", AGENT_TASK, self.agent_launch()), ("tray", TRAY_TASK, self.tray_launch()))
        except AutostartError as error:  # what enable refuses: nothing can start this install and data dir
            return AutostartReport(False, [f"autostart cannot start this install and data dir: {error}"])
        lines = []
        enabled = True
        for name, task, launch in launches:
            action = self._ours(task, refuse=False)
            if action is None:
                lines.append(f"{name}: does not start at logon (no task {task})")
                enabled = False
            elif not action.made_here:
                lines.append(f"{name}: task {task} was not made by `{MARK}`: it is the admin's")
                enabled = False
            elif not action.runs(launch):
                lines.append(f"{name}: starts at logon (task {task}), but runs another install or data dir: "
                             f"{action.command} {action.arguments}; `{MARK} enable` points it at this one")
                enabled = False
            else:
                lines.append(f"{name}: starts at logon (task {task})")
        running = agent_running_pid(self.state_dir)
        lines.append(f"agent: running now (pid {running})" if running is not None else
                     f"agent: not running now (its log: {self.state_dir / AGENT_LOG})")
        return AutostartReport(enabled and running is not None, lines)

    def _end_agent(self) -> None:
        """Stop the agent running on this data dir as Ctrl-C would (stop_request.py: its stages given up, its links
        closed), then end the task: `schtasks /End` alone ends the process on the spot, as it does one that did not
        take the request within STOP_WAIT_S (or took it, but had not ended STOPPING_GRACE_S later), one whose request
        could not be written or status read, and one of another data dir (a task re-pointed from it), whose state
        folder this install does not know."""
        try:
            running = running_agent(self.state_dir)
            if running is not None:
                stop_agent(self.state_dir, running)
        except (OSError, StatusFileError) as error:  # the task is ended and deleted all the same
            log.warning("cannot ask the agent to stop (%s): its task is ended", error)
        self.run(["schtasks", "/End", "/TN", AGENT_TASK])  # fails harmlessly where it does not run

    def _windowless(self) -> Path:
        """pythonw.exe beside this install's python.exe (a venv's Scripts folder has both): no console window."""
        windowless = self.target.python.with_name("pythonw.exe")
        if not windowless.is_file():
            raise AutostartError(f"{windowless} is not there: autostart runs the agent with the pythonw.exe of the "
                                 "Python deskfleet is installed in, which has no console window")
        return windowless

    def _ours(self, task: str, refuse: bool = True) -> TaskAction | None:
        """The task's action (None where there is no such task); AutostartError where this command did not make it."""
        try:
            done = self.run(["schtasks", "/Query", "/TN", task, "/XML"])
        except FileNotFoundError:
            raise AutostartError(NO_SCHTASKS) from None
        if done.returncode != 0:
            return None  # its words are localized: "ERROR: The system cannot find the file specified."
        try:
            action = read_query_xml(done.stdout)
        except ValueError as error:
            raise AutostartError(f"schtasks /Query /TN {task}: {error}") from None
        if refuse and not action.made_here:
            raise AutostartError(f"the scheduled task {task} was not made by `{MARK}`: it is left as it is; delete "
                                 f"it (schtasks /Delete /TN {task}) to let autostart manage it, or keep managing it "
                                 "by hand")
        return action

    def _create(self, task: str, xml: str) -> None:
        with _task_file(xml) as path:
            self._schtasks("/Create", "/TN", task, "/XML", str(path), "/F")

    def _schtasks(self, *arguments: str) -> None:
        argv = ["schtasks", *arguments]
        try:
            done = self.run(argv)
        except FileNotFoundError:
            raise AutostartError(NO_SCHTASKS) from None
        if done.returncode != 0:
            raise AutostartError(f"`{' '.join(argv)}` failed: {said_by(done)}")

def _expanded_by_nothing(launch: Launch) -> Launch:
    """`launch`, where no word holds `%`: Task Scheduler expands %NAME% in a task's command and arguments."""
    if any("%" in word for word in launch.argv):
        raise AutostartError(f"a task would read the % in {' '.join(launch.argv)} as an environment variable: install "
                             "deskfleet and keep its data dir in folders whose names have none")
    return launch


def _refusal_in(log: Path, start: int) -> str | None:
    """How the agent ended, as written to its log after `start`: its refusal to start (`deskfleet-agent: error:
    ...`) or a crash's traceback (its last line); None while it has written neither. A log shorter than `start` was
    rolled over by the agent as it started (over LOG_ROLL_BYTES): it is read whole."""
    try:
        with log.open("rb") as handle:
            if handle.seek(0, 2) >= start:
                handle.seek(start)
            else:
                handle.seek(0)
            written = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in written.splitlines() if line.strip()]
    refusal = next((line for line in lines if line.startswith("deskfleet-agent: error:")), None)
    if refusal is None and "Traceback (most recent call last):" in written:
        return lines[-1]
    return refusal


@contextlib.contextmanager
def _task_file(xml: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="deskfleet-task-") as folder:
        path = Path(folder) / "task.xml"
        path.write_bytes(task_file_bytes(xml))
        yield path


def _tag(name: str) -> str:
    return f"{{{TASK_NAMESPACE}}}{name}"


def _sub(parent: ElementTree.Element, name: str, text: str | None = None, **attributes: str) -> ElementTree.Element:
    element = ElementTree.SubElement(parent, _tag(name), attributes)
    element.text = text
    return element


def _text(task: ElementTree.Element, path: str) -> str:
    found = task.find("/".join(f"{{{TASK_NAMESPACE}}}{part}" for part in path.split("/")))
    return "" if found is None or found.text is None else found.text
