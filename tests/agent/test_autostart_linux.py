"""`deskfleet-agent autostart` on Linux: the unit and the autostart entry it writes, and the whole command against a
stand-in `systemctl` (this machine runs no systemd user manager) whose start this test carries out as the manager
would, with a real agent process: enable starts it, status sees it, disable stops it cleanly."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deskfleet.agent.autostart import (
    MARK,
    AutostartError,
    AutostartTarget,
    Launch,
    autostart_for_this_pc,
    config_home,
    run_command,
)
from deskfleet.agent.autostart_linux import (
    SERVICE,
    TRAY_ENTRY,
    LinuxAutostart,
    desktop_entry,
    desktop_word,
    systemd_unit,
    systemd_word,
)
from deskfleet.agent.cli import build_parser
from deskfleet.agent.enroll import Membership
from deskfleet.agent.paths import AgentPaths, AgentSettings, save_settings
from deskfleet.common import pki
from tests.fleet_pki import make_ca, make_member
from tests.ports import free_address

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="systemd and XDG autostart are Linux's")

ASSET_UNIT = Path(__file__).resolve().parents[2] / "assets" / "systemd" / "deskfleet-agent.service"
ASSET_ENTRY = Path(__file__).resolve().parents[2] / "assets" / "autostart" / "deskfleet-tray.desktop"

# The stand-in systemctl: it keeps what was enabled, and hands start and stop to the test (the "manager"), which runs
# the unit's ExecStart as systemd would and answers is-active and MainPID from the process it runs.
FAKE_SYSTEMCTL = r'''
import json, os, sys, time
from pathlib import Path
folder = Path(os.environ["FAKE_SYSTEMD"])
args = sys.argv[1:]
with open(folder / "calls", "a") as calls:
    calls.write(" ".join(args) + "\n")
if (folder / "no-bus").exists():
    print("Failed to connect to bus: No medium found", file=sys.stderr)
    sys.exit(1)
assert args[0] == "--user", args
verb, rest = args[1], args[2:]
state = json.loads((folder / "state.json").read_text()) if (folder / "state.json").exists() else {}
pid = int((folder / "pid").read_text()) if (folder / "pid").exists() else 0
if verb in ("start", "restart", "disable") and (verb != "disable" or "--now" in rest):
    request = "stop" if verb == "disable" else verb
    (folder / "request").write_text(request)
    deadline = time.monotonic() + 60
    while (folder / "request").exists():  # the manager carries it out
        assert time.monotonic() < deadline, "the test's manager did not answer"
        time.sleep(0.05)
if verb == "enable":
    state["enabled"] = True
if verb == "disable":
    state["enabled"] = False
(folder / "state.json").write_text(json.dumps(state))
if verb == "is-enabled":
    print("enabled" if state.get("enabled") else "disabled")
    sys.exit(0 if state.get("enabled") else 1)
if verb == "is-active":
    print("active" if pid else state.get("ended", "inactive"))
    sys.exit(0 if pid else 3)
if verb == "show" and "--property=MainPID" in rest:
    print(pid)
if verb == "show" and "--property=FragmentPath" in rest:  # where the unit systemd would load is
    unit = Path(os.environ["XDG_CONFIG_HOME"]) / "systemd" / "user" / rest[-1]
    elsewhere = folder / "fragment"
    print(elsewhere.read_text() if elsewhere.exists() else unit if unit.exists() else "")
'''


class FakeUserManager:
    """What systemd's user manager does for one service here: run ExecStart at a start, SIGTERM it at a stop."""

    def __init__(self, folder: Path, config: Path) -> None:
        self.folder = folder
        self.unit_file = config / "systemd" / "user" / SERVICE
        self.process: subprocess.Popen[bytes] | None = None
        self.exit_statuses: list[int] = []
        self.log = folder / "agent.log"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeUserManager:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._end()

    def calls(self) -> list[str]:
        path = self.folder / "calls"
        return path.read_text().splitlines() if path.exists() else []

    def _serve(self) -> None:
        request = self.folder / "request"
        while not self._stop.is_set():
            if request.exists():
                what = request.read_text()
                if what in ("stop", "restart"):
                    self._end()
                if what in ("start", "restart") and self.process is None:
                    self._start()
                request.unlink()
            if self.process is not None and self.process.poll() is not None:  # ended on its own: failed
                self._reap("failed")
            time.sleep(0.05)

    def _start(self) -> None:
        unit = configparser.ConfigParser(interpolation=None)
        unit.optionxform = str  # type: ignore[assignment,method-assign]
        unit.read_string(self.unit_file.read_text())
        argv = shlex.split(unit["Service"]["ExecStart"])  # the paths here hold nothing systemd would read otherwise
        environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        self.process = subprocess.Popen(argv, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=environment,
                                        cwd=Path.home())
        (self.folder / "pid").write_text(str(self.process.pid))

    def _end(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # KillSignal=SIGTERM
            self.process.wait(30)
        if self.process is not None:
            self._reap("inactive")

    def _reap(self, state: str) -> None:
        assert self.process is not None
        self.exit_statuses.append(self.process.wait())
        self.process = None
        (self.folder / "pid").unlink(missing_ok=True)
        state_file = self.folder / "state.json"
        saved = json.loads(state_file.read_text()) if state_file.exists() else {}
        state_file.write_text(json.dumps({**saved, "ended": state}))


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, str], FakeUserManager]]:
    """A login session's environment with the stand-in systemctl first on PATH, and its manager running."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SYSTEMCTL}")
    fake.chmod(0o755)
    systemd = tmp_path / "systemd"
    systemd.mkdir()
    config = tmp_path / "config"
    environment = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SYSTEMD": str(systemd),
                   "XDG_CONFIG_HOME": str(config)}
    environment.pop("PYTHONPATH", None)
    with FakeUserManager(systemd, config) as manager:
        yield environment, manager


def joined_data_dir(data_dir: Path) -> Path:
    """A data dir that joined a fleet whose controller is not there (the agent serves meanwhile), listening on a free
    loopback port (no mDNS)."""
    paths = AgentPaths.resolve(data_dir)
    files = make_member(make_ca(data_dir.parent / f"{data_dir.name}-ca"), paths.state_dir, "agent")
    paths.state_dir.chmod(0o700)
    Membership(pki.fleet_id(files.ca_certificate()), files.own_identity().agent_id, "c" * 52,
               ("127.0.0.1:1",)).save(paths.state_dir)
    paths.settings_dir.mkdir(parents=True, exist_ok=True)
    save_settings(paths.settings_file, AgentSettings(listen_address=free_address()))
    return data_dir


def autostart(environment: dict[str, str], *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deskfleet.agent", "autostart", *arguments], env=environment,
                          capture_output=True, text=True, timeout=180, check=False)


# Quoting

@pytest.mark.parametrize(("word", "written"), [
    ("/usr/bin/python3", "/usr/bin/python3"),
    ("--data-dir", "--data-dir"),
    ("/home/John Smith/agent", '"/home/John Smith/agent"'),
    ("/srv/100%", "/srv/100%%"),  # a specifier otherwise: %h is the home folder
    ("/srv/$HOME", '"/srv/$$HOME"'),  # a variable otherwise
    ('/srv/say "hi"', '"/srv/say \\"hi\\""'),
    ("/srv/back\\slash", '"/srv/back\\\\slash"'),
])
def test_an_execstart_word_is_written_as_systemd_reads_it_back(word: str, written: str) -> None:
    assert systemd_word(word) == written


@pytest.mark.parametrize(("word", "written"), [
    ("/usr/bin/python3", "/usr/bin/python3"),
    ("/home/John Smith/agent", '"/home/John Smith/agent"'),
    ("/srv/100%", "/srv/100%%"),  # a field code otherwise
    ("/srv/$HOME", '"/srv/\\\\$HOME"'),  # quoted (reserved), `$` escaped, then the backslash escaped as a string's
    ("/srv/back\\slash", '"/srv/back\\\\\\\\slash"'),
    ("", '""'),
])
def test_an_exec_argument_is_written_as_the_desktop_entry_spec_reads_it_back(word: str, written: str) -> None:
    assert desktop_word(word) == written


def test_a_path_with_a_line_break_is_refused() -> None:
    for quote in (systemd_word, desktop_word):
        with pytest.raises(AutostartError, match="line break"):
            quote("/srv/two\nlines")


@pytest.mark.parametrize("folder", ["John's", 'say "hi"', "back\\slash"])
def test_a_program_path_that_systemd_refuses_is_refused_here(folder: str) -> None:
    """systemd-analyze verify: "Executable name contains special characters" (the arguments may hold them)."""
    with pytest.raises(AutostartError, match="quote or a backslash"):
        systemd_unit(Launch(Path(f"/home/{folder}/venv/bin/python"), ("-m", "deskfleet.agent")))
    assert "John's" in systemd_unit(Launch(Path("/venv/bin/python"), ("--data-dir", "/home/John's")))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_finds_the_program_of_a_unit_whose_path_needs_quoting(tmp_path: Path) -> None:
    """systemd-analyze verify parses the unit as systemd does, and checks that ExecStart's program exists."""
    folder = tmp_path / "John Smith 100% $HOME venv"
    folder.mkdir()
    program = folder / "python"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    unit = tmp_path / SERVICE
    unit.write_text(systemd_unit(Launch(program, ("-m", "deskfleet.agent", "--headless"))))
    verified = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert verified.returncode == 0, verified.stderr
    program.unlink()  # the check that it ran: with the program gone, it is named
    verified = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False)
    assert verified.returncode != 0 and str(program) in verified.stderr


