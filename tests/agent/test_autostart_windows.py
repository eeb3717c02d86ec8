"""`deskfleet-agent autostart` on Windows, tried here: the task XML against the rules Task Scheduler holds it to
(autostart_windows.py's docstring), reading `schtasks /Query /XML` back in each encoding it comes in, and the whole
enable / status / disable against a stand-in schtasks whose /Run starts the task's command line as a real agent."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from deskfleet.agent import autostart as autostart_module
from deskfleet.agent import autostart_windows, stop_request
from deskfleet.agent.autostart import MARK, AutostartError, AutostartTarget, Launch, windows_user
from deskfleet.agent.autostart_windows import (
    AGENT_LOG,
    AGENT_TASK,
    TASK_NAMESPACE,
    TRAY_TASK,
    WindowsAutostart,
    read_query_xml,
    task_description,
    task_file_bytes,
    task_xml,
)
from deskfleet.agent.cli import build_parser
from deskfleet.agent.paths import AgentPaths
from tests.agent.test_autostart_linux import joined_data_dir

USER = "OFFICE-PC42\\zoë"
NS = {"t": TASK_NAMESPACE}
NOT_FOUND = b"ERROR: The system cannot find the file specified.\r\n"
END_DELAY_S = 1.0  # how long after /End the stand-in's process is killed


class FakeSchtasks:
    """schtasks for one user: it keeps the tasks it is given, checks them as Task Scheduler would for a standard user,
    and runs a task's command line at /Run (pythonw.exe stands for this Python) until /End kills it."""

    def __init__(self, scripts: Path) -> None:
        self.scripts = scripts
        self.tasks: dict[str, bytes] = {}
        self.calls: list[list[str]] = []
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[bytes]:
        argv = list(argv)
        if Path(argv[0]).parent == self.scripts:  # this install's python.exe: the launch check
            return subprocess.run([sys.executable, *argv[1:]], capture_output=True, check=False, timeout=60)
        assert argv[0] == "schtasks", argv
        self.calls.append(argv[1:])
        verb, name = argv[1], argv[3]
        if verb == "/Create":
            self.tasks[name] = self._checked(Path(argv[5]).read_bytes())
            return self._done(b"SUCCESS: The scheduled task has successfully been created.\r\n")
        if name not in self.tasks:
            return subprocess.CompletedProcess(argv, 1, b"", NOT_FOUND)
        if verb == "/Query":  # in the console's code page, whatever the XML declares
            return self._done(self.tasks[name].decode("utf-16").lstrip("\ufeff").encode("utf-8"))
        if verb == "/Run":
            task = ElementTree.fromstring(self.tasks[name])
            command = task.find("t:Actions/t:Exec/t:Command", NS)
            arguments = task.find("t:Actions/t:Exec/t:Arguments", NS)
            assert command is not None and command.text == str(self.scripts / "pythonw.exe")
            assert arguments is not None and arguments.text is not None
            if name not in self.running or self.running[name].poll() is not None:
                self.running[name] = subprocess.Popen([sys.executable, *shlex.split(arguments.text)],
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return self._done(b"SUCCESS: Attempted to run the scheduled task.\r\n")
        if verb == "/End":  # returns before the process has ended, as schtasks does
            if name in self.running and self.running[name].poll() is None:
                threading.Timer(END_DELAY_S, self.running[name].send_signal, (signal.SIGKILL,)).start()
            return self._done(b"SUCCESS: The scheduled task has been terminated.\r\n")
        if verb == "/Delete":
            del self.tasks[name]
            return self._done(b"SUCCESS: The scheduled task was successfully deleted.\r\n")
        raise AssertionError(f"unexpected schtasks call {argv}")

    def verbs(self) -> list[tuple[str, str]]:
        return [(call[0], call[2]) for call in self.calls if call[0] != "/Query"]

    def stop_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(30)

    @staticmethod
    def _done(output: bytes) -> subprocess.CompletedProcess[bytes]:
        return subprocess.CompletedProcess([], 0, output, b"")

    @staticmethod
    def _checked(data: bytes) -> bytes:
        """What schtasks /Create /XML refuses of a standard user: a file not UTF-16 with its mark, a logon trigger for
        another user or any user, an action whose context is not the principal."""
        assert data.startswith(b"\xff\xfe"), "not UTF-16 LE with a byte order mark"
        task = ElementTree.fromstring(data)
        trigger = task.find("t:Triggers/t:LogonTrigger", NS)
        assert trigger is not None and trigger.findtext("t:UserId", namespaces=NS) == USER, "Access is denied."
        principal = task.find("t:Principals/t:Principal", NS)
        actions = task.find("t:Actions", NS)
        assert principal is not None and actions is not None and principal.get("id") == actions.get("Context")
        return data


@pytest.fixture
def install(tmp_path: Path) -> Path:
    """A Windows venv's Scripts folder: python.exe and the console-less pythonw.exe."""
    scripts = tmp_path / "venv" / "Scripts"
    scripts.mkdir(parents=True)
    for name in ("python.exe", "pythonw.exe"):
        (scripts / name).touch()
    return scripts


@pytest.fixture
def schtasks(install: Path) -> Iterator[FakeSchtasks]:
    fake = FakeSchtasks(install)
    yield fake
    fake.stop_all()


def _windows(install: Path, data_dir: Path, run: FakeSchtasks) -> WindowsAutostart:
    target = AutostartTarget.this_install(data_dir, str(install / "python.exe"))
    return WindowsAutostart(target, AgentPaths.resolve(data_dir).state_dir, USER, run)


# The XML

def _agent_xml(tmp_path: Path, retry: str | None = "PT5M") -> ElementTree.Element:
    launch = Launch(tmp_path / "Scripts" / "pythonw.exe", ("-m", "deskfleet.agent", "--headless", "--data-dir",
                                                           str(tmp_path / "John Smith")))
    return ElementTree.fromstring(task_file_bytes(task_xml(f"agent ({MARK})", launch, USER, 7, retry, tmp_path)))


def test_the_task_runs_at_the_users_logon_for_the_whole_session_on_battery_too(tmp_path: Path) -> None:
    task = _agent_xml(tmp_path)
    assert task.tag == f"{{{TASK_NAMESPACE}}}Task"
    trigger = task.find("t:Triggers/t:LogonTrigger", NS)
    assert trigger is not None
    # the trigger's children in the schema's sequence: Enabled, (StartBoundary, EndBoundary), Repetition, UserId
    assert [child.tag.rpartition("}")[2] for child in trigger] == ["Enabled", "Repetition", "UserId"]
    assert trigger.findtext("t:UserId", namespaces=NS) == USER  # left out: any user's logon, an admin's to set
    assert trigger.findtext("t:Repetition/t:Interval", namespaces=NS) == "PT5M"
    settings = task.find("t:Settings", NS)
    assert settings is not None
    expected = {"DisallowStartIfOnBatteries": "false", "StopIfGoingOnBatteries": "false", "ExecutionTimeLimit": "PT0S",
                "MultipleInstancesPolicy": "IgnoreNew", "Priority": "7", "RunOnlyIfIdle": "false"}
    assert {name: settings.findtext(f"t:{name}", namespaces=NS) for name in expected} == expected
    assert settings.findtext("t:IdleSettings/t:StopOnIdleEnd", namespaces=NS) == "false"
    principal = task.find("t:Principals/t:Principal", NS)
    assert principal is not None and principal.findtext("t:LogonType", namespaces=NS) == "InteractiveToken"
    assert principal.findtext("t:RunLevel", namespaces=NS) == "LeastPrivilege"
    assert task.find("t:Actions", NS).get("Context") == principal.get("id")  # type: ignore[union-attr]
    arguments = task.findtext("t:Actions/t:Exec/t:Arguments", namespaces=NS)
    assert arguments is not None and f'"{tmp_path / "John Smith"}"' in arguments  # one argument, as Windows splits
    parsed = build_parser().parse_args(shlex.split(arguments)[2:])
    assert parsed.headless and parsed.data_dir == tmp_path / "John Smith"
    assert _agent_xml(tmp_path, retry=None).find("t:Triggers/t:LogonTrigger/t:Repetition", NS) is None


def test_the_task_file_is_utf16_with_its_mark_and_keeps_a_non_ascii_user(tmp_path: Path) -> None:
    data = task_file_bytes(task_xml("d", Launch(Path("C:/Python/pythonw.exe"), ("-m",)), USER, 7, None, tmp_path))
    assert data.startswith(b"\xff\xfe") and data.decode("utf-16").lstrip("\ufeff").startswith(
        '<?xml version="1.0" encoding="UTF-16"?>')
    assert ElementTree.fromstring(data).findtext("t:Principals/t:Principal/t:UserId", namespaces=NS) == USER


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8", "cp850"])
def test_a_query_is_read_in_the_encoding_schtasks_prints_it_in(tmp_path: Path, encoding: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autostart_module, "_console_code_page", lambda: "cp850")  # a Western European console
    launch = Launch(Path("C:/Users/Zoë/venv/Scripts/pythonw.exe"), ("-m", "deskfleet.agent", "--headless"))
    xml = task_xml(f"agent ({MARK})", launch, USER, 7, None, tmp_path)
    action = read_query_xml(xml.encode(encoding))  # utf-16 with its mark, as Python writes it
    assert action.command == "C:/Users/Zoë/venv/Scripts/pythonw.exe"
    assert action.arguments == "-m deskfleet.agent --headless" and MARK in action.description
    with pytest.raises(ValueError, match="no task XML"):
        read_query_xml(b"ERROR: Access is denied.\r\n")


def test_the_user_is_named_with_their_domain() -> None:
    assert windows_user({"USERNAME": "zoe", "USERDOMAIN": "OFFICE"}) == "OFFICE\\zoe"
    with pytest.raises(AutostartError, match="USERNAME is not set"):
        windows_user({})


# The command, with the stand-in schtasks

@pytest.mark.slow
def test_enable_runs_the_agent_now_and_disable_ends_it(tmp_path: Path, install: Path,
                                                       schtasks: FakeSchtasks) -> None:
    data_dir = joined_data_dir(tmp_path / "agent")
    windows = _windows(install, data_dir, schtasks)
    assert not windows.status().enabled
    lines = windows.enable()
    agent = schtasks.running[AGENT_TASK]
    assert f"running now (pid {agent.pid})" in lines[0]
    assert schtasks.verbs() == [("/Create", AGENT_TASK), ("/Create", TRAY_TASK), ("/Run", AGENT_TASK)]
    log = windows.state_dir / AGENT_LOG
    assert "listening on" in log.read_text(encoding="utf-8")  # pythonw has no console: --log-file is where it says
    report = windows.status()
    assert report.enabled and f"agent: running now (pid {agent.pid})" in report.lines

    schtasks.calls.clear()
    assert "already running" in windows.enable()[0]  # the same: the task is made again, the agent left running
    assert schtasks.verbs() == [("/Create", AGENT_TASK), ("/Create", TRAY_TASK)] and agent.poll() is None

    windows.disable()
    # stopped as Ctrl-C would, through its state folder (a console-less process takes no signal on Windows): its own
    # end, then /End, which finds nothing left to end
    assert agent.wait(30) == 0 and "stopping: asked to through" in log.read_text(encoding="utf-8")
    assert ("/End", AGENT_TASK) in schtasks.verbs()
    assert schtasks.tasks == {} and not windows.status().enabled


@pytest.mark.slow
def test_an_agent_that_does_not_stop_when_asked_is_ended(tmp_path: Path, install: Path, schtasks: FakeSchtasks,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    windows = _windows(install, joined_data_dir(tmp_path / "agent"), schtasks)
    windows.enable()
    agent = schtasks.running[AGENT_TASK]
    agent.send_signal(signal.SIGSTOP)  # hung: it never looks for the request
    try:
        real = stop_request.stop_agent
        monkeypatch.setattr(autostart_windows, "stop_agent",
                            lambda state_dir, running: real(state_dir, running, timeout=1.0, grace=0.0))
        windows.disable()
        assert agent.wait(30) == -signal.SIGKILL  # /End, as Windows does it
        assert stop_request.read_stop_request(windows.state_dir) is None  # the request taken back
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGCONT)


def test_disable_ends_and_deletes_the_tasks_where_no_request_can_be_written(
        tmp_path: Path, install: Path, schtasks: FakeSchtasks) -> None:
    windows = _windows(install, joined_data_dir(tmp_path / "agent"), schtasks)
    windows.enable()
    agent = schtasks.running[AGENT_TASK]
    (windows.state_dir / stop_request.STOP_REQUEST_FILE).mkdir()  # no request can be written there
    windows.disable()
    assert agent.wait(30) == -signal.SIGKILL and schtasks.tasks == {}  # ended and deleted all the same


@pytest.mark.slow
def test_enable_on_another_data_dir_ends_the_old_agent_and_runs_the_new(tmp_path: Path, install: Path,
                                                                      schtasks: FakeSchtasks) -> None:
    first, second = joined_data_dir(tmp_path / "first"), joined_data_dir(tmp_path / "second")
    _windows(install, first, schtasks).enable()
    old = schtasks.running[AGENT_TASK]
    moved = _windows(install, second, schtasks)
    assert "running now" in moved.enable()[0]  # /Run sent again until the old one had ended (IgnoreNew till then)
    # another data dir: the old agent's state folder is not this one's, so it cannot be asked to stop, and is ended
    assert old.wait(30) == -signal.SIGKILL and schtasks.running[AGENT_TASK] is not old
    assert schtasks.verbs().count(("/Run", AGENT_TASK)) >= 3
    assert moved.status().enabled
    stale = _windows(install, first, schtasks).status()
    assert not stale.enabled and any("runs another install or data dir" in line for line in stale.lines)


@pytest.mark.slow
def test_an_agent_that_refuses_to_start_is_said_at_enable_in_its_own_words(tmp_path: Path, install: Path,
                                                                           schtasks: FakeSchtasks) -> None:
    data_dir = joined_data_dir(tmp_path / "agent")
    AgentPaths.resolve(data_dir).settings_file.write_text('{"format_version": 1, "device": 7}')
    with pytest.raises(AutostartError, match=r"has not come up \(deskfleet-agent: error: .*device.*agent\.log"):
        _windows(install, data_dir, schtasks).enable()
    assert schtasks.running[AGENT_TASK].wait(30) == 2


def test_a_task_whose_path_the_console_cannot_print_still_reads_as_this_install(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """schtasks prints the XML in the console's code page: Łukasz comes back as ?ukasz in cp437; the digest in the
    description is what tells the task runs this install."""
    monkeypatch.setattr(autostart_module, "_console_code_page", lambda: "cp437")
    launch = Launch(Path("C:/Users/Łukasz/venv/Scripts/pythonw.exe"), ("-P", "-m", "deskfleet.agent", "--headless"))
    xml = task_xml(task_description("agent", launch), launch, USER, 7, None, tmp_path)
    action = read_query_xml(xml.encode("cp437", errors="replace"))
    assert action.command.startswith("C:/Users/?ukasz") and action.made_here and action.runs(launch)
    assert not action.runs(Launch(launch.program, ("-P", "-m", "deskfleet.agent", "tray")))

    edited = read_query_xml(xml.replace("Scripts/pythonw.exe", "Scripts/other.exe").encode("utf-8"))
    assert edited.made_here and not edited.runs(launch)  # changed in Task Scheduler since: the digest is not enough


def test_the_end_of_an_agent_is_read_from_the_log_it_wrote_after_the_run(tmp_path: Path) -> None:
    from deskfleet.agent.autostart_windows import _refusal_in

    log = tmp_path / "agent.log"
    log.write_text("deskfleet-agent: error: an old refusal\n" + "x" * 500 + "\n")
    start = log.stat().st_size
    assert _refusal_in(log, start) is None
    with log.open("a") as handle:
        handle.write("12:00 INFO starting\nTraceback (most recent call last):\n  File x\nRuntimeError: a bug\n")
    assert _refusal_in(log, start) == "RuntimeError: a bug"  # a crash ends the wait too, in its last line
    log.write_text("deskfleet-agent: error: the settings file is refused\n")  # rolled over as the agent started
    assert _refusal_in(log, start) == "deskfleet-agent: error: the settings file is refused"


def test_a_task_not_made_by_autostart_is_left_as_it_is(tmp_path: Path, install: Path,
                                                       schtasks: FakeSchtasks) -> None:
    windows = _windows(install, joined_data_dir(tmp_path / "agent"), schtasks)
    foreign = task_file_bytes(task_xml("the admin's own", Launch(Path("C:/agent.exe"), ()), USER, 7, None, tmp_path))
    schtasks.tasks[AGENT_TASK] = foreign
    for action in (windows.enable, windows.disable):
        with pytest.raises(AutostartError, match="was not made by `deskfleet-agent autostart`"):
            action()
    assert schtasks.tasks == {AGENT_TASK: foreign} and schtasks.verbs() == []
    assert "agent: task \\deskfleet-agent was not made by `deskfleet-agent autostart`: it is the admin's" in \
        windows.status().lines


def test_a_percent_sign_that_task_scheduler_would_expand_is_refused(tmp_path: Path, install: Path,
                                                                    schtasks: FakeSchtasks) -> None:
    with pytest.raises(AutostartError, match="as an environment variable"):
        _windows(install, joined_data_dir(tmp_path / "100%agent"), schtasks).enable()
    assert schtasks.tasks == {}


def test_status_says_why_an_install_cannot_be_started(tmp_path: Path, install: Path, schtasks: FakeSchtasks) -> None:
    report = _windows(install, tmp_path / "100%agent", schtasks).status()
    assert not report.enabled and "as an environment variable" in report.lines[0]


def test_an_install_without_pythonw_is_refused(tmp_path: Path, install: Path, schtasks: FakeSchtasks) -> None:
    (install / "pythonw.exe").unlink()
    with pytest.raises(AutostartError, match=r"pythonw\.exe is not there"):
        _windows(install, joined_data_dir(tmp_path / "agent"), schtasks).enable()
    assert schtasks.tasks == {}
