"""StopMatcher: the first stop sequence and what may still begin one, fed piece by piece, as a search of the whole
text after each piece finds them."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.controller.stop_sequences import StopMatcher

_ALPHABET = "ab c"  # a few characters, so that stops overlap, repeat and begin inside each other


def _searched(text: str, stops: list[str]) -> int | None:
    found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    return min(found) if found else None


def _pending(text: str, stops: list[str]) -> int:
    return max((size for stop in stops for size in range(1, len(stop)) if text.endswith(stop[:size])), default=0)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4),
       pieces=st.lists(st.text(_ALPHABET, max_size=5), max_size=12))
def test_fed_piece_by_piece_it_finds_what_a_search_after_each_piece_finds(stops: list[str],
                                                                          pieces: list[str]) -> None:
    matcher = StopMatcher(stops)
    text = ""
    for piece in pieces:
        text += piece
        expected = _searched(text, stops)
        assert matcher.feed(piece) == expected == matcher.found
        if expected is not None:
            break
        assert matcher.pending == _pending(text, stops)


def test_once_found_it_stays_at_the_first_stop() -> None:
    matcher = StopMatcher(["bc", "abcd"])
    assert matcher.feed("xa") is None and matcher.pending == 1  # "a" may begin "abcd"
    assert matcher.feed("bcd") == 1  # "abcd" begins first, and completes in the same piece as "bc"
    assert matcher.feed("bc") == 1


def test_a_stop_begun_in_one_piece_and_completed_in_another_is_found() -> None:
    matcher = StopMatcher(["\n\n"])
    assert matcher.feed("def f():\n") is None and matcher.pending == 1
    assert matcher.feed("\n") == 8


def test_a_long_stop_costs_the_text_not_its_length_a_character() -> None:
    # a search of the text's tail for every prefix of a 20,000-character stop took seconds a token
    stop = "x" * 19_999 + "y"
    matcher = StopMatcher([stop])
    started = time.process_time()
    for _ in range(2_000):
        matcher.feed("xx")
    assert matcher.pending == 4_000 and matcher.found is None
    assert time.process_time() - started < 2.0  # a few ms: the quadratic search took minutes here


def test_an_empty_stop_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        StopMatcher(["a", ""])
