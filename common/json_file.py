"""Reading a JSON file that must hold one object, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonFileError(ValueError):
    """The file cannot be read, is not UTF-8 JSON, or holds something other than a JSON object."""


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`. FileNotFoundError when it is missing; JsonFileError naming the file when it
    cannot be read (a folder, no permission), is not UTF-8 JSON, or holds an array, a string, a number."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except UnicodeDecodeError as error:
        raise JsonFileError(f"{path} is not valid JSON: {error}") from None
    except OSError as error:
        raise JsonFileError(f"{path} cannot be read: {error.strerror or error}") from None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise JsonFileError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise JsonFileError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value
