"""software_version: the installed package's version, or a marker that says it is not installed."""

from __future__ import annotations

import importlib.metadata

import pytest

from deskfleet.common import version


def test_the_installed_version_is_the_package_metadata_s() -> None:
    assert version.software_version() == importlib.metadata.version("deskfleet")


def test_an_uninstalled_tree_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.importlib.metadata, "version", missing)
    assert version.software_version() == "0+unknown"
