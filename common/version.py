"""The installed deskfleet version: what a Hello says, mDNS advertises and `fleet ls` shows."""

from __future__ import annotations

import importlib.metadata


def software_version() -> str:
    """The installed deskfleet version, or "0+unknown" when run from an uninstalled tree."""
    try:
        return importlib.metadata.version("deskfleet")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
