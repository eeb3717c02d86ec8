"""`deskfleet serve`: what it refuses before anything compiles, the API key, and a real run in a process of its own
(started, answering a completion exactly as generate does, stopped by SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from deskfleet.controller.cli import main
from deskfleet.controller.serve_cli import API_KEY_ENV, is_loopback, read_api_key
from tests.fake_clock import FakeClock


def test_read_api_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  k3y-value \nsecond line ignored\n")
    key_file.chmod(0o600)
    assert read_api_key(key_file, {}) == "k3y-value"
    key_file.chmod(0o644)  # others could read the key: refused, saying how to fix it
    with pytest.raises(ValueError, match=f"others can read it \\(mode 644\\): `chmod 600 {re.escape(str(key_file))}`"):
        read_api_key(key_file, {})
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    empty.chmod(0o600)
    with pytest.raises(ValueError, match="is empty: put the key on its first line"):
        read_api_key(empty, {})
    with pytest.raises(ValueError, match="cannot be read"):
        read_api_key(tmp_path / "missing", {})
    assert read_api_key(None, {API_KEY_ENV: " from-env "}) == "from-env"
    assert read_api_key(None, {API_KEY_ENV: "  "}) is None
    assert read_api_key(None, {}) is None


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.9.9.9")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("pc-7")


@pytest.mark.parametrize(("argv", "says"), [
    (["--listen", "0.0.0.0:8000"], "reaches beyond this PC, and no API key is set"),
    (["--listen", "10.1.2.3"], "reaches beyond this PC, and no API key is set"),
    (["--listen", "nonsense:port"], "has no port"),
    (["--stages", "2", "--fleet"], "--stages 2 with --fleet"),
    (["--data-dir", "/tmp/x"], "--data-dir without --fleet"),
    (["--k", "3"], "--k needs --draft or --prompt-lookup"),
])
def test_serve_refuses_before_anything_compiles(tiny_export: Path, argv: list[str], says: str,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["serve", "--model", str(tiny_export), *argv]) == 2
    assert says in capsys.readouterr().err


def test_no_api_key_with_a_key_is_refused(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert main(["serve", "--model", str(tiny_export), "--no-api-key"]) == 2
    assert "--no-api-key with an API key given" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_runs_answers_as_generate_does_and_stops_on_sigterm(tiny_export: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sesame\n")
    key_file.chmod(0o600)
    env = {**os.environ, "DESKFLEET_ALLOCATOR": "system"}
    env.pop(API_KEY_ENV, None)
    server = subprocess.Popen([sys.executable, "-m", "deskfleet.controller.cli", "serve", "--model", str(tiny_export),
                               "--stages", "2", "--precision", "f32", "--listen", "127.0.0.1:0",
                               "--api-key-file", str(key_file), "--model-name", "tiny-model"],
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stderr is not None
        lines = []
        for line in server.stderr:
            lines.append(line)
            if "serving" in line:
                break
        found = re.search(r"serving tiny-model at http://127\.0\.0\.1:(\d+)/v1 \(an API key\)", "".join(lines))
        assert found, "".join(lines)
        request = urllib.request.Request(
            f"http://127.0.0.1:{found[1]}/v1/completions",
            json.dumps({"model": "tiny-model", "prompt": "def add(a, b):", "max_tokens": 12,
                        "temperature": 0}).encode(),
            {"Authorization": "Bearer sesame", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        generated = subprocess.run([sys.executable, "-m", "deskfleet.controller.cli", "generate", "--model",
                                    str(tiny_export), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
                                    "--precision", "f32", "--json"], capture_output=True, text=True, env=env,
                                   timeout=300, check=True)
        assert text == json.loads(generated.stdout)["text"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_servers_failover_budget_is_whole_again_after_a_quiet_window() -> None:
    # a server's run never ends: with the CLI's per-run budget, its third dropped PC in a week failed every stream
    from deskfleet.controller.serve_cli import windowed

    class Failover:
        def __init__(self) -> None:
            self.started = 0
            self.calls = 0

        def start_run(self) -> None:
            self.started += 1

        def __call__(self, error: object) -> str:
            self.calls += 1
            return "chain"

    clock = FakeClock(1000.0)
    failover = Failover()
    recover = windowed(failover, window_s=600, clock=clock)  # type: ignore[arg-type]
    assert recover(None) == "chain" and failover.started == 1  # type: ignore[arg-type]
    clock.now += 599  # within the window of the last re-plan: the same budget
    recover(None)  # type: ignore[arg-type]
    clock.now += 599
    recover(None)  # type: ignore[arg-type]
    assert failover.started == 1 and failover.calls == 3
    clock.now += 601  # quiet for longer than the window: a whole budget
    recover(None)  # type: ignore[arg-type]
    assert failover.started == 2


def test_a_port_in_use_is_said_before_anything_compiles(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_export), "--listen", f"127.0.0.1:{port}"]) == 2
    said = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in said and "opening" not in said