# What is written

def _ini(text: str) -> configparser.ConfigParser:
    parsed = configparser.ConfigParser(strict=False, interpolation=None)
    parsed.optionxform = str  # type: ignore[assignment,method-assign]
    parsed.read_string(text)
    return parsed


def test_the_written_unit_and_entry_hold_the_shipped_ones_options_and_run_this_install(tmp_path: Path) -> None:
    target = AutostartTarget.this_install(tmp_path / "agent")
    unit, shipped_unit = _ini(systemd_unit(target.agent())), _ini(ASSET_UNIT.read_text(encoding="utf-8"))
    entry, shipped_entry = _ini(desktop_entry(target.tray())), _ini(ASSET_ENTRY.read_text(encoding="utf-8"))
    for written, shipped, command in ((unit, shipped_unit, ("Service", "ExecStart")),
                                      (entry, shipped_entry, ("Desktop Entry", "Exec"))):
        assert written.sections() == shipped.sections()
        for section in written.sections():
            options = {key: value for key, value in written[section].items() if (section, key) != command}
            assert options == {key: value for key, value in shipped[section].items() if (section, key) != command}
    program, *arguments = shlex.split(unit["Service"]["ExecStart"])
    assert program == sys.executable and arguments[:3] == ["-P", "-m", "deskfleet.agent"]
    parsed = build_parser().parse_args(arguments[3:])
    assert parsed.headless and parsed.data_dir == (tmp_path / "agent").resolve()
    program, *arguments = shlex.split(entry["Desktop Entry"]["Exec"])
    parsed = build_parser().parse_args(arguments[3:])
    assert program == sys.executable and parsed.command == "tray"
    assert parsed.command_data_dir == (tmp_path / "agent").resolve()


