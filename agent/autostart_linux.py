"""Autostart on Linux: the agent as a systemd user service, the tray as an XDG autostart entry.

The unit's directives are those of the shipped assets/systemd/deskfleet-agent.service (a test keeps them alike); its
ExecStart runs this install's Python. The service runs from the user's login to their logout (`loginctl
enable-linger USER` keeps it from boot). `enable` writes both files, reloads systemd's user manager, enables the
service and starts it, or restarts it where its command line changed (another install, another data dir); `disable`
stops it (SIGTERM: the agent's clean stop) and removes both.
"""

from __future__ import annotations

import re
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
from deskfleet.common.atomic_file import write_atomic

SERVICE = "deskfleet-agent.service"
ENDED = ("failed", "inactive")  # `systemctl is-active` of a service whose agent ended (a refusal: exit 2, no restart)
TRAY_ENTRY = "deskfleet-tray.desktop"
SYSTEMD_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")  # what ExecStart takes unquoted (% still doubled)
UNSAFE_PROGRAM_CHARACTERS = set("'\"\\")  # systemd's string_is_safe(), for ExecStart's program
# what the Desktop Entry spec reserves in an Exec argument: such an argument is quoted
DESKTOP_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")
DESKTOP_ESCAPED_IN_QUOTES = set('"`$\\')
MISREAD_BY_GENERATOR = set("%$\\")  # see desktop_entry

UNIT_BODY = """\
[Unit]
Description=deskfleet agent: hosts model stages for the office's fleet
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={exec_start}
KillSignal=SIGTERM
TimeoutStopSec=20
Restart=on-failure
RestartSec=30
RestartPreventExitStatus=2
Nice=10

[Install]
WantedBy=default.target
"""

ENTRY_BODY = """\
[Desktop Entry]
Type=Application
Name=deskfleet
Comment=This PC's deskfleet agent: what it does for the office's fleet, and a toggle to pause it
Exec={exec_line}
Terminal=false
NoDisplay=true
X-GNOME-Autostart-enabled=true
"""


def systemd_unit(launch: Launch) -> str:
    """The user service that runs `launch` (the agent, headless). AutostartError where systemd would refuse it."""
    return (f"# Written by `{MARK} enable`; `{MARK} disable` removes it, and edits are lost at the\n"
            "# next enable. Each option's reason: the shipped assets/systemd/deskfleet-agent.service.\n"
            + UNIT_BODY.format(exec_start=exec_start(launch)))


def desktop_entry(launch: Launch) -> str:
    """The XDG autostart entry that runs `launch` (the tray) when the desktop session starts. AutostartError for a
    word with `%`, `$` or `\\`: GNOME and KDE on systemd start autostart entries through
    systemd-xdg-autostart-generator, which (systemd 252) reads none of them as the Desktop Entry spec says: `%%`
    stays two characters (the program is not found), a backslash is lost, and `\\$` reaches the unit as an escape
    systemd does not know."""
    misread = [word for word in launch.argv if MISREAD_BY_GENERATOR.intersection(word)]
    if misread:
        raise AutostartError(f"the tray's command holds {misread[0]!r}, whose %, $ or \\ the desktop's autostart "
                             "(systemd-xdg-autostart-generator) misreads: install deskfleet and keep its data dir in "
                             "folders whose names have none")
    return (f"# Written by `{MARK} enable`; `{MARK} disable` removes it, and edits are lost at the\n"
            "# next enable.\n"
            + ENTRY_BODY.format(exec_line=" ".join(desktop_word(word) for word in launch.argv)))


def exec_start(launch: Launch) -> str:
    """ExecStart's value. systemd refuses a program whose path holds a quote or a backslash ("Executable name contains
    special characters"), and expands no variable in it, so its `$` stays single."""
    program = str(launch.program)
    if UNSAFE_PROGRAM_CHARACTERS.intersection(program):
        raise AutostartError(f"systemd refuses to run a program whose path holds a quote or a backslash: {program}; "
                             "install deskfleet in a folder whose path has none")
    return " ".join([systemd_word(program, variables=False), *(systemd_word(word) for word in launch.arguments)])


