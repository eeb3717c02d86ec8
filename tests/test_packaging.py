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
