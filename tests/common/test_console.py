"""tolerate_unencodable: a stream in an encoding without a character writes its escape instead of raising."""

from __future__ import annotations

import io

import pytest

from deskfleet.common.console import tolerate_unencodable

TEXT = "営業部-PC 🙂 done\n"


def cp1252_stream(errors: str = "strict") -> tuple[io.BytesIO, io.TextIOWrapper]:
    raw = io.BytesIO()
    return raw, io.TextIOWrapper(raw, encoding="cp1252", errors=errors)


def test_a_strict_stream_escapes_what_its_encoding_lacks() -> None:
    raw, stream = cp1252_stream()
    with pytest.raises(UnicodeEncodeError):
        stream.write(TEXT)
        stream.flush()
    raw, stream = cp1252_stream()
    tolerate_unencodable(stream)
    stream.write("café " + TEXT)
    stream.flush()
    assert raw.getvalue() == "café \\u55b6\\u696d\\u90e8-PC \\U0001f642 done\n".encode("cp1252")


def test_a_stream_with_its_own_error_handling_or_not_a_text_wrapper_is_left_alone() -> None:
    _, stream = cp1252_stream(errors="replace")
    tolerate_unencodable(stream)
    assert stream.errors == "replace"
    text = io.StringIO()
    tolerate_unencodable(text)
    text.write(TEXT)
    assert text.getvalue() == TEXT
