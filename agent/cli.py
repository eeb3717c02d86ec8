"""`deskfleet-agent`: join a fleet, run the agent core headless, or show it in the tray. Parsing and dispatch only.

    deskfleet-agent join TOKEN|- [--data-dir D]
    deskfleet-agent --headless [--data-dir D] [--listen HOST:PORT]
    deskfleet-agent tray [--data-dir D]
    deskfleet-agent pause|resume [--data-dir D]
    deskfleet-agent autostart enable|disable|status [--data-dir D]
    deskfleet-agent --log-file FILE ...   (what a process with no console says: autostart's on Windows)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, cast

from deskfleet.common.arguments import (
    KeepsDashDashValues,
    describe_commands,
    line_of_text,
    option_arity,
    option_text,
    path_argument,
    unknown_options,
    verbose_anywhere,
)
from deskfleet.common.console import (
    ForgivingStream,
    WatchedStream,
    flush_stdout,
    forgiving_stderr,
    open_missing_stderr,
    silence_stdout,
    tolerate_unencodable,
    watched_stdout,
)
from deskfleet.common.launch import interruption, restore_default_signals
from deskfleet.common.os_error_text import os_error_text

if TYPE_CHECKING:
    from deskfleet.agent.paths import AgentPaths

log = logging.getLogger("deskfleet.agent")
# What only a controller's data dir holds (controller/fleet_store.py): an agent joined into one mixed the two
CONTROLLER_FILES = ("fleet.json", "ca-key.pem")
HOSTNAME_MAX_CHARS = 64  # what X.509 lets a common name be, where the CSR carries it
AUTOSTART_OFF_EXIT = 3  # `autostart status` where the agent or the tray does not start from here (as `systemctl
# is-active` says "inactive"): 1 and 2 are failures
LOG_ROLL_BYTES = 10 << 20  # --log-file: past this at start, the file is kept as FILE.1 and a new one begun


# Public methods

def main(argv: Sequence[str] | None = None) -> int:
    open_missing_stderr()
    tolerate_unencodable(sys.stdout, sys.stderr)  # hostnames and paths on a Windows code page
    with forgiving_stderr(), watched_stdout() as stdout:
        return _main(argv, stdout)


class AgentParser(KeepsDashDashValues):
    """argparse's, but an option no parser of the agent knows is named before any other error: `--data_dir D` read D
    as the command ("argument COMMAND: invalid choice: 'D'"), and the typo went unnamed. One before the command is
    named by the top-level parser, with its usage; one after it by the command's parser (`root` set), with the
    command's own, also where the command lacks an argument besides."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arguments: list[str] = []  # what the last parse_known_args was given
        self.root: AgentParser | None = None  # a command's: the parser of the whole line

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._arguments = list(sys.argv[1:] if args is None else args)
        if self.root is None:  # one before the command is the top-level's, said with its usage (as `deskfleet` does)
            commands = next(action.choices for action in self._actions
                            if isinstance(action, argparse._SubParsersAction))
            if before := unknown_options(self._arguments, option_arity(self), commands):
                self.error(f"unrecognized arguments: {' '.join(before)}")
        parsed, unknown = super().parse_known_args(self._arguments, namespace)
        if unknown and self.root is not None:  # said by the command, with its usage, not the top-level's
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed, unknown

    def error(self, message: str) -> NoReturn:
        whole = self.root or self
        unknown = unknown_options(whole._arguments, _options(whole))
        super().error(f"unrecognized arguments: {' '.join(unknown)}" if unknown else message)