def systemd_word(word: str, variables: bool = True) -> str:
    """One word of an ExecStart line, as systemd splits and expands it back: `%` is a specifier and `$` a variable
    (each doubled to be itself; `variables`: False for the program, where none is expanded), whitespace and quotes
    need double quotes, inside which `\\` and `"` are escaped."""
    _refuse_line_breaks(word)
    word = word.replace("%", "%%")
    if variables:
        word = word.replace("$", "$$")
    if SYSTEMD_PLAIN_WORD.fullmatch(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def desktop_word(word: str) -> str:
    """One argument of a desktop entry's Exec key (the Desktop Entry spec): `%` doubled (field codes), an argument
    with a reserved character double-quoted with `"`, `` ` ``, `$` and `\\` escaped, then every backslash escaped
    again, the rule of the file's string values, which is applied before the quoting."""
    _refuse_line_breaks(word)
    word = word.replace("%", "%%")
    if word and not DESKTOP_RESERVED.intersection(word):
        return word
    quoted = '"' + "".join("\\" + char if char in DESKTOP_ESCAPED_IN_QUOTES else char for char in word) + '"'
    return quoted.replace("\\", "\\\\")


def _refuse_line_breaks(word: str) -> None:
    if "\n" in word or "\r" in word:
        raise AutostartError(f"{word!r} holds a line break, which a service's command line cannot: install deskfleet "
                             "and keep its data dir in folders whose names have none")


class LinuxAutostart:
    """The systemd user service and the XDG autostart entry under `config_home` (~/.config)."""

    def __init__(self, target: AutostartTarget, state_dir: Path, config_home: Path, run: Runner) -> None:
        self.target = target
        self.state_dir = state_dir
        self.unit_file = config_home / "systemd" / "user" / SERVICE
        self.entry_file = config_home / "autostart" / TRAY_ENTRY
        self.run = run

    def enable(self) -> list[str]:
        unit = systemd_unit(self.target.agent())
        entry = desktop_entry(self.target.tray())
        unit_before = self._ours(self.unit_file)  # both refused before either is written
        self._ours(self.entry_file)
        check_launch(self.target, self.run)
        self._systemctl("show-environment")  # the user's manager answers: nothing is written where none runs
        installed = self._systemctl("show", "--property=FragmentPath", "--value", SERVICE).strip()
        # ~/.config/systemd/user comes before /etc/systemd/user: a unit written there would hide the admin's
        if installed and Path(installed).resolve() != self.unit_file.resolve() and Path(installed).exists():
            raise AutostartError(f"a {SERVICE} is installed already, at {installed} (the admin's?): autostart leaves "
                                 f"it as it is; use it (`systemctl --user enable --now {SERVICE}`) or remove it")
        if (pid := agent_running_pid(self.state_dir)) is not None and pid != self._service_pid():
            raise AutostartError(f"an agent already runs on this data dir (pid {pid}), not as the service: stop it "
                                 "(`deskfleet-agent stop`, with the same --data-dir) and enable again, or the service "
                                 "would find its data dir taken")
        for path, text in ((self.unit_file, unit), (self.entry_file, entry)):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, text.encode("utf-8"))
            except OSError as error:
                raise AutostartError(f"cannot write {path}: {error.strerror or error}") from None
        self._systemctl("daemon-reload")
        self._systemctl("enable", SERVICE)
        changed = unit_before is not None and unit_before != unit
        self._systemctl("restart" if changed else "start", SERVICE)
        pid = wait_for_agent(self.state_dir, lambda: self._systemctl_word("is-active", SERVICE) in ENDED)
        if pid is None:
            raise AutostartError(f"autostart is set up, but the agent has not come up (its service is "
                                 f"{self._systemctl_word('is-active', SERVICE)}): its log says why: `journalctl "
                                 f"--user -u {SERVICE}`")
        return [f"The agent runs as the systemd user service {SERVICE} ({self.unit_file}), "
                f"{'restarted on its new command line' if changed else 'running'} (pid {pid}); from now on it starts "
                "at your login and stops at your logout (`loginctl enable-linger` keeps it running from boot).",
                f"Its log: journalctl --user -u {SERVICE}",
                f"The tray starts with your desktop session ({self.entry_file}); to show it now: "
                f"{self.target.tray_command()}"]

    def disable(self) -> list[str]:
        unit = self._ours(self.unit_file)
        entry = self._ours(self.entry_file)
        lines = []
        if unit is not None:
            self._systemctl("disable", "--now", SERVICE)  # stops it: SIGTERM, the agent's clean stop
            self._remove(self.unit_file)
            self._systemctl("daemon-reload")
            lines.append(f"The agent's service is stopped and no longer starts at login ({self.unit_file} removed).")
        else:
            lines.append(f"The agent did not start at login ({self.unit_file} is not there): nothing to stop.")
        if entry is not None:
            self._remove(self.entry_file)
            lines.append(f"The tray no longer starts with the desktop session ({self.entry_file} removed); one "
                         "showing now stays until it is quit.")
        else:
            lines.append(f"The tray did not start with the desktop session ({self.entry_file} is not there).")
        return lines

    def status(self) -> AutostartReport:
        try:
            wanted_unit, wanted_entry = systemd_unit(self.target.agent()), desktop_entry(self.target.tray())
        except AutostartError as error:  # what enable refuses: nothing can start this install and data dir
            return AutostartReport(False, [f"autostart cannot start this install and data dir: {error}"])
        lines: list[str] = []
        unit_wanted = self._file_status(lines, "agent", self.unit_file, wanted_unit, "ExecStart", "at login")
        agent_on = False
        if unit_wanted is not None:
            enabled = self._systemctl_word("is-enabled", SERVICE)
            active = self._systemctl_word("is-active", SERVICE)
            lines.append(f"  systemd user service {SERVICE}: {enabled}, {active}")
            if active == "failed":
                lines.append(f"  its log says why: journalctl --user -u {SERVICE}")
            agent_on = unit_wanted and enabled == "enabled" and active == "active"
        tray_on = self._file_status(lines, "tray", self.entry_file, wanted_entry, "Exec", "with the desktop session")
        return AutostartReport(agent_on and tray_on is True, lines)

    def _file_status(self, lines: list[str], name: str, path: Path, wanted: str, command_key: str,
                     when: str) -> bool | None:
        """Say how the unit or the entry stands: None where there is none of `enable`'s, else whether it is the one
        `enable` would write now (this install, this data dir)."""
        text = self._ours(path, refuse=False)
        if text is None:
            lines.append(f"{name}: does not start {when} ({path} is not there)")
            return None
        if not written_here(text):
            lines.append(f"{name}: {path} was not written by `{MARK}`: it is the admin's")
            return None
        lines.append(f"{name}: starts {when} ({path})")
        if text != wanted:
            lines.append(f"  it runs another install or data dir: {_key(text, command_key)}; `{MARK} enable` points "
                         "it at this one")
        return text == wanted

    def _ours(self, path: Path, refuse: bool = True) -> str | None:
        """The file's text (None where there is none); AutostartError where this command did not write it."""
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        except OSError as error:
            raise AutostartError(f"cannot read {path}: {error.strerror or error}") from None
        if refuse and not written_here(text):
            raise AutostartError(f"{path} was not written by `{MARK}` (a copy of the shipped unit or entry?): it is "
                                 "left as it is; remove it (for the unit, `systemctl --user disable --now "
                                 f"{SERVICE}` first) to let autostart manage the agent, or keep managing it by hand")
        return text

    def _remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            raise AutostartError(f"cannot remove {path}: {error.strerror or error}") from None

    def _systemctl(self, *arguments: str) -> str:
        argv = ["systemctl", "--user", *arguments]
        try:
            done = self.run(argv)
        except FileNotFoundError:
            raise AutostartError("systemctl is not on this PC: autostart on Linux needs systemd; start "
                                 "`deskfleet-agent --headless` at login another way") from None
        if done.returncode != 0:
            raise AutostartError(f"`{' '.join(argv)}` failed: {said_by(done)} (run autostart in the user's own login "
                                 "session, not under sudo or su: it sets up that user's service manager)")
        return output_text(done.stdout)

    def _systemctl_word(self, *arguments: str) -> str:
        """is-enabled / is-active's answer, which exits non-zero for every answer but yes."""
        try:
            done = self.run(["systemctl", "--user", *arguments])
        except FileNotFoundError:
            return "unknown (no systemctl)"
        words = output_text(done.stdout).split()
        return words[0] if words else f"unknown ({said_by(done)})"

    def _service_pid(self) -> int:
        text = self._systemctl("show", "--property=MainPID", "--value", SERVICE).strip()
        return int(text) if text.isdigit() else 0


def written_here(text: str) -> bool:
    """Whether `enable` wrote this unit or entry: its first line says so (the shipped ones name it further down)."""
    return MARK in text.partition("\n")[0]


def _key(text: str, key: str) -> str:
    return next((line.partition("=")[2] for line in text.splitlines() if line.startswith(f"{key}=")), "(none)")
