"""tolerate_unencodable: a stream in an encoding without a character writes its escape instead of raising."""

from __future__ import annotations

import io
import signal

import pytest

from deskfleet.common.console import stopping_signals, tolerate_unencodable
from tests.signals import in_fresh_process, signal_main_thread

TEXT = "営業部-PC 🙂 done\n"


def cp1252_stream(errors: str = "strict") -> tuple[io.BytesIO, io.TextIOWrapper]:
    raw = io.BytesIO()
    return raw, io.TextIOWrapper(raw, encoding="cp1252", errors=errors)


def test_a_strict_stream_escapes_what_its_encoding_lacks() -> None:
    raw, stream = cp1252_stream()
    with pytest.raises(UnicodeEncodeError):
        stream.write(TEXT)
        stream.flush()
    raw, stream = cp1252_stream()
    tolerate_unencodable(stream)
    stream.write("café " + TEXT)
    stream.flush()
    assert raw.getvalue() == "café \\u55b6\\u696d\\u90e8-PC \\U0001f642 done\n".encode("cp1252")


def test_a_stream_with_its_own_error_handling_or_not_a_text_wrapper_is_left_alone() -> None:
    _, stream = cp1252_stream(errors="replace")
    tolerate_unencodable(stream)
    assert stream.errors == "replace"
    text = io.StringIO()
    tolerate_unencodable(text)
    text.write(TEXT)
    assert text.getvalue() == TEXT


@in_fresh_process
def test_a_ctrl_c_during_a_held_block_comes_after_it() -> None:
    import signal

    from deskfleet.common.console import ctrl_c_held

    done = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_held():
            signal_main_thread()
            for _ in range(1000):  # Python runs a signal's handler between bytecodes: plenty of chances here
                pass
            done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was before the block
    with ctrl_c_held():  # no Ctrl-C: nothing raised
        done.append("again")
    assert done[-1] == "again"


@in_fresh_process
def test_a_held_ctrl_c_goes_to_the_handler_outside_the_block() -> None:
    import signal

    from deskfleet.common.console import ctrl_c_held

    seen: list[int] = []
    outside = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with ctrl_c_held():
            signal_main_thread()
            for _ in range(1000):
                pass
            assert seen == []
        for _ in range(1000):
            pass
        assert seen == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with ctrl_c_held():
            signal_main_thread()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # ignored outside: ignored after it too
    finally:
        signal.signal(signal.SIGINT, outside)


@in_fresh_process
def test_print_whole_writes_its_line_whole_through_a_ctrl_c() -> None:

    from deskfleet.common.console import print_whole

    class CtrlCWhileWriting(io.StringIO):
        def write(self, text: str) -> int:  # the Ctrl-C lands while the line is being written
            if not self.getvalue():
                signal_main_thread()
            return super().write(text)

    out = CtrlCWhileWriting()
    with pytest.raises(KeyboardInterrupt):
        print_whole('{"a": 1}', file=out)
    assert out.getvalue() == '{"a": 1}\n'


@in_fresh_process
def test_a_second_ctrl_c_during_a_held_block_is_delivered_at_once() -> None:
    # a print stuck on a reader that stopped reading could not be stopped by any number of Ctrl-C
    import signal

    from deskfleet.common.console import ctrl_c_held

    done = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_held():
            signal_main_thread()
            for _ in range(1000):
                pass
            done.append("held once")
            signal_main_thread()
            for _ in range(1000):
                pass
            done.append("never: the second one ends the block")
    assert done == ["held once"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on Windows")
def test_a_service_stops_on_sighup_unless_nohup_ignores_it() -> None:
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert stopping_signals() == [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does
        assert stopping_signals() == [signal.SIGINT, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGHUP, before)


class _FullDisk(io.StringIO):
    """A stream on a full disk (`2>/dev/full`): every write and flush fails."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


def test_standard_error_that_cannot_be_written_drops_the_text_and_the_command_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # generate's closing line to `2>/dev/full` turned a finished run into exit 1, and chat's note that a reply was
    # cut ended a scripted chat after its first reply
    import sys

    from deskfleet.common.console import ForgivingStream, forgiving_stderr

    full = _FullDisk()
    monkeypatch.setattr(sys, "stderr", full)
    with forgiving_stderr():
        assert isinstance(sys.stderr, ForgivingStream)
        print("[3 tokens, 250 tok/s]", file=sys.stderr)  # raises nothing
        sys.stderr.flush()
        with forgiving_stderr():  # nested: not wrapped twice
            assert sys.stderr.stream is full  # type: ignore[attr-defined]
    assert sys.stderr is full
    with pytest.raises(OSError):
        print("x", file=sys.stderr)  # outside the block, the stream as it was


def test_both_command_lines_forgive_their_standard_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from deskfleet.agent.cli import main as agent_main
    from deskfleet.controller.cli import main

    monkeypatch.setattr(sys, "stderr", _FullDisk())
    # errors said to a full disk: the status still tells, and no OSError is raised saying them
    assert main(["generate", "--model", "/nonexistent/deskfleet-test", "--prompt", "x"]) == 2
    assert agent_main(["pause", "--data-dir", "/nonexistent/deskfleet-test"]) == 2
    with pytest.raises(SystemExit) as usage:
        main(["generate"])  # argparse's usage and error, then its exit
    assert usage.value.code == 2