def _options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Every option `parser` and its commands take, and whether it takes a value."""
    options = option_arity(parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                options.update(_options(command))
    return options


def build_parser() -> argparse.ArgumentParser:
    from deskfleet.agent.paths import DEFAULT_AGENT_PORT

    # allow_abbrev=False, as `deskfleet`'s: `--head` was taken for --headless and `join --host` for --hostname
    parser = AgentParser(
        prog="deskfleet-agent", allow_abbrev=False,
        description="The deskfleet agent of this PC: it hosts a stage of a model when the fleet's controller asks. "
                    "Once: `deskfleet-agent join -` (the token from `deskfleet fleet token` on standard input); then "
                    "run it with `deskfleet-agent --headless` (it runs in the foreground until Ctrl-C, SIGTERM or "
                    "SIGHUP), and `deskfleet-agent tray` in the user's desktop session shows it. Its user can "
                    "`pause` it (and `resume`) at any time, from the tray or a terminal.",
        usage="deskfleet-agent [-h] [-v] [--data-dir DIR] [--log-file FILE] "
              "(--headless [--listen HOST:PORT] | COMMAND ...)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    parser.add_argument("--headless", action="store_true",
                        help="run the agent (in the foreground, logging to standard error; `deskfleet-agent tray` "
                             "shows it in the desktop's tray)")
    parser.add_argument("--data-dir", type=path_argument, default=None, metavar="DIR",
                        help="keep settings, state (key, certificate) and shard cache under DIR (DIR/settings, "
                             "DIR/state, DIR/cache; default: the platform's config, state and cache folders); give "
                             "every command the same")
    parser.add_argument("--listen", default=None, metavar="HOST:PORT",
                        help="address to accept fleet links on (default: listen_address in the settings file, "
                             f"agent-settings.json in the settings folder, else 0.0.0.0:{DEFAULT_AGENT_PORT}: every "
                             "interface, IPv4 and IPv6, as [::] is; the agent announces itself over mDNS unless it "
                             "listens on loopback)")
    parser.add_argument("--log-file", type=path_argument, default=None, metavar="FILE",
                        help="append the log, and every error, to FILE instead of standard error (given before "
                             "the command; kept as FILE.1 "
                             f"once past {LOG_ROLL_BYTES >> 20} MB at a start); for a PC's agent started with no "
                             "console, as autostart starts it on Windows")
    # prog: each command's usage and errors begin `deskfleet-agent join`, not the top-level usage line
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", prog="deskfleet-agent")
    join = commands.add_parser("join", help="enroll this PC with a join token from the fleet's admin",
                               description="Enroll this PC with a join token from the fleet's admin (`deskfleet "
                                           "fleet token`), then start it with `deskfleet-agent --headless`.",
                               allow_abbrev=False)
    join.add_argument("token", help="the token printed by `deskfleet fleet token`; - reads it from standard "
                                    "input (a token on the command line shows in the process list and history)")
    join.add_argument("--data-dir", type=path_argument, default=None, dest="command_data_dir", metavar="DIR",
                      help="the agent's data dir (default: the platform's folders), as `--headless` will be given")
    join.add_argument("--hostname", type=_hostname_argument, default=None,
                      help="name to show the admin (default: this PC's)")
    for name, text in (("pause", "opt this PC out: it serves no model until `resume` (a stage it hosts is given "
                                 "up within seconds; the generation goes on without it)"),
                       ("resume", "end a pause: the next plan may use this PC again")):
        command = commands.add_parser(name, help=text, allow_abbrev=False)
        command.add_argument("--data-dir", type=path_argument, default=None, dest="command_data_dir", metavar="DIR",
                             help="the agent's data dir, as given to `join` and `--headless`")
    stop = commands.add_parser("stop", allow_abbrev=False,
                               help="stop the agent running on this data dir, as Ctrl-C would (its stages given up, "
                                    "its links closed): also one with no console, started by autostart on Windows",
                               description="Ask the agent running on this data dir to stop, and wait for it (up to "
                                           "20 s). Autostart, where enabled, starts it again: at the next login, and "
                                           "on Windows within 5 minutes; `autostart disable` stops it for good.")
    stop.add_argument("--data-dir", type=path_argument, default=None, dest="command_data_dir", metavar="DIR",
                      help="the agent's data dir, as given to `join` and `--headless`")
    tray = commands.add_parser("tray", help="show this PC's agent in the desktop's system tray, with the pause "
                                            "toggle (the agent runs on its own: quitting the tray leaves it running)",
                               allow_abbrev=False)
    tray.add_argument("--data-dir", type=path_argument, default=None, dest="command_data_dir", metavar="DIR",
                      help="the agent's data dir, as given to `join` and `--headless`")
    autostart = commands.add_parser(
        "autostart", allow_abbrev=False,
        help="start this PC's agent and its tray with the user's session, from this install (Linux: a systemd "
             "user service and an autostart entry; Windows: two logon tasks), or stop doing so",
        description="enable: start the agent now and at every login, and the tray with the desktop session, from the "
                    "Python this command runs in; disable: stop the agent and take both away; status: say what "
                    "starts (exit 0 when both start from this install and data dir and the agent runs, 3 when "
                    "not).")
    autostart.add_argument("action", choices=("enable", "disable", "status"), help="enable, disable or status")
    autostart.add_argument("--data-dir", type=path_argument, default=None, dest="command_data_dir", metavar="DIR",
                           help="the agent's data dir, as given to `join`")
    for command in commands.choices.values():
        cast(AgentParser, command).root = parser
    describe_commands(parser)
    verbose_anywhere(parser)
    return parser


# Private methods

def _main(argv: Sequence[str] | None, stdout: WatchedStream | None) -> int:
    try:  # numpy and asyncio come with these: a Ctrl-C meanwhile ends the command as it does later
        errors = _command_errors()
    except KeyboardInterrupt:
        return 130
    parser = build_parser()
    args = parser.parse_args(argv)
    _settle_command_options(parser, args)
    restore_default_signals()  # SIGTERM / SIGHUP: the launcher's while the modules loaded, the agent's from here
    try:
        log = _open_log_file(args.log_file)
    except OSError as error:
        print(f"deskfleet-agent: error: cannot write the log file {args.log_file}: {os_error_text(error)}",
              file=sys.stderr)
        return 2
    with _standard_error_to(log) as descriptor:
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if not args.verbose:  # websockets says "connection open" and "connection closed" at info for every link:
            logging.getLogger("websockets").setLevel(logging.WARNING)  # three lines per `fleet ls`, per PC, for days
        return _run(parser, args, argv, stdout, errors, descriptor)


def _command_errors() -> tuple[type[Exception], ...]:
    """What a command ends with in one line, exit 2 (_run)."""
    from deskfleet.agent.autostart import AutostartError
    from deskfleet.agent.enroll import EnrollmentError
    from deskfleet.agent.paths import SettingsError
    from deskfleet.common.event_loop import EventLoopError
    from deskfleet.common.join_tokens import JoinTokenError
    from deskfleet.common.pki import PkiError
    from deskfleet.common.wire import ProtocolError

    return (EnrollmentError, SettingsError, JoinTokenError, PkiError, ProtocolError, EventLoopError, AutostartError,
            OSError, ValueError)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None,
         stdout: WatchedStream | None, errors: tuple[type[Exception], ...], descriptor: _ErrorDescriptor) -> int:
    try:
        _refuse_controller_dir(args.data_dir)
        if args.command == "tray":
            return _tray(args)
        if args.command == "autostart":
            return _autostart(args)
        if args.command == "stop":
            return _stop(args)
        if args.command in ("join", "pause", "resume"):
            status = _join(args) if args.command == "join" else _pause(args, paused=args.command == "pause")
            flush_stdout()  # inside the handlers below: a message still in the buffer meets a full disk here
            return status
        if args.headless:
            if argv is None:  # this process's own command line: it may re-execute on jemalloc
                with descriptor.given_back():  # the new process opens the log itself, or it would hold it twice
                    _run_on_jemalloc(args)
            return _headless(args)
        parser.error("give a command (join, tray, pause, resume, stop, autostart) or --headless")
    except KeyboardInterrupt:
        return 130
    except ImportError as error:  # OpenVINO's, of a Ctrl-C that landed in its import as the agent started
        if interruption(error) is None:
            raise
        return 130
    except errors as error:
        if args.verbose:
            raise
        if stdout is not None and error is stdout.failure:  # every command writes there once it has done its work
            silence_stdout()  # or the flush at exit fails again
            print(f"deskfleet-agent: error: could not write to standard output ({error.strerror or error}); the "
                  f"{args.command} itself was done", file=sys.stderr)
            return 1
        said = os_error_text(error) if isinstance(error, OSError) else error
        print(f"deskfleet-agent: error: {said}", file=sys.stderr)
        return 2
    return 0


def _open_log_file(path: Path | None) -> TextIO | None:
    """`--log-file`, opened to append (None: no such option). A file past LOG_ROLL_BYTES is first renamed to
    FILE.1, replacing the one before: at start only, as Windows refuses to rename a file that a process holds open."""
    if path is None:
        return None
    with contextlib.suppress(OSError):  # not there yet; or held open (a log viewer, an antivirus): appended to then
        if path.stat().st_size > LOG_ROLL_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", encoding="utf-8", errors="backslashreplace", buffering=1)  # a line at a time


class _ErrorDescriptor:
    """File descriptor 2 pointed at a log file (what OpenVINO's native code writes goes there too), and back."""

    def __init__(self, log: TextIO | None) -> None:
        self.log = log
        self.saved: int | None = None  # fd 2 as it was; None where it was not open (pythonw.exe's) or is not moved

    def to_log(self) -> None:
        if self.log is None:
            return
        with contextlib.suppress(OSError):
            if sys.__stderr__ is not None:  # what it still buffers belongs where it was written
                sys.__stderr__.flush()
            self.saved = os.dup(2)
        with contextlib.suppress(OSError):
            self.log.flush()
            os.dup2(self.log.fileno(), 2)

    def back(self) -> None:
        if self.saved is not None:
            os.dup2(self.saved, 2)
            os.close(self.saved)
            self.saved = None

    @contextlib.contextmanager
    def given_back(self) -> Iterator[None]:
        """fd 2 as it was for the block: a process re-executed in it (onto jemalloc) inherits that, not the log."""
        self.back()
        try:
            yield
        finally:
            self.to_log()


@contextlib.contextmanager
def _standard_error_to(log: TextIO | None) -> Iterator[_ErrorDescriptor]:
    """Standard error, so the log, the errors said and a traceback, written to `log` for the block (None: left as it
    is). What runs with no console (pythonw.exe, autostart's tasks on Windows) has nowhere else to say them. File
    descriptor 2 goes there too; a crash's traceback is written there before the block ends, since Python prints it
    later, to the standard error put back by then; the log handlers made in the block go with it."""
    descriptor = _ErrorDescriptor(log)
    if log is None:
        yield descriptor
        return
    original = sys.stderr
    forgiving = ForgivingStream(log)  # a full disk loses log lines, not the agent
    sys.stderr = cast(TextIO, forgiving)
    descriptor.to_log()
    try:
        yield descriptor
    except Exception:
        traceback.print_exc()
        raise
    finally:
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, logging.StreamHandler) and handler.stream is forgiving:
                root.removeHandler(handler)
        sys.stderr = original
        descriptor.back()
        with contextlib.suppress(OSError):  # a full disk: the last lines are lost, as the others were
            log.close()


