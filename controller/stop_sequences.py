"""Stop sequences in a reply whose text grows at its end: where the first one begins, and how much of the text's
end could still begin one (what a streamed reply must hold back, and no more).

Each stop sequence has a Knuth-Morris-Pratt automaton whose state is the longest prefix of the stop that the text
so far ends with, so a character costs amortized constant time per stop whatever the stops' lengths (a search of
the text's tail for each prefix cost a 20,000-character stop seconds a token).
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(stop: str) -> list[int]:
    """For each prefix stop[:i + 1], the length of its longest proper prefix that is also its suffix."""
    table = [0] * len(stop)
    matched = 0
    for at in range(1, len(stop)):
        while matched and stop[at] != stop[matched]:
            matched = table[matched - 1]
        if stop[at] == stop[matched]:
            matched += 1
        table[at] = matched
    return table


class StopSequences:
    """A request's stop sequences and their automata's tables, made once for all its choices (StopMatcher)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop sequence must not be empty")
        self.stops = tuple(stops)
        self.tables = tuple(_failure(stop) for stop in self.stops)


class StopMatcher:
    """Fed a text piece by piece: `found`, where the first stop sequence met begins (None: none yet), and
    `pending`, the characters at the text's end that begin a stop sequence and may yet complete it."""

    def __init__(self, stops: StopSequences | Sequence[str]) -> None:
        sequences = stops if isinstance(stops, StopSequences) else StopSequences(stops)
        self._stops = sequences.stops
        self._tables = sequences.tables
        self._states = [0] * len(self._stops)
        self.fed = 0  # characters fed
        self.found: int | None = None

    @property
    def pending(self) -> int:
        return max(self._states, default=0)

    def feed(self, text: str) -> int | None:
        """Take the text's next characters; `found` once a stop sequence completes in them. Where several complete
        in one piece, the one that begins first (as searching the piece's text for each would find). Nothing more
        is matched once one was found."""
        if self.found is not None:
            return self.found
        starts: list[int] = []
        for char in text:
            self.fed += 1
            for index, stop in enumerate(self._stops):
                matched, table = self._states[index], self._tables[index]
                while matched and char != stop[matched]:
                    matched = table[matched - 1]
                if char == stop[matched]:
                    matched += 1
                if matched == len(stop):
                    starts.append(self.fed - matched)
                    matched = table[matched - 1]
                self._states[index] = matched
        if starts:
            self.found = min(starts)
        return self.found
