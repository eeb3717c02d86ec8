"""Standard error closed (`2>&-`) and standard output on a full disk (`> /dev/full`).

With fd 2 closed Python's sys.stderr is None, and `print(..., file=sys.stderr)` writes to standard output: the
status line and errors went into the output a script reads, and chat crashed on its first note (AttributeError)
after one reply. A write to a full disk raised OSError out of main with a traceback, after the work was done."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deskfleet.common.console import WatchedStream, watched_stdout

CLI = [sys.executable, "-m", "deskfleet.controller.cli"]
# Block-buffered, as a user's is (PYTHONUNBUFFERED, set where these tests were written, hid a result that met the
# full disk only at the interpreter's exit)
BUFFERED = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}


def _run(args: list[str], stdin: str = "", close_stderr: bool = False,
         stdout: int | io.BufferedWriter = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], input=stdin, stdout=stdout, stderr=None if close_stderr else subprocess.PIPE,
                          text=True, timeout=300, preexec_fn=(lambda: os.close(2)) if close_stderr else None,
                          env=BUFFERED)


def test_generate_with_standard_error_closed_writes_only_its_result_to_standard_output(tiny_export: Path) -> None:
    done = _run(["generate", "--model", str(tiny_export), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json"],
                close_stderr=True)
    assert done.returncode == 0
    report = json.loads(done.stdout)  # one JSON document: no status line, no note before it
    assert report["generated_tokens"] == 3 and len(report["streams"][0]["tokens"]) == 3
    failed = _run(["generate", "--model", "/tmp/deskfleet-no-such-export", "--prompt-ids", "1"], close_stderr=True)
    assert failed.returncode == 2 and failed.stdout == ""  # the error went nowhere, not into the output


def test_chat_with_standard_error_closed_answers_every_message(tiny_export: Path) -> None:
    done = _run(["chat", "--model", str(tiny_export), "--max-new-tokens", "3", "--json"], stdin="hi\nthere\n",
                close_stderr=True)
    assert done.returncode == 0
    assert [json.loads(line)["reply_tokens"] for line in done.stdout.splitlines()] == [3, 3]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("json_output", [True, False])
def test_a_result_standard_output_cannot_take_is_one_error_line(tiny_export: Path, json_output: bool) -> None:
    with open("/dev/full", "wb") as full:
        done = _run(["generate", "--model", str(tiny_export), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                     *(["--json"] if json_output else [])], stdout=full)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "deskfleet: error: could not write the result to standard output: No space left on device")


def test_other_os_errors_are_not_blamed_on_standard_output(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from deskfleet.controller import cli

    def handler(args: object) -> int:
        raise PermissionError(13, "Permission denied", "/some/file")  # not a write to standard output

    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "p"])
    args.handler, args.runs_models = handler, False
    monkeypatch.setattr(cli, "build_parser", lambda: type("P", (), {"parse_args": lambda self, argv: args})())
    assert cli.main(["generate"]) == 2  # one line naming the file and the way out (common/os_error_text.py)
    said = capsys.readouterr().err
    assert said.startswith("deskfleet: error: Permission denied: /some/file (this user may not") and \
        "standard output" not in said, said


def test_watched_stdout_remembers_a_failed_write_and_puts_the_stream_back(monkeypatch: pytest.MonkeyPatch) -> None:
    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    original = Full()
    monkeypatch.setattr(sys, "stdout", original)
    with watched_stdout() as watched:
        assert isinstance(watched, WatchedStream) and sys.stdout is watched
        with pytest.raises(OSError) as raised:
            print("result")
        assert watched.failure is raised.value
        assert watched.getvalue() == ""  # everything else is the wrapped stream's
    assert sys.stdout is original
