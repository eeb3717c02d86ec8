"""The console scripts' entry points (`deskfleet`, `deskfleet-agent`).

A command's modules take a second or two to import (OpenVINO, numpy, the commands themselves); a Ctrl-C in
that time ends the command as a Ctrl-C anywhere else in it does, with exit status 130, not with a traceback
of the import. This module imports nothing heavy itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as the shell reports it


def deskfleet() -> int:
    return _run("deskfleet.controller.cli")


def deskfleet_agent() -> int:
    return _run("deskfleet.agent.cli")


def _run(module: str) -> int:
    try:
        main: Callable[[], int] = importlib.import_module(module).main
    except KeyboardInterrupt:
        return INTERRUPTED_EXIT
    return main()