def _settle_command_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A command takes --data-dir before it or after it, not two different ones (the second won, unsaid: `pause`
    could pause another agent than the one meant); --headless and --listen run the agent, which a command does not
    (they were ignored)."""
    if args.command is None:
        return
    given = [option for option, on in (("--headless", args.headless), ("--listen", args.listen is not None)) if on]
    if given:
        run = "they run" if len(given) > 1 else "it runs"
        parser.error(f"{' and '.join(given)} with the {args.command} command: {run} the agent, which "
                     f"`{args.command}` does not; give the command alone, and start the agent with "
                     "`deskfleet-agent --headless` after it")
    command_dir = args.command_data_dir
    if command_dir is not None and args.data_dir is not None and command_dir.resolve() != args.data_dir.resolve():
        parser.error(f"--data-dir {args.data_dir} before {args.command} and --data-dir {command_dir} after it name two "
                     "folders: give the agent's data dir once")
    if command_dir is not None:
        args.data_dir = command_dir


def _join(args: argparse.Namespace) -> int:

    from deskfleet.agent.enroll import EnrollmentError, Membership, join, read_join_token
    from deskfleet.agent.paths import AgentPaths
    from deskfleet.agent.service import JOIN_HOLDER, LOCK_FILE
    from deskfleet.common import event_loop
    from deskfleet.common.file_lock import pid_lock

    token = _token_from_stdin() if args.token == "-" else args.token
    read_join_token(token)  # a mistyped or expired token is named before any folder is made for it
    paths = AgentPaths.resolve(args.data_dir)
    root = paths.state_dir.parent
    try:
        before: Membership | None = Membership.load(paths.state_dir)
    except EnrollmentError:
        before = None
    # While an agent runs on this data dir its state must not change under it (it went on in the old fleet's limbo);
    # none can start meanwhile, nor another join: joins at once on a fresh data dir each made a key, each spent a use
    # of the token, and left the last key beside another's certificate
    def refusal(pid: str, holder: str) -> EnrollmentError:
        if holder == JOIN_HOLDER:
            return EnrollmentError(f"another `deskfleet-agent join` runs on {root} (pid {pid}): one join at a time; "
                                   "let it finish")
        return EnrollmentError(f"an agent runs on {root} (pid {pid}): stop it, join, then start it again")

    try:
        paths.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # as join makes it: it holds the key
    except OSError as error:
        raise OSError(error.errno, f"cannot make the state folder {paths.state_dir}: {error.strerror or error}") \
            from None
    with pid_lock(paths.state_dir / LOCK_FILE, refusal, JOIN_HOLDER):
        # the settings and cache folders only once joined: a failed join leaves only the state folder's key, which
        # a retry reuses (the same agent id, where the controller registered the first attempt but its answer was
        # lost)
        try:
            membership = event_loop.run(join(token, paths.state_dir, args.hostname))
        except KeyboardInterrupt:  # it ended with exit 130 and not a word: joined or not?
            print("deskfleet-agent: join stopped by Ctrl-C: this PC has not joined (its key is kept for the next "
                  "try); run the join again, with a new token if the controller says this one is used up",
                  file=sys.stderr)
            raise
    paths.create()
    if before is not None and before.fleet_id != membership.fleet_id:
        print(f"this PC left fleet {before.fleet_id} (its stages and removals there no longer apply)")
    print(f"joined fleet {membership.fleet_id} as agent {membership.agent_id}")
    print(f"start it with: deskfleet-agent --headless{_data_dir_flag(args.data_dir)}")
    for problem in _settings_problems(paths):  # said now, not at the start a service manager then gives up on
        print(f"but first: {problem}", file=sys.stderr)
    return 0


def _settings_problems(paths: AgentPaths) -> list[str]:
    """What in the settings folder would stop the agent starting or be ignored by it: the settings file refused (a
    typo in a field), and files beside it that look meant to be it."""
    from deskfleet.agent.paths import SettingsError, load_settings, misnamed_settings_files

    problems = []
    try:
        load_settings(paths.settings_file)
    except SettingsError as error:
        problems.append(f"the agent will not start with its settings as they are: {error}")
    problems.extend(f"{misnamed} is not read: the agent reads its settings from {paths.settings_file} alone (rename "
                    "it)" for misnamed in misnamed_settings_files(paths.settings_dir))
    return problems


def _pause(args: argparse.Namespace, paused: bool) -> int:
    """The employee's opt-out (agent/opt_out.py): the running agent reads it within a few seconds."""
    from deskfleet.agent.enroll import Membership, agent_tls_files
    from deskfleet.agent.link import utc_now
    from deskfleet.agent.opt_out import read_opt_out, write_opt_out
    from deskfleet.agent.paths import AgentPaths, SettingsError, load_settings
    from deskfleet.agent.standing import removed_seen

    paths = AgentPaths.resolve(args.data_dir)
    # the agent's own data dir, not a mistyped one: a pause nobody reads must not look like one that works
    Membership.load(paths.state_dir, "deskfleet-agent join TOKEN" + _data_dir_flag(args.data_dir))
    if (seen := removed_seen(paths.state_dir)) is not None:  # "resumed: the next plan may use this PC" was false
        print(f"this PC was removed from the fleet (its controller refused it, {seen}): pausing or resuming changes "
              "nothing until it joins again as a new agent (delete "
              f"{agent_tls_files(paths.state_dir).key_path}, then join with a new token)")
        return 1
    before = read_opt_out(paths.state_dir)
    if paused and before.paused and before.problem is None:  # a second `pause` moved the pause's time, unsaid
        print(f"this PC was already paused{f' since {before.since}' if before.since else ''}: nothing changed")
        return 0
    write_opt_out(paths.state_dir, paused, utc_now().isoformat())
    if paused:
        print("paused: this PC serves no model until `deskfleet-agent resume`; a stage it hosts is given up "
              "within seconds, and the generation it was part of goes on without it")
        return 0
    try:
        admin_paused = load_settings(paths.settings_file).paused
    except SettingsError as error:  # the employee's resume stands; the admin's file is theirs to fix
        # an agent running now keeps the settings it started with: the file stops only its next start
        print(f"resumed; but the agent's settings file is refused as it is now (a running agent keeps the settings "
              f"it started with; it will not start again until this is fixed): {error}")
        return 0
    if admin_paused:
        print(f"resumed, but {paths.settings_file} says paused: true, so this PC stays out until its admin "
              "changes that")
    elif not before.paused:
        print("this PC was not paused by its user: nothing changed; the next plan may use it")
    else:
        print("resumed: once this PC has been available for 20 s its agent tells the controller, and the next fleet "
              "run takes it back into the chain it left (a running `serve --fleet` when idle, a chat before its next "
              "message); the next deploy may use it too")
    return 0


