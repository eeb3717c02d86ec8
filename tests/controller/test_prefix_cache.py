"""PrefixCache's bookkeeping, with fake kept states: the entry sharing the longest prefix is taken (once), where it
shares enough of the prompt; entries that begin a newer one's tokens go; the least recently kept go past the
capacity, and any past their age; whatever goes is released, once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deskfleet.controller.prefix_cache import PrefixCache
from tests.fake_clock import FakeClock


class Kept:
    def __init__(self, *tokens: int) -> None:
        self.tokens = tuple(tokens)
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_the_entry_sharing_the_most_is_taken_once_and_none_below_the_share() -> None:
    cache = PrefixCache(100, 60.0, 0.5)
    short, long = Kept(1, 2, 3), Kept(1, 2, 9, 9)
    cache.put(short)
    cache.put(long)
    assert cache.take([1, 2, 3, 4, 5]) == (short, 3)
    assert cache.take([1, 2, 3, 4, 5]) is None  # taken: it serves one request; the other shares 2 of 5
    assert (cache.hits, cache.misses, cache.reused_tokens) == (1, 1, 3)
    # at most all but the prompt's last token, which must be fed for the first token
    assert cache.take([1, 2, 9]) == (long, 2)
    assert short.released == long.released == 0  # taken entries are the taker's to release
    assert cache.take([5]) is None and len(cache) == 0


def test_an_entry_that_begins_a_newer_one_goes_and_the_least_recently_kept_go_past_the_capacity() -> None:
    cache = PrefixCache(10, 60.0, 0.5)
    prompt, turn = Kept(1, 2, 3), Kept(1, 2, 3, 4, 5)
    cache.put(prompt)
    cache.put(turn)
    assert prompt.released == 1 and len(cache) == 1  # the turn serves every prompt the prompt served
    other = Kept(7, 8, 9, 10)
    cache.put(other)
    assert cache.tokens == 9
    third = Kept(20, 21)
    cache.put(third)  # 11 tokens: the oldest goes
    assert turn.released == 1 and other.released == 0 and cache.tokens == 6
    huge = Kept(*range(11))
    cache.put(huge)  # larger than the whole cache
    assert huge.released == 1 and len(cache) == 2
    cache.clear()
    assert other.released == third.released == 1 and len(cache) == 0


def test_entries_past_their_age_are_released_and_an_off_cache_keeps_nothing() -> None:
    clock = FakeClock()
    cache = PrefixCache(100, 30.0, 0.5, clock=clock)
    old = Kept(1, 2, 3, 4)
    assert cache.seconds_to_expiry() is None
    cache.put(old)
    clock.now += 10.0
    assert cache.seconds_to_expiry() == 20.0
    clock.now += 21.0
    assert cache.seconds_to_expiry() == -1.0
    assert cache.take([1, 2, 3, 4, 5]) is None
    assert old.released == 1
    edge = Kept(7, 8)
    cache.put(edge)
    clock.now += 30.0  # exactly its age: seconds_to_expiry says 0, so expire() must free it (an idle server spun)
    assert cache.seconds_to_expiry() == 0.0
    cache.expire()
    assert edge.released == 1 and cache.seconds_to_expiry() is None
    clock.now = 724.004  # (724.004 + 300) - 1024.004 is 0.0, 1024.004 - 724.004 under 300: the two must agree
    late = PrefixCache(100, 300.0, 0.5, clock=clock)
    late.put(Kept(5, 6))
    clock.now = 1024.004
    if late.seconds_to_expiry() <= 0:  # type: ignore[operator]
        late.expire()
        assert len(late) == 0
    off = PrefixCache(0, 30.0, 0.5)
    kept = Kept(1, 2)
    off.put(kept)
    assert kept.released == 1 and not off.enabled and off.take([1, 2, 3]) is None
    with pytest.raises(ValueError, match="0 \\(off\\) or more tokens"):
        PrefixCache(-1, 30.0, 0.5)


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), min_size=2, max_size=10))
def test_the_taken_prefix_is_the_longest_any_entry_shares(entries: list[list[int]], prompt: list[int]) -> None:
    cache = PrefixCache(1000, 60.0, 0.0)
    for tokens in entries:
        cache.put(Kept(*tokens))
    held = [entry.state.tokens for entry in cache._entries]

    def shared(tokens: tuple[int, ...]) -> int:
        count = 0
        while count < min(len(tokens), len(prompt) - 1) and tokens[count] == prompt[count]:
            count += 1
        return count

    best = max(shared(tokens) for tokens in held)
    hit = cache.take(prompt)
    if best == 0:
        assert hit is None
    else:
        assert hit is not None and hit[1] == best == shared(hit[0].tokens)
