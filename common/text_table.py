"""A plain-text table whose columns are as wide as their longest cell, measured in terminal columns.

Fixed column widths put a row out of line wherever a cell outgrew its column (an IPv6 address, a long
hostname), and counting characters does it for an East Asian wide character, which a terminal draws two
columns wide (a Japanese hostname)."""

from __future__ import annotations

import unicodedata
from collections.abc import Collection, Sequence


def display_width(text: str) -> int:
    """How many terminal columns `text` takes: 2 for a wide or full-width character (East Asian Width W or F),
    0 for a combining mark or a zero-width format character, 1 for any other."""
    width = 0
    for char in text:
        if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
            continue
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return width


def format_table(rows: Sequence[Sequence[str]], right_aligned: Collection[int] = ()) -> list[str]:
    """The rows (the first is the header) as lines, the cells of a column padded to its widest cell and two spaces
    between columns. A column whose index is in `right_aligned` is padded on the left. The last column is not
    padded (left-aligned), so that a long note there leaves no trailing spaces; no line ends in a space.
    Every row must have as many cells as the header."""
    if not rows:
        return []
    columns = len(rows[0])
    for index, row in enumerate(rows):
        if len(row) != columns:
            raise ValueError(f"row {index} has {len(row)} cells, the header {columns}")
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