def _hostname_argument(text: str) -> str:
    """argparse type of --hostname: one line of text (line_of_text; a blank one, `--hostname "$NAME"` with NAME
    unset, kept the old one) of at most HOSTNAME_MAX_CHARS (a 300-character name widened `fleet ls` past any
    terminal)."""
    line_of_text(text, "is empty or blank (an unset variable?): give the name, or leave out --hostname for this PC's "
                       "own")
    if len(text) > HOSTNAME_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"is {len(text)} characters long: give at most {HOSTNAME_MAX_CHARS}")
    return text


def _refuse_controller_dir(data_dir: Path | None) -> None:
    """EnrollmentError where --data-dir is a controller's: every command, not join alone (`pause --data-dir` on a
    controller's dir said to `join TOKEN --data-dir` there, which join then refused)."""
    from deskfleet.agent.enroll import EnrollmentError
    from deskfleet.agent.paths import AgentPaths

    if data_dir is None:
        return
    paths = AgentPaths.resolve(data_dir)
    root = paths.state_dir.parent
    controllers = [name for name in CONTROLLER_FILES if (root / name).exists()]
    if controllers and paths.state_dir.is_dir():  # one an earlier deskfleet let `fleet init` share with this agent
        raise EnrollmentError(f"{root} is also a controller's data dir (it holds {controllers[0]}): move the agent's "
                              f"folders ({paths.settings_dir.name}, {paths.state_dir.name}, {paths.cache_dir.name}) "
                              "into a folder of their own and give that as --data-dir; the PC stays in its fleet")
    if controllers:
        raise EnrollmentError(f"{root} is a controller's data dir (it holds {controllers[0]}): give the agent a "
                              "--data-dir of its own")


