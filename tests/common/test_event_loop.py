"""Which event loop the network code runs on: uvloop where installed, the standard loop on request."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import threading
import time
from typing import Any

import pytest

from deskfleet.common import event_loop
from deskfleet.common.event_loop import ENV_VAR, EventLoopError, chosen_loop
from deskfleet.common.stop_signal import Stopped, StopSignal


@pytest.mark.parametrize(("setting", "installed", "expected"), [
    (None, True, "uvloop"), (None, False, "asyncio"),
    ("auto", True, "uvloop"), ("", True, "uvloop"), (" UVLoop ", True, "uvloop"),
    ("asyncio", True, "asyncio"), ("asyncio", False, "asyncio"),
])
def test_chosen_loop(setting: str | None, installed: bool, expected: str) -> None:
    environ = {} if setting is None else {ENV_VAR: setting}
    assert chosen_loop(environ, uvloop_installed=installed) == expected


def test_asking_for_a_missing_uvloop_is_an_error() -> None:
    with pytest.raises(EventLoopError, match="uvloop is not installed"):
        chosen_loop({ENV_VAR: "uvloop"}, uvloop_installed=False)


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(EventLoopError, match=r"DESKFLEET_EVENT_LOOP='libuv' is not one of auto, uvloop, asyncio"):
        chosen_loop({ENV_VAR: "libuv"}, uvloop_installed=True)


def test_run_closes_the_coroutine_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "libuv")

    async def never() -> None:
        raise AssertionError("must not run")

    coroutine = never()
    with pytest.raises(EventLoopError):
        event_loop.run(coroutine)
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning at exit


@pytest.mark.parametrize("where", ["Runner.run", "Runner", "loop_factory"])
def test_run_closes_a_coroutine_a_signal_stopped_before_it_started(monkeypatch: pytest.MonkeyPatch,
                                                                   where: str) -> None:
    # `bench fleet` stopped by SIGINT as its deploy began printed "coroutine ... was never awaited" after its
    # one-line message; and a fresh-clone CI run's SIGTERM while it deployed, before the runner ran (the loop being
    # chosen or the runner made)
    def interrupted(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt

    class InterruptedRunner(asyncio.Runner):
        def run(self, coro: object, **kwargs: object) -> object:  # type: ignore[override]
            raise KeyboardInterrupt

    if where == "loop_factory":
        monkeypatch.setattr(event_loop, "loop_factory", interrupted)
    else:
        monkeypatch.setattr(event_loop.asyncio, "Runner", InterruptedRunner if where == "Runner.run" else interrupted)

    async def never() -> None:
        raise AssertionError("must not run")

    coroutine = never()
    with pytest.raises(KeyboardInterrupt):
        event_loop.run(coroutine)
    assert coroutine.cr_frame is None


def test_an_interrupt_stays_an_interrupt_when_its_loop_cannot_be_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    # uvloop interrupted by a signal handler's KeyboardInterrupt once stayed marked running: the runner's close then
    # raised "Cannot close a running event loop" over the interrupt (`bench fleet` stopped mid-deploy exited 2, not 130)
    closed: list[bool] = []

    class StuckRunner(asyncio.Runner):
        def run(self, coro: object, **kwargs: object) -> object:  # type: ignore[override]
            raise KeyboardInterrupt

        def close(self) -> None:
            closed.append(True)
            super().close()
            raise RuntimeError("Cannot close a running event loop")

    monkeypatch.setattr(event_loop.asyncio, "Runner", StuckRunner)

    async def never() -> None:
        raise AssertionError("must not run")

    with pytest.raises(KeyboardInterrupt):
        event_loop.run(never())
    assert closed == [True]  # tried once
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="oops"):  # any other error of a run is the run's, as before

        async def fails() -> None:
            raise RuntimeError("oops")

        event_loop.run(fails())


def test_a_loop_that_cannot_be_closed_leaves_no_coroutine_unawaited(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CI run of `bench fleet` stopped by SIGTERM while its survey had just made a task per address of a PC: the
    # loop could not be closed (see above), so no one cancelled and ran those tasks, and the never-started
    # coroutine printed "coroutine '_ask_at_any.<locals>.ask' was never awaited" after the bench's last line.
    started: list[object] = []
    # the standard loop stops at once on the interrupt; uvloop runs the rest of the iteration's callbacks first
    # (the unstarted task too), so only there would the loop's own leftovers be unclear
    runners, real_close = _closes_raising(monkeypatch, RuntimeError("Cannot close a running event loop"))

    async def ask() -> None:
        await asyncio.sleep(0)

    tasks: list[asyncio.Task[None]] = []

    async def main() -> None:
        unstarted, running = ask(), ask()
        started.extend([unstarted, running])
        tasks.append(asyncio.ensure_future(running))
        await asyncio.sleep(0)  # `running` starts and waits in its sleep
        tasks.append(asyncio.ensure_future(unstarted))
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            event_loop.run(main())
        unstarted, running = started
        assert unstarted.cr_frame is None  # type: ignore[attr-defined]  # closed: nothing to warn about
        assert running.cr_frame is not None  # type: ignore[attr-defined]  # left to the loop: it had begun
        # ... and told not to log "Task was destroyed but it is pending!" when collected (a CI run of `bench fleet`
        # stopped by SIGINT as it deployed printed it after its last line)
        assert not tasks[0].done() and tasks[0]._log_destroy_pending is False  # type: ignore[attr-defined]
    finally:
        real_close(runners[0])  # cancels and runs what is left


def _loop_module() -> str:
    async def probe() -> str:
        return type(asyncio.get_running_loop()).__module__

    return event_loop.run(probe())


def test_run_uses_the_standard_loop_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "asyncio")
    assert _loop_module().startswith("asyncio")


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed here")
def test_run_uses_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert _loop_module().startswith("uvloop")


def _closes_raising(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> tuple[list[asyncio.Runner], Any]:
    """Runners on the standard loop whose close() raises `error` (a stuck loop's RuntimeError, a signal's
    KeyboardInterrupt): the runners made, and the real close to call on them after the test."""
    runners: list[asyncio.Runner] = []
    real_close = asyncio.Runner.close  # event_loop.asyncio is asyncio: the patch below replaces it everywhere

    class FailingClose(asyncio.Runner):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]
            runners.append(self)

        def close(self) -> None:
            raise error

    monkeypatch.setattr(event_loop.asyncio, "Runner", FailingClose)
    monkeypatch.setenv(ENV_VAR, "asyncio")
    return runners, real_close

@pytest.mark.parametrize("run_ends", ["interrupted", "finished"])
def test_an_interrupted_close_leaves_no_pending_task_to_complain_after_the_last_line(
        monkeypatch: pytest.MonkeyPatch, run_ends: str) -> None:
    # CI runs of `bench fleet` stopped by a signal as they deployed printed "Task was destroyed but it is pending!"
    # after their one-line message: the run's task left cancelling (a second signal while the close ran the
    # cancelled tasks), or a survey's task the close was running when the signal came just as the run had ended
    runners, real_close = _closes_raising(monkeypatch, KeyboardInterrupt())
    tasks: list[asyncio.Task[None]] = []

    async def main() -> None:
        tasks.append(asyncio.ensure_future(asyncio.sleep(60)))  # a background task the run leaves behind
        await asyncio.sleep(0)
        if run_ends == "interrupted":
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            event_loop.run(main())
        assert not tasks[0].done() and tasks[0]._log_destroy_pending is False  # type: ignore[attr-defined]
    finally:
        real_close(runners[0])


def test_a_run_refused_before_it_began_raises_its_own_error() -> None:
    # run() inside a running loop is refused by asyncio.Runner before it makes a loop: closing must not make one
    # (which replaced the error with "Cannot run the event loop while another loop is running")
    async def inner() -> None:
        async def nothing() -> None:
            pass

        coroutine = nothing()
        with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
            event_loop.run(coroutine)
        assert coroutine.cr_frame is None  # closed: no "never awaited" warning

    asyncio.run(inner())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_stop_from_another_thread_cancels_the_run_and_lets_its_clean_up_run(
        monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    # serve --fleet's close waited 30 s for a re-plan on the engine's thread, then left with the deploy half done
    if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        pytest.skip("uvloop is not installed here")
    monkeypatch.setenv(ENV_VAR, loop)
    stop = StopSignal()
    cleaned: list[str] = []
    waiting = threading.Event()

    async def deploy() -> str:
        try:
            waiting.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # a deploy's own clean-up awaits too (it tells the PCs to release)
            cleaned.append("released")
            raise
        return "deployed"

    threading.Thread(target=lambda: waiting.wait(30) and stop.set()).start()  # once it waits, as a re-plan does
    started = time.monotonic()
    with pytest.raises(Stopped):
        event_loop.run(deploy(), stop=stop)
    assert time.monotonic() - started < 5 and cleaned == ["released"]


def test_a_cancel_that_a_stop_caused_and_the_work_turned_into_another_error_is_still_a_stop() -> None:
    # a TaskGroup whose child fails as the cancel comes raises the child's error: a re-plan then noted a PC as
    # tried and failed, and counted a failed re-plan, at a server's stop
    stop = StopSignal()

    async def deploy() -> None:
        try:
            stop.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise ValueError("a PC failed meanwhile") from None

    with pytest.raises(Stopped) as stopped:
        event_loop.run(deploy(), stop=stop)
    assert isinstance(stopped.value.__cause__, ValueError)


def test_a_run_given_a_stop_set_already_is_not_begun_and_leaves_no_coroutine_unawaited(
        recwarn: pytest.WarningsRecorder) -> None:
    stop = StopSignal()
    stop.set()
    begun: list[bool] = []

    async def work() -> None:
        begun.append(True)

    with pytest.raises(Stopped):
        event_loop.run(work(), stop=stop)
    gc.collect()
    assert begun == [] and not [w for w in recwarn if "never awaited" in str(w.message)]


def test_a_run_whose_stop_is_not_set_returns_its_result_and_a_cancel_of_its_own_stays_one() -> None:
    stop = StopSignal()

    async def answer() -> int:
        return 42

    assert event_loop.run(answer(), stop=stop) == 42

    async def cancelled_inside() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        event_loop.run(cancelled_inside(), stop=stop)
