"""`deskfleet` without its optional extras (pyproject.toml): an agent-only install has neither tokenizers nor
torch. `--help` works; a command that needs an extra names it (exit 2) instead of a ModuleNotFoundError's
traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deskfleet.controller import cli

CONTROLLER = ("tokenizers", "jinja2", "aiohttp")
EXPORT = ("torch", "transformers", "safetensors", "nncf")
# A fresh interpreter in which the given packages cannot be imported (None in sys.modules), as on an install
# without them, running the CLI's main() on the rest of its arguments.
CHILD = """
import sys
missing, argv = sys.argv[1], sys.argv[2:]
for name in missing.split(","):
    sys.modules[name] = None
from deskfleet.controller.cli import main
sys.exit(main(argv))
"""


def run_without(missing: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, ",".join(missing), *argv], capture_output=True,
                          text=True, timeout=120, check=False)


def test_help_works_without_any_extra() -> None:
    result = run_without(CONTROLLER + EXPORT, "--help")
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout and "chat" in result.stdout and "fleet" in result.stdout
    result = run_without(CONTROLLER + EXPORT, "bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "fleet" in result.stdout


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "no-such-export", "--prompt", "hi"],
    ["chat", "--model", "no-such-export"],
    ["serve", "--model", "no-such-export"],
    ["bench", "fleet", "--model", "no-such-export"],
    ["bench", "fleet", "--help"],
])
def test_a_command_that_needs_the_controller_extra_names_it(argv: list[str]) -> None:
    result = run_without(CONTROLLER + EXPORT, *argv)
    assert result.returncode == 2
    assert 'this command needs the controller extra: pip install "deskfleet[controller]"' in result.stderr
    assert "Traceback" not in result.stderr


def test_jinja2_alone_missing_is_the_controller_extra_too() -> None:
    result = run_without(("jinja2",), "chat", "--model", "no-such-export")
    assert result.returncode == 2
    assert '"deskfleet[controller]"' in result.stderr and "jinja2" in result.stderr


@pytest.mark.parametrize(("missing", "argv"), [
    (("jinja2",), ["bench", "chat", "--model", "no-such-export"]),
    (("tokenizers",), ["bench", "speculative", "--model", "no-such-export"]),
    (("aiohttp",), ["bench", "serve", "--model", "no-such-export"]),
])
def test_the_benches_that_need_the_controller_extra_name_it_before_they_run(missing: tuple[str, ...],
                                                                          argv: list[str]) -> None:
    # `bench chat` without jinja2 called the model's chat template broken ("failed while rendering")
    result = run_without(missing, *argv)
    assert result.returncode == 2
    assert '"deskfleet[controller]"' in result.stderr and missing[0] in result.stderr
    assert "no-such-export" not in result.stderr  # named before the model folder is looked at


def test_aiohttp_alone_missing_is_the_controller_extra_too() -> None:
    # what `deskfleet serve` listens with
    result = run_without(("aiohttp",), "serve", "--model", "no-such-export")
    assert result.returncode == 2
    assert '"deskfleet[controller]"' in result.stderr and "aiohttp" in result.stderr


def test_export_with_the_controller_extra_only_names_the_export_extra(tmp_path: Path) -> None:
    result = run_without(EXPORT, "export", str(tmp_path), "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    assert 'this command needs the export extra: pip install "deskfleet[export]"' in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_extra_found_only_when_the_command_imports_it_is_named(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def export_without_torch(args: object) -> int:
        raise ModuleNotFoundError("No module named 'torch.nn'", name="torch.nn")

    monkeypatch.setattr(cli, "_export", export_without_torch)
    assert cli.main(["export", "checkpoint", "-o", "out"]) == 2
    assert '"deskfleet[export]"' in capsys.readouterr().err


def test_a_missing_module_of_no_extra_is_not_blamed_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: object) -> int:
        raise ModuleNotFoundError("No module named 'deskfleet.nothing'", name="deskfleet.nothing")

    monkeypatch.setattr(cli, "_export", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["export", "checkpoint", "-o", "out"])
