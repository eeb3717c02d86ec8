"""An employee PC installs no torch: nothing on the agent's import path may import it."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import deskfleet.agent


def test_agent_modules_import_without_torch_transformers_or_nncf() -> None:
    modules = sorted(f"deskfleet.agent.{info.name}" for info in pkgutil.iter_modules(deskfleet.agent.__path__))
    assert "deskfleet.agent.core" in modules and "deskfleet.agent.stage" in modules
    code = (f"import sys\nfor name in {modules!r}:\n    __import__(name)\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'nncf') if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parent)
    assert result.stdout.strip() == "", f"the agent imported {result.stdout.strip()}"
