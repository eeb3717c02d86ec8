"""`fleet remove`: the help and the error say how short an id prefix may be, and removing an agent twice
says it was already removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.controller.cli import build_parser, main
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_store import MIN_ID_PREFIX, FleetStore, RosterEntry

AGENT = "gmx" + "a" * 49  # 52 base32 characters: an agent id


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    store.save_roster({AGENT: RosterEntry(AGENT, "pc1", utc_now().isoformat())})
    return store.data_dir


def test_the_help_says_the_minimum_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fleet", "remove", "--help"])
    assert f"at least {MIN_ID_PREFIX} characters" in " ".join(capsys.readouterr().out.split())


def test_a_prefix_too_short_is_named_as_such(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "remove", "gmx", "--data-dir", str(data_dir)]) == 2
    error = capsys.readouterr().err
    assert "'gmx' is too short" in error and f"at least {MIN_ID_PREFIX} characters" in error
    assert main(["fleet", "remove", "zz", "--data-dir", str(data_dir)]) == 2  # matches nothing at all
    assert f"a prefix of an id needs at least {MIN_ID_PREFIX} characters" in capsys.readouterr().err
    assert main(["fleet", "remove", "gmxa", "--data-dir", str(data_dir)]) == 0
    assert f"removed agent {AGENT}" in capsys.readouterr().out


def test_removing_twice_says_already_removed(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "remove", "pc1", "--data-dir", str(data_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"removed agent {AGENT}")
    assert main(["fleet", "remove", "pc1", "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "already removed" in out and not out.startswith("removed")
