"""A controller key open to other users (a backup restored from a zip or a USB stick, a copy that dropped
the modes) is warned about, naming the file and the chmod: nothing said so."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deskfleet.controller import fleet_store
from deskfleet.controller.cli import main

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")


class Records(logging.Handler):
    """The fleet store's own records: a handler on its logger, not caplog's on the root, which some earlier
    test of the suite left no longer receiving them (the warning was given, caplog saw nothing)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def store_warnings() -> Iterator[Records]:
    handler = Records()
    fleet_store.log.addHandler(handler)
    try:
        yield handler
    finally:
        fleet_store.log.removeHandler(handler)


@pytest.mark.parametrize("name", ["ca-key.pem", "controller-key.pem"])
def test_a_key_readable_by_others_is_warned(tmp_path: Path, store_warnings: Records,
                                            monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(fleet_store, "_WARNED_MODES", set())
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0
    for key in ("ca-key.pem", "controller-key.pem"):
        assert (tmp_path / "ctl" / key).stat().st_mode & 0o777 == 0o600
    store_warnings.records.clear()
    assert main(["fleet", "token", *data]) == 0
    assert not [record for record in store_warnings.records if "open to other users" in record.getMessage()]
    (tmp_path / "ctl" / name).chmod(0o644)
    assert main(["fleet", "token", *data]) == 0
    assert main(["fleet", "token", *data]) == 0
    said = [record.getMessage() for record in store_warnings.records if "open to other users" in record.getMessage()]
    assert len(said) == 1, said  # once, not at every look at the keys
    assert f"{tmp_path / 'ctl' / name} (" in said[0] and "mode 644" in said[0]
    assert f"chmod 600 {tmp_path / 'ctl' / name}" in said[0]


def test_on_windows_a_data_dir_outside_the_profile_is_warned_of_once(tmp_path: Path, store_warnings: Records,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # File modes mean nothing on Windows, so nothing was said about a data dir made at C:\deskfleet, whose keys
    # every local user can read there (the drive root's permissions are inherited)
    monkeypatch.setattr(fleet_store, "_WARNED_MODES", set())
    store = fleet_store.FleetStore(tmp_path / "controller")
    store._warn_if_outside_profile(str(tmp_path))  # inside the profile: the user's own
    store._warn_if_outside_profile(None)  # no profile known: nothing to say
    assert store_warnings.records == []
    for _ in range(2):
        store._warn_if_outside_profile(str(tmp_path / "home" / "john"))
    (warning,) = [record.getMessage() for record in store_warnings.records]
    assert f"{tmp_path / 'controller'} is outside your user profile" in warning
    assert "icacls" in warning and "%USERNAME%:(OI)(CI)F" in warning
    other = fleet_store.FleetStore(tmp_path / "controllerX")  # a name that merely starts like the profile's
    other._warn_if_outside_profile(str(tmp_path / "controller"))
    assert len(store_warnings.records) == 2
