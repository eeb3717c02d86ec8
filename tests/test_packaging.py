"""`pip install .` (not only -e) ships every package under deskfleet.* and both console scripts."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_the_console_scripts(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("deskfleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    source_packages = {path.parent.relative_to(ROOT).as_posix() for folder in ("common", "agent", "controller")
                       for path in (ROOT / folder).rglob("__init__.py")}
    shipped = {name.rsplit("/", 1)[0].removeprefix("deskfleet/") for name in names if name.endswith("__init__.py")}
    assert shipped == source_packages, "a package folder is missing from pyproject's packages list"
    entry_points = next(zipfile.ZipFile(wheel).read(name).decode() for name in names
                        if name.endswith("entry_points.txt"))
    assert "deskfleet = deskfleet.common.launch:deskfleet" in entry_points
    assert "deskfleet-agent = deskfleet.common.launch:deskfleet_agent" in entry_points
    assert "deskfleet/agent/__main__.py" in names  # `python -P -m deskfleet.agent`: what autostart runs
    assert "deskfleet/controller/__main__.py" in names  # `python -P -m deskfleet.controller`: the deploy dialog


def test_the_release_names_the_fleet_protocol_it_speaks() -> None:
    # Every release said "deskfleet 0.1.0", protocols 1 to 8 alike: `fleet ls` showed one version for PCs that could
    # not talk to each other, and "protocol 7 (deskfleet 0.1.0), this controller 8 (deskfleet 0.1.0)" named no
    # release to install. A release 0.P.x speaks fleet protocol P: a change of protocol is a new minor release.
    import importlib.metadata
    import tomllib

    from deskfleet.common.wire import PROTOCOL_VERSION

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    major, minor, _ = version.split(".", 2)
    assert (major, minor) == ("0", str(PROTOCOL_VERSION)), \
        f"pyproject's version {version} does not say protocol {PROTOCOL_VERSION}: make it 0.{PROTOCOL_VERSION}.0"
    assert importlib.metadata.version("deskfleet") == version, "the venv's install is stale: run scripts/bootstrap.sh"
