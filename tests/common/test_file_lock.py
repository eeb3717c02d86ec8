"""Advisory file locks: a second holder is refused until the first lets go."""

from __future__ import annotations

from pathlib import Path

from deskfleet.common.file_lock import lock_file, try_lock_file, unlock_file


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with open(path, "a+") as first, open(path, "a+") as second:  # two opens conflict, as two processes would
        lock_file(first.fileno())
        assert not try_lock_file(second.fileno())
        unlock_file(first.fileno())
        assert try_lock_file(second.fileno())
        unlock_file(second.fileno())
