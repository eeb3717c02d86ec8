"""Finished prompts' KV states kept on the chain, for later requests that begin with the same tokens.

An OpenAI client sends a chat's whole conversation again at every turn, and many requests share a long system
prompt; prefilling those tokens again costs a reply's first token most of its wait. The engine keeps two kinds of
KV state for them (Engine, EngineOptions.prefix_cache_tokens):
- a prompt prefilled alone and then admitted into a running micro-batch: its one-row micro-batch is copied into the
  batch as ever, and kept instead of freed (Forward.keep_sources), holding the prompt;
- a stream that was the last row of its micro-batch when it ended: the micro-batch is kept, holding its prompt and
  its reply but the last token.
A newcomer whose prompt shares at least `min_shared` of its tokens with an entry takes the entry (it serves one
request): the engine rolls it back by mask to the shared prefix and feeds only the rest.

This module is the bookkeeping alone: which entries exist, the best one for a prompt, and which to give up when
they hold more tokens than the capacity or grew older than `max_age_s` (a fleet's agents free a micro-batch idle
for MICRO_BATCH_IDLE_S: a step on a freed one fails). An entry given up is released (its KV state freed on every
stage) here. Entries expire when a request looks, and an idle server (EngineService) expires them on time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt


class KeptState(Protocol):
    """What the cache holds: a KV state on the chain (engine.KeptKV) and the tokens it holds."""

    tokens: tuple[int, ...]

    def release(self) -> None: ...


@dataclass
class _Entry:
    state: KeptState
    tokens: npt.NDArray[np.int64]
    since: float  # when it was kept
    used: int  # the cache's clock at its last put: least recently kept goes first


class PrefixCache:
    """Kept KV states by the tokens they hold, at most `capacity_tokens` of them together (0: the cache is off)."""

    def __init__(self, capacity_tokens: int, max_age_s: float, min_shared: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"the prefix cache's capacity must be 0 (off) or more tokens, not {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.max_age_s = max_age_s
        self.min_shared = min_shared
        self._clock = clock
        self._entries: list[_Entry] = []
        self._puts = 0
        self.hits = 0  # entries taken
        self.misses = 0  # prompts looked up that took none
        self.reused_tokens = 0  # prompt tokens the taken entries held

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    @property
    def tokens(self) -> int:
        """Tokens the entries hold together."""
        return sum(entry.tokens.size for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, state: KeptState) -> None:
        """Keep `state`. Entries whose tokens begin its own are released (it serves every prompt they serve, and
        more), then the least recently kept until the entries fit the capacity; a state larger than the capacity
        is released at once."""
        if not self.enabled or len(state.tokens) > self.capacity_tokens or not state.tokens:
            state.release()
            return
        tokens = np.asarray(state.tokens, dtype=np.int64)
        self.expire()
        for entry in [entry for entry in self._entries
                      if entry.tokens.size <= tokens.size and np.array_equal(tokens[:entry.tokens.size], entry.tokens)]:
            self._drop(entry)
        self._puts += 1
        self._entries.append(_Entry(state, tokens, self._clock(), self._puts))
        while self.tokens > self.capacity_tokens:
            self._drop(min(self._entries, key=lambda entry: entry.used))

    def seconds_to_expiry(self) -> float | None:
        """Seconds until the oldest entry passes its age (0 or less: it has); None with no entries. An idle server
        waits this long, then expire()s: entries are otherwise given up only when a request looks."""
        if not self._entries:
            return None
        # the age as expire() reckons it (now - since): (since + max_age) - now can round to 0 while expire() still
        # finds the entry younger than max_age, and an idle server would wake for it until the clock moved on
        now = self._clock()
        return self.max_age_s - max(now - entry.since for entry in self._entries)

    def expire(self) -> None:
        """Release the entries kept max_age_s or longer (seconds_to_expiry() <= 0: none is left to wake for)."""
        now = self._clock()
        for entry in [entry for entry in self._entries if now - entry.since >= self.max_age_s]:
            self._drop(entry)

    def best_shared(self, prompt_ids: Sequence[int]) -> int:
        """The most of the prompt's first tokens (all but its last at most) any entry holds; 0 with none."""
        return max((shared_prefix(entry.tokens, prompt_ids) for entry in self._entries), default=0)

    def take(self, prompt_ids: Sequence[int], usable: Callable[[KeptState], bool] = lambda state: True
             ) -> tuple[KeptState, int] | None:
        """The `usable` entry sharing the longest prefix with the prompt, and that prefix's length (at most all but
        the prompt's last token, which must be fed for the first token), where it is at least `min_shared` of the
        prompt; the entry then leaves the cache. None where no entry shares enough."""
        self.expire()
        entries = [entry for entry in self._entries if usable(entry.state)]
        if not entries or len(prompt_ids) < 2:
            if self.enabled:
                self.misses += 1
            return None
        shared, best = max(((shared_prefix(entry.tokens, prompt_ids), entry) for entry in entries),
                           key=lambda pair: (pair[0], pair[1].used))
        if shared == 0 or shared < self.min_shared * len(prompt_ids):
            self.misses += 1
            return None
        self._entries.remove(best)
        self.hits += 1
        self.reused_tokens += shared
        return best.state, shared

    def clear(self) -> None:
        """Release every entry."""
        for entry in list(self._entries):
            self._drop(entry)

    # Private methods

    def _drop(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        entry.state.release()


def shared_prefix(tokens: Sequence[int] | npt.NDArray[np.int64], prompt_ids: Sequence[int]) -> int:
    """How many of the prompt's first tokens a kept state holds (`tokens` begins with them): at most all but the
    prompt's last, which must be fed for the first token."""
    limit = min(len(tokens), len(prompt_ids) - 1)
    if limit <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(tokens[:limit]) != np.asarray(prompt_ids[:limit]))
    return int(differ[0]) if differ.size else limit
