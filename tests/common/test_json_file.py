"""read_json_object: one JSON object per file, and every other content refused naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.common.json_file import JsonFileError, read_json_object


def test_an_object_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"a": [1, 2], "b": {"c": null}}', encoding="utf-8")
    assert read_json_object(path) == {"a": [1, 2], "b": {"c": None}}


@pytest.mark.parametrize(("content", "says"), [
    (b"{bad", "is not valid JSON"),
    (b"", "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"),
    (b"[" * 100_000, "is not valid JSON"),
    (b"[1, 2]", "must hold a JSON object, not list"),
    (b'"text"', "must hold a JSON object, not str"),
    (b"null", "must hold a JSON object, not NoneType"),
])
def test_other_content_is_refused_naming_the_file(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "weird.json"
    path.write_bytes(content)
    with pytest.raises(JsonFileError, match=f"weird.json {says}"):
        read_json_object(path)


def test_a_folder_is_refused_and_a_missing_file_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(JsonFileError, match=r"folder\.json cannot be read"):
        read_json_object(tmp_path / "folder.json")
    with pytest.raises(FileNotFoundError):
        read_json_object(tmp_path / "missing.json")