def _token_from_stdin() -> str:
    """The join token from standard input: its first line that is not blank (of the first 64), without surrounding
    blanks (a token file or a paste that began with an empty line was "no token")."""
    from deskfleet.common.join_tokens import JoinTokenError

    if sys.stdin is None:  # started with standard input closed (`<&-`)
        raise JoinTokenError("`join -` reads the token from standard input, which is closed: pipe it in, e.g. "
                             "`deskfleet-agent join - < token.txt`")
    token = ""
    for _ in range(64):
        line = sys.stdin.readline(1 << 16)
        token = line.strip()
        if token or not line:  # a token, or the end of the input
            break
    if not token:
        raise JoinTokenError("`join -` found no token on standard input: pipe it in, e.g. "
                             "`deskfleet-agent join - < token.txt`")
    return token


def _run_on_jemalloc(args: argparse.Namespace) -> None:
    from deskfleet.agent.allocator import run_on_jemalloc
    from deskfleet.agent.paths import AgentPaths, load_settings

    run_on_jemalloc(load_settings(AgentPaths.resolve(args.data_dir).settings_file).device)


def _headless(args: argparse.Namespace) -> int:
    from deskfleet.agent.service import AgentOptions, AgentService
    from deskfleet.common import event_loop

    async def run() -> None:
        service = AgentService(AgentOptions(args.data_dir, args.listen))
        await service.run()

    event_loop.run(run())
    return 0


