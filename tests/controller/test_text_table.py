"""controller/text_table: columns as wide as their widest cell, in terminal columns (a Japanese hostname's characters
take two each), right-aligned where asked, no trailing spaces."""

from __future__ import annotations

import pytest

from deskfleet.controller.text_table import display_width, format_table, terminal_safe


@pytest.mark.parametrize(("text", "width"), [
    ("", 0), ("pc-01", 5), ("営業部-pc01", 11),  # 3 wide characters + 5 narrow
    ("ｐｃ", 4),  # full-width Latin
    ("ｶﾅ", 2),  # half-width katakana: narrow
    ("e\u0301", 1),  # e + a combining acute accent
    ("a\u200bb", 2),  # a zero-width space (Cf) between
    ("\U0001f469\u200d\U0001f4bb", 2),  # woman + ZWJ + laptop: one emoji
    ("\u1100\u1161", 2),  # conjoining Hangul jamo: one syllable
    ("\u263a\ufe0f", 2),  # a smiley with VS16: drawn as an emoji
    ("a\x1bb", 2),  # a control character counts none
])
def test_display_width(text: str, width: int) -> None:
    assert display_width(text) == width


def test_columns_line_up_whatever_a_cell_holds() -> None:
    rows = [("agent", "host", "address", "free", "notes"),
            ("aaaa", "営業部-pc01", "[::1]:7431", "8.0GiB", "x"),
            ("bbbbbbbbbbbb", "pc2", "127.0.0.1:7431", "-", "cannot reach it: refused")]
    lines = format_table(rows, right_aligned={3})
    assert lines == [
        "agent         host         address           free  notes",  # a right-aligned header too
        "aaaa          営業部-pc01  [::1]:7431      8.0GiB  x",
        "bbbbbbbbbbbb  pc2          127.0.0.1:7431       -  cannot reach it: refused",
    ]
    # each column starts at the same terminal column on every line
    for header in ("host", "address", "notes"):
        start = display_width(lines[0][:lines[0].index(header)])
        for line, row in zip(lines[1:], rows[1:], strict=True):
            cell = row[rows[0].index(header)]
            assert display_width(line[:line.index(cell)]) == start


def test_no_line_ends_in_a_space() -> None:
    lines = format_table([("a", "b", "c"), ("long cell", "", ""), ("x", "y", "")])
    assert lines == ["a          b  c", "long cell", "x          y"]


def test_a_row_of_the_wrong_length_is_named() -> None:
    with pytest.raises(ValueError, match="row 2 has 1 cells, the header 2"):
        format_table([("a", "b"), ("1", "2"), ("3",)])
    assert format_table([]) == []


def test_a_cell_a_pc_fills_can_neither_forge_a_row_nor_send_the_terminal_an_escape() -> None:
    # a model id and a status a PC reports: a newline forged a second row, an ESC ran an escape, a right-to-left
    # override showed the text backwards; a ZWJ emoji sequence is drawn as one and stays
    rows = [("agent", "notes"), ("a", "m[0:2]\n deadbeefdead  ceo-laptop  serving\x1b[2J\u202egnivres\u2028x"),
            ("b", "\U0001f469\u200d\U0001f4bb ok")]
    lines = format_table(rows)
    assert lines == ["agent  notes", "a      m[0:2]? deadbeefdead  ceo-laptop  serving?[2J?gnivres?x",
                     "b      \U0001f469\u200d\U0001f4bb ok"]
    assert terminal_safe("tab\there\r") == "tab?here?"
