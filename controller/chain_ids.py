"""The micro-batch ids a stage chain puts on its stages, and the steps it still awaits.

An engine numbers its micro-batches from 1, and the next engine on the same chain (the next chat reply)
starts at 1 again while steps of a run stopped early (Ctrl-C, a stage's failure) may still be in flight.
So a chain shifts every id by a base of its own and takes a fresh base at renumber(): the stages then
never see an old id again, and a late result of the old run matches no step awaited now and is dropped.
Both chains, LocalPipeline (an incrementing base) and FleetPipeline (bases in turn inside a random range of
its own, so that two drivers on one fleet never meet either, and the agents send each its own results), keep
their ids here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from deskfleet.common.wire import Forward, ForwardResult


class ChainIds:
    """Engine ids <-> wire ids (engine id + base), and wire id -> the step id its awaited result carries.

    `span` bounds the engine's ids (every base is a multiple of it); `next_base` picks each base, the first
    one included. Not thread-safe, except is_awaited(), a single dict lookup, which a network thread may call.
    """

    def __init__(self, span: int, next_base: Callable[[], int]) -> None:
        self.span = span
        self._next_base = next_base
        self._base = next_base()
        self._earlier_bases: set[int] = set()  # one int a run: a late result of one is known as such
        self._awaited: dict[int, int] = {}  # wire micro-batch id -> the step id its result will carry
        self._tokens: dict[int, int] = {}  # wire micro-batch id -> the tokens (rows x width) its step feeds

    @property
    def in_flight(self) -> int:
        """How many steps are awaited."""
        return len(self._awaited)

    @property
    def largest_step_in_flight(self) -> int:
        """The tokens (rows x width) of the largest step awaited, 0 when none is: a prompt's step takes longer."""
        return max(self._tokens.values(), default=0)

    def send(self, message: Forward, **changes: Any) -> Forward:
        """The wire form of an engine's step (`changes` applied too), now awaited. ValueError if its
        micro-batch id is out of range or the micro-batch already has a step in flight."""
        for batch_id in (message.micro_batch_id, *message.copy_into):
            if not 0 <= batch_id < self.span:
                raise ValueError(f"micro-batch id {batch_id} outside [0, {self.span})")
        wire_id = self._base + message.micro_batch_id
        if wire_id in self._awaited:
            raise ValueError(f"micro-batch {message.micro_batch_id} already has a step in flight")
        if self._base or changes:  # a first local run sends the engine's own message: no copy per step
            message = replace(message, micro_batch_id=wire_id,
                              admit_from=tuple(self._base + source for source in message.admit_from),
                              copy_into=tuple(self._base + copy for copy in message.copy_into), **changes)
        self._awaited[wire_id] = message.step_id
        self._tokens[wire_id] = message.position_ids.size
        return message

    def receive(self, result: ForwardResult) -> ForwardResult | None:
        """The engine's form of a result, no longer awaited; None when no such step is awaited (a released
        micro-batch's, a run's stopped early, a duplicate): the caller drops it."""
        if self._awaited.get(result.micro_batch_id) != result.step_id:
            return None
        del self._awaited[result.micro_batch_id]
        del self._tokens[result.micro_batch_id]
        return replace(result, micro_batch_id=result.micro_batch_id - self._base) if self._base else result

    def fail(self, wire_id: int) -> bool:
        """A stage failed on this micro-batch's step: stop awaiting it. False when none was awaited."""
        self._tokens.pop(wire_id, None)
        return self._awaited.pop(wire_id, None) is not None

    def is_awaited(self, wire_id: int) -> bool:
        return wire_id in self._awaited

    def release(self, batch_id: int) -> int:
        """Stop awaiting the micro-batch's step in flight, if any; its wire id."""
        wire_id = self._base + batch_id
        self._awaited.pop(wire_id, None)
        self._tokens.pop(wire_id, None)
        return wire_id

    def engine_id(self, wire_id: int) -> int:
        return wire_id - self._base

    def from_earlier_run(self, wire_id: int) -> bool:
        """Whether the id is of a run before the last renumber() (a late result, not a duplicate)."""
        return wire_id - wire_id % self.span in self._earlier_bases

    def renumber(self) -> None:
        """A fresh base from now on; the steps in flight are no longer awaited."""
        self._earlier_bases.add(self._base)
        self._base = self._next_base()
        self._awaited = {}
        self._tokens = {}