def _tray(args: argparse.Namespace) -> int:
    from deskfleet.agent.tray import TrayError, run_tray

    try:
        return run_tray(args.data_dir)
    except TrayError as error:
        print(f"deskfleet-agent: error: {error}", file=sys.stderr)
        return 2


def _autostart(args: argparse.Namespace) -> int:
    from deskfleet.agent.autostart import AutostartError, AutostartTarget, autostart_for_this_pc
    from deskfleet.agent.paths import AgentPaths
    from deskfleet.agent.standing import joined

    paths = AgentPaths.resolve(args.data_dir)
    if args.action == "enable" and not joined(paths.state_dir):
        raise AutostartError(f"this PC has not joined a fleet with this data dir ({paths.state_dir} holds no "
                             f"membership): `deskfleet-agent join -{_data_dir_flag(args.data_dir)}` first, as the "
                             "agent that autostart starts refuses to run before")
    autostart = autostart_for_this_pc(AutostartTarget.this_install(args.data_dir), paths.state_dir)
    if args.action == "status":
        report = autostart.status()
        print("\n".join(report.lines))
        flush_stdout()
        return 0 if report.enabled else AUTOSTART_OFF_EXIT
    lines = autostart.enable() if args.action == "enable" else autostart.disable()
    print("\n".join(lines))
    flush_stdout()
    return 0


