"""`deskfleet-agent join -` reads the token from standard input (a token on the command line shows in the
process list and the shell's history); nothing there is an error that says how to give it."""

from __future__ import annotations

import datetime
import io
import os
from pathlib import Path
from typing import Any

import pytest

from deskfleet.agent import cli, enroll
from deskfleet.agent.link import utc_now
from deskfleet.common import join_tokens
from tests.ports import free_port


def test_join_dash_reads_the_token_from_standard_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    used: list[str] = []

    async def fake_join(token_text: str, state_dir: Path, hostname: str | None = None) -> enroll.Membership:
        used.append(token_text)
        raise enroll.EnrollmentError("controller unreachable (test)")

    monkeypatch.setattr(enroll, "join", fake_join)
    monkeypatch.setattr(enroll, "read_join_token", used.append)  # checked before the data dir is made
    monkeypatch.setattr("sys.stdin", io.StringIO("  dfj1.secret-token  \nignored second line\n"))
    assert cli.main(["--data-dir", str(tmp_path), "join", "-"]) == 2
    assert used == ["dfj1.secret-token"] * 2
    assert "controller unreachable (test)" in capsys.readouterr().err


def test_join_dash_with_nothing_on_standard_input_says_how_to_give_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert cli.main(["--data-dir", str(tmp_path), "join", "-"]) == 2
    assert "`join -` found no token on standard input: pipe it in" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--head"], ["join", "dfj1.x", "--host", "pc"], ["pause", "--data", "d"]])
