"""What a model writes is shown, not obeyed, on a terminal: controls and bidirectional overrides escaped."""

from __future__ import annotations

import pytest

from deskfleet.controller.text_printer import visible_controls

PLAIN = "line\n\tindented, \u05e9\u05dc\u05d5\u05dd \u200f and caf\u00e9"


@pytest.mark.parametrize(("text", "shown"), [
    ("a\x1b[2Jb", "a\\x1b[2Jb"),  # clear the screen
    ("x\r\x08y", "x\\x0d\\x08y"),  # overwrite what was shown
    ("\x9b31m", "\\x9b31m"),  # a one-character CSI
    ("if admin\u202e } \u2066{ ", "if admin\\u202e } \\u2066{ "),  # Trojan source: shown in another order
    (PLAIN, PLAIN),  # newline, tab, Hebrew with its right-to-left mark, accents: text
])
def test_controls_are_escaped_and_text_is_not(text: str, shown: str) -> None:
    assert visible_controls(text) == shown