def _stop(args: argparse.Namespace) -> int:
    """`deskfleet-agent stop`: 0 once the agent has stopped (or where none ran), 1 where it did not within the wait;
    a status file that cannot be read is an error (exit 2): whether an agent runs cannot be told."""
    from deskfleet.agent.paths import AgentPaths
    from deskfleet.agent.status_file import StatusFileError
    from deskfleet.agent.stop_request import STOP_WAIT_S, STOPPING_GRACE_S, Outcome, running_agent, stop_agent

    state_dir = AgentPaths.resolve(args.data_dir).state_dir
    try:
        running = running_agent(state_dir)
    except StatusFileError as error:
        raise OSError(f"cannot tell whether an agent runs on this data dir: {error} (run `stop` as the user the agent "
                      "runs as)") from None
    if running is None:
        print(f"no agent runs on {state_dir}: nothing to stop")
        return 0
    outcome = stop_agent(state_dir, running)
    if outcome is Outcome.NOT_TAKEN:
        print(f"deskfleet-agent: error: the agent (pid {running.pid}) did not take the request to stop within "
              f"{STOP_WAIT_S:g} s: its log says what it is doing (end it with the system's own tools: Task Manager, "
              "or kill)", file=sys.stderr)
        return 1
    if outcome is Outcome.STOPPING:
        print(f"deskfleet-agent: error: the agent (pid {running.pid}) took the request, and is still stopping after "
              f"{STOP_WAIT_S + STOPPING_GRACE_S:g} s (finishing a step, or a stage's compile): it ends by itself; its "
              "log says what it is doing", file=sys.stderr)
        return 1
    print(f"stopped the agent (pid {running.pid}); autostart, where enabled, starts it again at the next login (on "
          "Windows within 5 minutes): `deskfleet-agent autostart disable` stops it for good")
    flush_stdout()
    return 0


def _data_dir_flag(data_dir: Path | None) -> str:
    """` --data-dir D` for a command line the user is told to run, quoted for their shell (a folder under
    C:\\Users\\John Smith, C:\\Program Files, or /srv/agent é: cmd, PowerShell and sh would split it in two)."""
    return "" if data_dir is None else f" {option_text('--data-dir', str(data_dir))}"


if __name__ == "__main__":
    sys.exit(main())
