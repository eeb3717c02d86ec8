"""A plain-text table whose columns are as wide as their longest cell, measured in terminal columns.

Fixed column widths put a row out of line wherever a cell outgrew its column (an IPv6 address, a long
hostname), and counting characters does it for an East Asian wide character, which a terminal draws two
columns wide (a Japanese hostname), or an emoji sequence joined by ZWJ, which it draws as one. The widths are
wcwidth's, which follows the Unicode tables terminals draw by."""

from __future__ import annotations

import unicodedata
from collections.abc import Collection, Sequence

import wcwidth

_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def display_width(text: str) -> int:
    """How many terminal columns `text` takes (wcwidth.wcswidth); a character a terminal does not print (a control
    character, which format_table shows as '?') counts 0."""
    width = wcwidth.wcswidth(text)
    return width if width >= 0 else sum(max(wcwidth.wcwidth(char), 0) for char in text)


def terminal_safe(text: str) -> str:
    """`text` with each character that would change what a terminal shows besides itself as '?': a control
    character (a newline that would forge a row, an ESC that would run a terminal escape), a line or paragraph
    separator, and a bidirectional override or isolate (which shows text in another order than it reads). A
    cell's text may come from a PC (a model id or a status it reports). Zero-width joiners and the like stay: an
    emoji sequence is drawn as one."""
    return "".join("?" if unicodedata.category(char) in ("Cc", "Zl", "Zp") or char in _BIDI_CONTROLS else char
                   for char in text)


def format_table(rows: Sequence[Sequence[str]], right_aligned: Collection[int] = ()) -> list[str]:
    """The rows (the first is the header) as lines, the cells of a column padded to its widest cell and two spaces
    between columns; a character that would change what a terminal shows besides itself shows as
    '?' (`terminal_safe`). A column whose index is in `right_aligned` is padded on the left. The last column is not
    padded (left-aligned), so that a long note there leaves no trailing spaces; no line ends in a space.
    Every row must have as many cells as the header."""
    if not rows:
        return []
    columns = len(rows[0])
    for index, row in enumerate(rows):
        if len(row) != columns:
            raise ValueError(f"row {index} has {len(row)} cells, the header {columns}")
    rows = [[terminal_safe(cell) for cell in row] for row in rows]
    widths = [max(display_width(row[column]) for row in rows) for column in range(columns)]
    lines = []
    for row in rows:
        cells = []
        for column, cell in enumerate(row):
            pad = " " * (widths[column] - display_width(cell))
            if column in right_aligned:
                cells.append(pad + cell)
            elif column < columns - 1:
                cells.append(cell + pad)
            else:
                cells.append(cell)
        lines.append("  ".join(cells).rstrip())
    return lines
