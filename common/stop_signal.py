"""A stop that one thread gives another's network work: what a Ctrl-C is to the main thread, for a thread no signal
reaches.

`deskfleet serve --fleet` drives its chain on an engine thread of its own, and a re-plan there (a survey, a deploy
waiting for a PC to compile its stage) or a step waiting for a stalled PC can take minutes. Its Ctrl-C or a service
manager's SIGTERM reaches the main thread only, which used to wait 30 s for the engine thread and then leave with a
deploy half done. Set, a StopSignal cancels the asyncio task that event_loop.run(main, stop=) runs (so a deploy's
own clean-up runs, as at a Ctrl-C), and calls whatever else registered to be woken (a chain's wait for a result).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class Stopped(Exception):
    """Work cut short because its StopSignal was set: the command is stopping, nothing failed."""


class StopSignal:
    """Set once, from any thread; never cleared."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next_key = 0

    def set(self) -> None:
        """Stop: call every registered callback (on this thread), once; one that fails is logged, and the others
        are called all the same."""
        with self._lock:
            if self._set.is_set():
                return
            self._set.set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a stop's callback failed")

    def is_set(self) -> bool:
        return self._set.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep `timeout` seconds, or less where the signal is set meanwhile; whether it is set."""
        return self._set.wait(timeout)

    def check(self, what: str) -> None:
        """Raise Stopped (saying `what` was cut short) where the signal is set."""
        if self.is_set():
            raise Stopped(f"{what} was cut short: stopping")

    @contextmanager
    def calling(self, callback: Callable[[], None]) -> Iterator[None]:
        """Have set() call `callback` while the block runs; at once where the signal is set already. The callback
        runs on the thread that sets the signal, after set() let its lock go (a callback may take locks of its own),
        so a stop that races the block's end may call it just after the block: it must only hand work over (a queue's
        put, a loop's call_soon_threadsafe, which a closed loop refuses) and stay harmless then."""
        with self._lock:
            already = self._set.is_set()
            key = self._next_key
            self._next_key += 1
            if not already:
                self._callbacks[key] = callback
        if already:
            callback()
        try:
            yield
        finally:
            with self._lock:
                self._callbacks.pop(key, None)