def test_a_system_other_than_linux_and_windows_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(AutostartError, match="made for Linux and Windows, not darwin"):
        autostart_for_this_pc(AutostartTarget.this_install(None), tmp_path, platform="darwin")


def test_the_config_folder_is_xdg_config_home_when_absolute() -> None:
    assert config_home({"XDG_CONFIG_HOME": "/etc/u", "HOME": "/home/u"}) == Path("/etc/u")
    assert config_home({"XDG_CONFIG_HOME": "relative", "HOME": "/home/u"}) == Path("/home/u/.config")
    assert config_home({"HOME": "/home/u"}) == Path("/home/u/.config")


# The command, end to end

@pytest.mark.slow
def test_enable_starts_the_agent_status_sees_it_and_disable_stops_it_cleanly(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    environment, manager = session
    data_dir = joined_data_dir(tmp_path / "agent")
    off = autostart(environment, "status", "--data-dir", str(data_dir))
    assert off.returncode == 3 and "does not start at login" in off.stdout

    enabled = autostart(environment, "enable", "--data-dir", str(data_dir))
    assert enabled.returncode == 0, enabled.stderr + manager.log.read_text(errors="replace")
    assert manager.process is not None and f"(pid {manager.process.pid})" in enabled.stdout
    calls = manager.calls()
    assert calls.index("--user daemon-reload") < calls.index(f"--user enable {SERVICE}") < \
        calls.index(f"--user start {SERVICE}")
    status = autostart(environment, "status", "--data-dir", str(data_dir))
    assert status.returncode == 0, status.stdout
    assert f"{SERVICE}: enabled, active" in status.stdout and "starts with the desktop session" in status.stdout

    again = autostart(environment, "enable", "--data-dir", str(data_dir))  # nothing changed: the agent runs on
    assert again.returncode == 0, again.stderr
    assert f"--user restart {SERVICE}" not in manager.calls() and manager.exit_statuses == []

    disabled = autostart(environment, "disable", "--data-dir", str(data_dir))
    assert disabled.returncode == 0, disabled.stderr
    assert manager.exit_statuses == [0]  # SIGTERM: the agent's clean stop
    config = Path(environment["XDG_CONFIG_HOME"])
    assert not (config / "systemd" / "user" / SERVICE).exists() and not (config / "autostart" / TRAY_ENTRY).exists()
    assert autostart(environment, "status", "--data-dir", str(data_dir)).returncode == 3


@pytest.mark.slow
def test_enable_on_another_data_dir_restarts_the_service_on_it(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    environment, manager = session
    first, second = joined_data_dir(tmp_path / "first"), joined_data_dir(tmp_path / "second")
    assert autostart(environment, "enable", "--data-dir", str(first)).returncode == 0
    moved = autostart(environment, "enable", "--data-dir", str(second))
    assert moved.returncode == 0, moved.stderr
    assert "restarted on its new command line" in moved.stdout and manager.exit_statuses == [0]
    status = autostart(environment, "status", "--data-dir", str(first))  # the first one's: pointed elsewhere now
    assert status.returncode == 3 and f"--data-dir {second.resolve()}" in status.stdout
    assert autostart(environment, "disable", "--data-dir", str(second)).returncode == 0


@pytest.mark.slow
def test_an_agent_that_refuses_to_start_is_said_at_enable(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    environment, manager = session
    data_dir = joined_data_dir(tmp_path / "agent")
    (AgentPaths.resolve(data_dir).settings_file).write_text('{"format_version": 1, "device": 7}')
    refused = autostart(environment, "enable", "--data-dir", str(data_dir))
    assert refused.returncode == 2
    assert "the agent has not come up (its service is failed)" in refused.stderr
    assert f"journalctl --user -u {SERVICE}" in refused.stderr
    assert manager.exit_statuses == [2]  # the agent's refusal, which the unit does not restart
    status = autostart(environment, "status", "--data-dir", str(data_dir))
    assert status.returncode == 3 and "enabled, failed" in status.stdout and "its log says why" in status.stdout


# Refusals: each before anything is written or started

def test_enable_refuses_a_pc_that_has_not_joined(tmp_path: Path,
                                                 session: tuple[dict[str, str], FakeUserManager]) -> None:
    environment, manager = session
    refused = autostart(environment, "enable", "--data-dir", str(tmp_path / "agent"))
    assert refused.returncode == 2 and "has not joined a fleet" in refused.stderr
    assert "join - --data-dir" in refused.stderr and manager.calls() == []


def _linux(tmp_path: Path, session: tuple[dict[str, str], FakeUserManager], data_dir: Path) -> LinuxAutostart:
    environment, _ = session

    def run(argv: list[str] | tuple[str, ...]) -> subprocess.CompletedProcess[bytes]:
        if argv[0] == "systemctl":
            argv = [str(tmp_path / "bin" / "systemctl"), *argv[1:]]
        return subprocess.run(list(argv), capture_output=True, env=environment, timeout=60, check=False) \
            if argv[0] != sys.executable else run_command(argv)

    target = AutostartTarget.this_install(data_dir)
    return LinuxAutostart(target, AgentPaths.resolve(data_dir).state_dir, Path(environment["XDG_CONFIG_HOME"]), run)


def test_a_unit_file_not_written_by_autostart_is_left_as_it_is(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    _, manager = session
    autostart_of = _linux(tmp_path, session, joined_data_dir(tmp_path / "agent"))
    autostart_of.unit_file.parent.mkdir(parents=True)
    shutil.copy(ASSET_UNIT, autostart_of.unit_file)  # the shipped unit, installed by hand
    for action in (autostart_of.enable, autostart_of.disable):
        with pytest.raises(AutostartError, match="was not written by `deskfleet-agent autostart`"):
            action()
    assert autostart_of.unit_file.read_bytes() == ASSET_UNIT.read_bytes()
    assert not autostart_of.entry_file.exists() and manager.calls() == []
    assert any("it is the admin's" in line for line in autostart_of.status().lines)


def test_a_unit_the_admin_installed_elsewhere_is_not_hidden(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    """~/.config/systemd/user comes before /etc/systemd/user: a unit written there would hide the admin's."""
    _, manager = session
    admins = tmp_path / "etc" / "systemd" / "user" / SERVICE  # /etc/systemd/user's, here
    admins.parent.mkdir(parents=True)
    shutil.copy(ASSET_UNIT, admins)
    (manager.folder / "fragment").write_text(str(admins))
    autostart_of = _linux(tmp_path, session, joined_data_dir(tmp_path / "agent"))
    with pytest.raises(AutostartError, match=f"installed already, at {admins}"):
        autostart_of.enable()
    assert not autostart_of.unit_file.exists() and not autostart_of.entry_file.exists()


def test_nothing_is_written_where_the_user_manager_cannot_be_reached(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    _, manager = session
    (manager.folder / "no-bus").touch()  # under sudo or su, or over ssh without a session
    autostart_of = _linux(tmp_path, session, joined_data_dir(tmp_path / "agent"))
    with pytest.raises(AutostartError, match=r"Failed to connect to bus.*not under sudo or su"):
        autostart_of.enable()
    assert not autostart_of.unit_file.exists() and not autostart_of.entry_file.exists()


def test_enable_refuses_where_an_agent_already_runs_on_the_data_dir_outside_the_service(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    data_dir = joined_data_dir(tmp_path / "agent")
    log = tmp_path / "by-hand.log"
    by_hand = subprocess.Popen([sys.executable, "-m", "deskfleet.agent", "--headless", "--data-dir", str(data_dir)],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        autostart_of = _linux(tmp_path, session, data_dir)
        from deskfleet.agent.autostart import agent_running_pid

        deadline = time.monotonic() + 60
        while agent_running_pid(autostart_of.state_dir) != by_hand.pid:
            assert by_hand.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        with pytest.raises(AutostartError, match=f"already runs on this data dir \\(pid {by_hand.pid}\\)"):
            autostart_of.enable()
        assert not autostart_of.unit_file.exists()
    finally:
        by_hand.send_signal(signal.SIGTERM)
        assert by_hand.wait(30) == 0


def test_a_python_that_cannot_run_deskfleet_on_its_own_is_refused(
        tmp_path: Path, session: tuple[dict[str, str], FakeUserManager]) -> None:
    data_dir = joined_data_dir(tmp_path / "agent")
    autostart_of = _linux(tmp_path, session, data_dir)
    bare = tmp_path / "bare"  # a venv without deskfleet: importable here only through this shell's PYTHONPATH
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    autostart_of.target = AutostartTarget.this_install(data_dir, str(bare / "bin" / "python"))
    with pytest.raises(AutostartError, match=r"fails outside this shell .*No module named 'deskfleet'"):
        autostart_of.enable()
    assert not autostart_of.unit_file.exists()


@pytest.mark.parametrize("folder", ["100%", "back\\slash", "$HOME"])
def test_a_tray_command_that_the_desktops_autostart_misreads_is_refused(folder: str) -> None:
    with pytest.raises(AutostartError, match="systemd-xdg-autostart-generator"):
        desktop_entry(Launch(Path("/venv/bin/python"), ("-m", "deskfleet.agent", "tray", "--data-dir",
                                                         f"/srv/{folder}")))


def test_status_says_why_an_install_cannot_be_started(tmp_path: Path,
                                                   session: tuple[dict[str, str], FakeUserManager]) -> None:
    environment, _ = session
    status = autostart(environment, "status", "--data-dir", str(tmp_path / "$agent"))
    assert status.returncode == 3 and "cannot start this install and data dir" in status.stdout


GENERATOR = Path("/usr/lib/systemd/user-generators/systemd-xdg-autostart-generator")


@pytest.mark.skipif(not GENERATOR.exists(), reason="needs systemd's xdg autostart generator")
def test_gnome_and_kde_on_systemd_start_the_tray_as_written(tmp_path: Path) -> None:
    """systemd-xdg-autostart-generator turns autostart entries into units: the one it makes runs the tray's words."""
    data_dir = tmp_path / "John Smith's data (2)"
    config = tmp_path / "config"
    (config / "autostart").mkdir(parents=True)
    (config / "autostart" / TRAY_ENTRY).write_text(desktop_entry(AutostartTarget.this_install(data_dir).tray()))
    out = tmp_path / "generated"
    out.mkdir()
    environment = {**os.environ, "XDG_CONFIG_HOME": str(config), "XDG_CONFIG_DIRS": str(tmp_path / "none")}
    subprocess.run([str(GENERATOR), str(out), str(out), str(out)], env=environment, check=True, capture_output=True)
    unit = _ini(next(out.glob("app-deskfleet*")).read_text())
    exec_start = unit["Service"]["ExecStart"]
    assert exec_start == f':{sys.executable} -P -m deskfleet.agent tray --data-dir "{data_dir}"'  # `:` no variables


def test_the_mark_is_on_the_first_line_of_what_is_written(tmp_path: Path) -> None:
    target = AutostartTarget.this_install(tmp_path)
    for text in (systemd_unit(target.agent()), desktop_entry(target.tray())):
        assert MARK in text.partition("\n")[0]