def test_no_option_is_taken_by_an_abbreviation(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # as `deskfleet`'s: `--head` ran the agent as --headless, `join --host` named it as --hostname
    with pytest.raises(SystemExit) as exit_code:
        cli.build_parser().parse_args(argv)
    assert exit_code.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_a_failed_join_makes_no_settings_or_cache_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A join to a controller that is not there left data/settings and data/cache behind, empty, beside the key.
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    data = tmp_path / "data"
    assert cli.main(["--data-dir", str(data), "join", _token(address)]) == 2
    assert f"could not join: {address}" in capsys.readouterr().err
    assert sorted(path.name for path in data.iterdir()) == ["state"]
    # the key kept (a retry keeps its agent id), and the lock that keeps one join (or agent) at a time on it
    assert sorted(path.name for path in (data / "state").iterdir()) == ["agent-key.pem", "agent.lock"]


def _token(address: str) -> str:
    expires = (utc_now() + datetime.timedelta(hours=1)).replace(microsecond=0)
    return join_tokens.encode_join_token(join_tokens.JoinToken((address,), "0" * 64, join_tokens.new_secret(), expires))


def test_joining_a_controllers_data_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it joined, and the agent served from beside the fleet CA's key
    (tmp_path / "ca-key.pem").write_text("key")
    assert cli.main(["--data-dir", str(tmp_path), "join", _token("127.0.0.1:1")]) == 2
    assert f"{tmp_path} is a controller's data dir (it holds ca-key.pem)" in capsys.readouterr().err
    # every command: `pause` there said to `join TOKEN --data-dir` it, which join then refused
    for command in (["pause"], ["resume"], ["--headless"]):
        assert cli.main(["--data-dir", str(tmp_path), *command]) == 2
        assert f"{tmp_path} is a controller's data dir (it holds ca-key.pem): give the agent a --data-dir of its " \
               "own" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ca-key.pem"]


def test_a_join_while_the_agent_runs_is_refused_naming_its_pid(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # it switched the running agent's membership under it: the agent went on in the old fleet's limbo
    from deskfleet.agent.service import LOCK_FILE
    from deskfleet.common.file_lock import pid_lock

    state = tmp_path / "state"
    state.mkdir()
    with pid_lock(state / LOCK_FILE, RuntimeError):
        assert cli.main(["--data-dir", str(tmp_path), "join", _token(f"127.0.0.1:{free_port()}")]) == 2
    assert f"an agent runs on {tmp_path} (pid {os.getpid()}): stop it, join, then start it again" in \
        capsys.readouterr().err


def test_a_join_while_another_join_runs_on_the_data_dir_is_refused_as_such(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # joins at once on a fresh data dir each made a key and spent a use of the token, and the last key was left beside
    # another's certificate: the lock was taken only where the state folder was there already
    from deskfleet.agent.service import JOIN_HOLDER, LOCK_FILE
    from deskfleet.common.file_lock import pid_lock

    fresh = tmp_path / "fresh"
    assert cli.main(["--data-dir", str(fresh), "join", _token(f"127.0.0.1:{free_port()}")]) == 2  # nobody answers
    assert (fresh / "state" / LOCK_FILE).is_file()  # the first try locked the data dir too
    state = tmp_path / "other" / "state"
    state.mkdir(parents=True, mode=0o700)  # as another join, holding the lock, has made it
    with pid_lock(state / LOCK_FILE, RuntimeError, JOIN_HOLDER):
        assert cli.main(["--data-dir", str(state.parent), "join", _token(f"127.0.0.1:{free_port()}")]) == 2
    assert f"another `deskfleet-agent join` runs on {state.parent} (pid {os.getpid()}): one join at a time; let " \
        "it finish" in capsys.readouterr().err
    assert not (state / "agent-key.pem").exists()  # refused before a key was made


def test_a_join_to_another_fleet_says_which_fleet_the_pc_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    enroll.Membership("a" * 16, "agent-1", "c" * 52, ("127.0.0.1:1",)).save(state)

    async def joined_b(token_text: str, state_dir: Path, hostname: str | None = None) -> enroll.Membership:
        membership = enroll.Membership("b" * 16, "agent-1", "d" * 52, ("127.0.0.1:2",))
        membership.save(state_dir)
        return membership

    monkeypatch.setattr(enroll, "join", joined_b)
    assert cli.main(["--data-dir", str(tmp_path), "join", _token("127.0.0.1:2")]) == 0
    out = capsys.readouterr().out
    assert f"this PC left fleet {'a' * 16}" in out and f"joined fleet {'b' * 16}" in out


@pytest.mark.parametrize("name", ["", "  "])
def test_a_blank_hostname_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    # `--hostname "$NAME"` with NAME unset joined under the old name, without a word
    with pytest.raises(SystemExit) as exited:
        cli.main(["--data-dir", str(tmp_path), "join", _token("127.0.0.1:1"), "--hostname", name])
    assert exited.value.code == 2
    assert "argument --hostname: is empty or blank (an unset variable?)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_data_dir_an_earlier_fleet_init_shared_says_how_to_part_them(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ca-key.pem").write_text("key")
    (tmp_path / "state").mkdir()  # the agent's, joined before `fleet init` was let in
    assert cli.main(["--data-dir", str(tmp_path), "--headless"]) == 2
    assert (f"{tmp_path} is also a controller's data dir (it holds ca-key.pem): move the agent's folders (settings, "
            "state, cache) into a folder of their own and give that as --data-dir; the PC stays in its fleet"
            ) in capsys.readouterr().err


def test_a_join_stopped_by_ctrl_c_says_the_pc_has_not_joined(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # it exited 130 without a word: joined or not?
    from deskfleet.common import event_loop

    def ctrl_c(coroutine: Any) -> None:
        coroutine.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(event_loop, "run", ctrl_c)
    assert cli.main(["--data-dir", str(tmp_path), "join", _token("127.0.0.1:1")]) == 130
    assert capsys.readouterr().err == (
        "deskfleet-agent: join stopped by Ctrl-C: this PC has not joined (its key is kept for the next try); run the "
        "join again, with a new token if the controller says this one is used up\n")
    assert not (tmp_path / "state" / "membership.json").exists()


def test_join_dash_skips_blank_lines_before_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # a token file, or a paste, that began with an empty line was "found no token"
    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n dfj1.token \nsecond line\n"))
    assert cli._token_from_stdin() == "dfj1.token"


@pytest.mark.parametrize("argv", [["--headless", "--data_dir", "/tmp/agent"], ["--listn", "127.0.0.1:1"],
                                  ["join", "--data_dir", "/tmp/agent", "dfj1.x"]])
def test_a_mistyped_option_is_named(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # `--data_dir D` read D as the command: "argument COMMAND: invalid choice: 'D'", the typo unnamed
    with pytest.raises(SystemExit) as exit_code:
        cli.build_parser().parse_args(argv)
    assert exit_code.value.code == 2
    assert f"error: unrecognized arguments: {argv[-3] if argv[0] == 'join' else argv[-2]}\n" in capsys.readouterr().err


def test_an_options_missing_value_is_not_called_an_unknown_option(capsys: pytest.CaptureFixture[str]) -> None:
    # `--hostname --x`: the value is missing, which argparse says; --x is no option the user meant
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["join", "dfj1.x", "--hostname", "--x"])
    assert "argument --hostname: expected one argument" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "prefix", "says"), [
    (["join"], "deskfleet-agent join: error:", "the following arguments are required: token"),
    (["pause", "--bogus"], "deskfleet-agent pause: error:", "unrecognized arguments: --bogus"),
    (["join", "dfj1.x", "--bogus"], "deskfleet-agent join: error:", "unrecognized arguments: --bogus"),
    (["--bogus", "join"], "deskfleet-agent:", "error: unrecognized arguments: --bogus"),  # not the missing token
    (["--bogus", "join", "dfj1.x"], "deskfleet-agent:", "error: unrecognized arguments: --bogus"),
    (["join", "--bogus"], "deskfleet-agent join: error:", "unrecognized arguments: --bogus"),
])
def test_an_error_comes_with_the_usage_of_what_it_was_given_to(argv: list[str], prefix: str, says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # the usage line was the top-level one with " join" after it, and errors after the command the top-level's
    with pytest.raises(SystemExit) as exit_code:
        cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_code.value.code == 2 and f"{prefix} {says}\n" in err, err
    assert err.startswith(f"usage: {prefix.split(':')[0]} [-h]"), err


def test_a_cluster_of_short_flags_is_taken() -> None:
    # the scan for unknown options took `-vv` for one
    assert cli.build_parser().parse_args(["-vv", "pause"]).command == "pause"


@pytest.mark.parametrize(("argv", "says"), [
    (["--headless", "--listen", "127.0.0.1:1", "join", "dfj1.x"], "--headless and --listen with the join command"),
    (["--listen", "127.0.0.1:1", "pause"], "--listen with the pause command"),
])
def test_options_that_run_the_agent_are_refused_with_a_command(argv: list[str], says: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # they were ignored: the join said "joined", and no agent ran on the address given
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    assert exit_code.value.code == 2 and says in capsys.readouterr().err


def test_two_different_data_dirs_are_refused_and_one_given_twice_is_taken(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # `--data-dir A pause --data-dir B` paused B, unsaid
    first, second = tmp_path / "a", tmp_path / "b"
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["--data-dir", str(first), "pause", "--data-dir", str(second)])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2
    assert f"--data-dir {first} before pause and --data-dir {second} after it name two folders" in err
    assert not first.exists() and not second.exists()
    assert cli.main(["--data-dir", str(first), "pause", "--data-dir", str(tmp_path / "x" / ".." / "a")]) == 2
    assert "this agent has not joined a fleet" in capsys.readouterr().err  # the one folder, read
    assert cli.main(["pause", "--data-dir", str(second)]) == 2
    assert f"{second / 'state' / 'membership.json'} is missing" in capsys.readouterr().err


def test_a_join_says_where_the_settings_would_stop_the_agent_or_go_unread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # a join with a typo in the settings file said "start it with ...", and the start then exited 2, which the
    # shipped systemd unit does not restart
    async def joined(token_text: str, state_dir: Path, hostname: str | None = None) -> enroll.Membership:
        membership = enroll.Membership("b" * 16, "agent-1", "d" * 52, ("127.0.0.1:2",))
        membership.save(state_dir)
        return membership

    monkeypatch.setattr(enroll, "join", joined)
    (tmp_path / "state").mkdir()
    settings = tmp_path / "settings"
    settings.mkdir()
    (settings / "agent-settings.json").write_text('{"listen_adress": "127.0.0.1:7431"}')
    (settings / "agent_settings.json").write_text("{}")
    assert cli.main(["--data-dir", str(tmp_path), "join", _token("127.0.0.1:2")]) == 0
    said = capsys.readouterr()
    assert "joined fleet" in said.out
    assert "but first: the agent will not start with its settings as they are: " in said.err
    assert "listen_adress" in said.err
    assert f"but first: {settings / 'agent_settings.json'} is not read: the agent reads its settings from " \
           f"{settings / 'agent-settings.json'} alone (rename it)" in said.err
    (settings / "agent-settings.json").write_text("{}")
    (settings / "agent_settings.json").unlink()
    assert cli.main(["--data-dir", str(tmp_path), "join", _token("127.0.0.1:2")]) == 0
    assert "but first" not in capsys.readouterr().err


def test_a_data_dir_that_loops_is_named_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    for command in (["--headless"], ["pause"], ["join", _token("127.0.0.1:1")]):
        assert cli.main(["--data-dir", str(loop), *command]) == 2
        assert f"the agent's data dir {loop} goes round a loop of symbolic links" in capsys.readouterr().err


def test_a_state_folder_the_agent_cannot_write_says_the_way_out(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(30, "Read-only file system", str(tmp_path / "state"))

    monkeypatch.setattr(cli, "_join", read_only)
    assert cli.main(["--data-dir", str(tmp_path), "join", _token("127.0.0.1:1")]) == 2
    assert capsys.readouterr().err == (f"deskfleet-agent: error: Read-only file system: {tmp_path / 'state'} (that "
                                       "file system is mounted read-only: give a folder on a writable disk)\n")


def test_a_hostname_longer_than_a_certificate_carries_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # a 300-character name was taken, and widened `fleet ls` past any terminal
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["join", "dfj1.x", "--hostname", "h" * 65])
    assert "argument --hostname: is 65 characters long: give at most 64" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["join", "dfj1.x", "--hostname", "h" * 64]).hostname == "h" * 64
