"""`deskfleet serve`: what it refuses before anything compiles, the API key, and a real run in a process of its own
(started, answering a completion exactly as generate does, stopped by SIGTERM)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deskfleet.common.stop_signal import StopSignal
from deskfleet.common.wire import is_loopback_host
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.serve_cli import (
    API_KEY_ENV,
    model_name_argument,
    read_api_key,
    serve_engine_options,
    server_tls,
)
from tests.fake_clock import FakeClock


def self_signed(folder: Path, passphrase: bytes | None = None) -> tuple[Path, Path]:
    """(certificate, key) PEM files of a self-signed certificate for localhost and 127.0.0.1, the key 0600."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase is not None
                  else serialization.NoEncryption())
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    key_file.chmod(0o600)
    return cert_file, key_file


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
    with pytest.raises(ValueError, match=r"\$DESKFLEET_API_KEY holds bytes that are not UTF-8 text"):
        read_api_key(None, {API_KEY_ENV: "k\udcff"})


def test_a_key_file_that_is_no_file_or_too_long_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # /dev/zero was read without end (deaf to SIGTERM); /dev/null was told to `chmod 600 /dev/null` first
    import os

    for device in ("/dev/zero", "/dev/null"):
        with pytest.raises(ValueError, match=f"--api-key-file {device} is a device, a FIFO or a socket, not a file"):
            read_api_key(Path(device), {})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a device, a FIFO or a socket"):  # it waited for a writer for ever
        read_api_key(fifo, {})
    with pytest.raises(ValueError, match="is a folder, not a file"):
        read_api_key(tmp_path, {})
    with pytest.raises(ValueError, match="is a device, a FIFO or a socket"):
        server_tls(Path("/dev/zero"), tmp_path / "key.pem")
    long = tmp_path / "long"
    long.write_text("x" * (64 * 1024 + 1))
    long.chmod(0o600)
    with pytest.raises(ValueError, match="holds more than 64 KiB: no key is that long"):
        read_api_key(long, {})


def test_server_tls_is_made_of_a_certificate_and_its_key_and_refuses_what_is_wrong_naming_it(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path / "good")
    assert server_tls(None, None) is None  # plain HTTP
    context = server_tls(cert, key)
    assert context is not None and context.minimum_version >= ssl.TLSVersion.TLSv1_2
    with pytest.raises(ValueError, match=r"^--tls-cert without --tls-key: HTTPS needs the certificate and its key$"):
        server_tls(cert, None)
    with pytest.raises(ValueError, match=r"^--tls-key without --tls-cert"):
        server_tls(None, key)
    missing = re.escape(str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match=f"^--tls-cert {missing}: cannot be read: No such"):
        server_tls(tmp_path / "missing.pem", key)
    key.chmod(0o640)  # the key is the server's identity: readable by others, anyone of them could pose as it
    with pytest.raises(ValueError, match=r"--tls-key .*key.pem: others can read it \(mode 640\): `chmod 600 "):
        server_tls(cert, key)
    key.chmod(0o600)
    _, other_key = self_signed(tmp_path / "other")
    with pytest.raises(ValueError, match=r"^--tls-cert .*cert.pem and --tls-key .*other/key.pem: KEY_VALUES_MISMATCH "
                                         r"\(a PEM certificate, then its chain, and the private key it was made "
                                         r"for\)$"):
        server_tls(cert, other_key)
    with pytest.raises(ValueError, match=r"and the private key it was made for"):
        server_tls(key, key)  # a key given as the certificate
    locked_cert, locked_key = self_signed(tmp_path / "locked", passphrase=b"secret")
    # never a prompt on the terminal: a server started by systemd has nobody to type it
    with pytest.raises(ValueError, match=r"--tls-key .*locked/key.pem is encrypted: give the key unencrypted"):
        server_tls(locked_cert, locked_key)


def test_is_loopback_host() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1") and is_loopback_host("localhost")
    assert is_loopback_host("127.9.9.9")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("10.0.0.5") and not is_loopback_host("pc-7")


@pytest.mark.parametrize(("argv", "says"), [
    (["--listen", "0.0.0.0:8000"], "reaches beyond this PC, and no API key is set"),
    (["--listen", "10.1.2.3"], "reaches beyond this PC, and no API key is set"),
    (["--listen", "nonsense:port"], "--listen: address 'nonsense:port' has no port"),
    (["--listen", "bad host"], "--listen: address 'bad host' is not host:port"),  # not 'bad host:8000'
    (["--stages", "2", "--fleet"], "--stages 2 with --fleet"),
    (["--data-dir", "/tmp/x"], "--data-dir without --fleet"),
    (["--take-back-wait", "5"], "--take-back-wait without --fleet"),
    (["--k", "3"], "--k needs --draft or --prompt-lookup"),
    (["--max-rows", "4", "--rows-when-busy", "9"], "--rows-when-busy must be from --max-rows (4) to twice it (8)"),
    (["--max-rows", "4", "--rows-when-busy", "3"], "--rows-when-busy must be from --max-rows (4) to twice it (8)"),
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


@contextmanager
def serve_process(*argv: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`deskfleet serve ARGV` in a process of its own, until it said where it serves: (the process, the start line);
    killed at the end where it still runs."""
    env = {**os.environ, "DESKFLEET_ALLOCATOR": "system"}
    env.pop(API_KEY_ENV, None)
    server = subprocess.Popen([sys.executable, "-m", "deskfleet.controller.cli", "serve", *argv],
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stderr is not None
        lines = []
        for line in server.stderr:
            lines.append(line)
            if "serving" in line:
                break
        yield server, "".join(lines)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_serve_runs_answers_as_generate_does_and_stops_on_sigterm(tiny_export: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sesame\n")
    key_file.chmod(0o600)
    env = {**os.environ, "DESKFLEET_ALLOCATOR": "system"}
    env.pop(API_KEY_ENV, None)
    with serve_process("--model", str(tiny_export), "--stages", "2", "--precision", "f32", "--listen", "127.0.0.1:0",
                       "--api-key-file", str(key_file), "--model-name", "tiny-model") as (server, said):
        found = re.search(r"serving tiny-model at http://127\.0\.0\.1:(\d+)/v1 \(an API key\)", said)
        assert found, said
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
        assert server.stderr is not None and "deskfleet: stopped by SIGTERM" in server.stderr.read()  # it said nothing


@pytest.mark.slow
def test_serve_over_https_answers_a_client_that_trusts_its_certificate_and_no_plain_http(tiny_export: Path,
                                                                                          tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path / "tls")
    with serve_process("--model", str(tiny_export), "--precision", "f32", "--listen", "127.0.0.1:0", "--tls-cert",
                       str(cert), "--tls-key", str(key), "--model-name", "tiny-model") as (server, said):
        found = re.search(r"serving tiny-model at https://127\.0\.0\.1:(\d+)/v1 \(no API key\)", said)
        assert found, said
        body = json.dumps({"model": "tiny-model", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
        request = urllib.request.Request(f"https://127.0.0.1:{found[1]}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        trusting = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(request, timeout=120, context=trusting) as response:
            assert len(json.loads(response.read())["choices"][0]["text"]) > 0
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # a client that does not trust it
            urllib.request.urlopen(request, timeout=30, context=ssl.create_default_context())
        plain = urllib.request.Request(f"http://127.0.0.1:{found[1]}/v1/models")
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(plain, timeout=30)
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0


def test_plain_http_beyond_this_pc_is_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    not_an_export = tmp_path / "empty"  # refused after the note: nothing compiles
    not_an_export.mkdir()
    argv = ["serve", "--model", str(not_an_export), "--listen", "0.0.0.0:0", "--no-api-key"]
    assert main(argv) != 0
    assert ("note: --listen 0.0.0.0:0 serves plain HTTP: the API key and every prompt and reply cross the network "
            "readable by anyone on the way; give --tls-cert and --tls-key for HTTPS") in capsys.readouterr().err
    cert, key = self_signed(tmp_path / "tls")
    assert main([*argv, "--tls-cert", str(cert), "--tls-key", str(key)]) != 0
    assert "plain HTTP" not in capsys.readouterr().err
    assert main(["serve", "--model", str(not_an_export), "--listen", "127.0.0.1:0"]) != 0
    assert "plain HTTP" not in capsys.readouterr().err  # this PC only


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


def test_the_fleet_opener_gives_the_failover_and_its_take_back(store: FleetStore, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # a busy server moves its streams onto the chain the run's failover makes as a run's start does (rejoin)
    import argparse

    from deskfleet.controller import serve_cli
    from deskfleet.controller.decoding_options import DecodingOptions

    class Failover:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start_run(self) -> None:
            pass

        def __call__(self, error: object) -> str:
            self.calls.append("recover")
            return "a re-planned chain"

        def rejoin(self, running: bool = False) -> str | None:
            self.calls.append(f"rejoin running={running}")
            return "a chain that took the PC back"

    failover = Failover()
    opened_with: list[tuple[object, ...]] = []

    @contextmanager
    def open_fleet_chain(*args: object, **kwargs: object) -> Iterator[tuple[str, Failover]]:
        opened_with.append(args)
        assert kwargs["stop"] is stop  # the server's close gives its re-plans up
        yield "the deployed chain", failover

    monkeypatch.setattr(serve_cli, "open_fleet_chain", open_fleet_chain)
    args = argparse.Namespace(data_dir=store.data_dir, model=tmp_path / "model", max_failovers=None,
                              discover_seconds=None)
    stop = StopSignal()
    with serve_cli._fleet_opener(args, DecodingOptions(), stop)() as opened:
        assert opened.chain == "the deployed chain" and opened.take_back is not None and opened.recover is not None
        assert opened.take_back() == "a chain that took the PC back"
        assert opened.recover(None) == "a re-planned chain"  # type: ignore[arg-type]
    assert failover.calls == ["rejoin running=True", "recover"] and len(opened_with) == 1


def test_a_port_in_use_is_said_before_anything_compiles(tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_export), "--listen", f"127.0.0.1:{port}"]) == 2
    said = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in said and "opening" not in said


def test_a_servers_requests_prefilled_ahead_may_join_a_full_micro_batch() -> None:
    # past --max-rows, requests got their first token and then waited for a running reply's end
    from deskfleet.controller.cli import build_parser
    from deskfleet.controller.decoding_options import DecodingOptions

    args = build_parser().parse_args(["serve", "--model", "M", "--max-rows", "6", "--prefix-cache-tokens", "100"])
    options = serve_engine_options(DecodingOptions(), 2, args)
    assert (options.max_rows, options.rows_when_waiting, options.micro_batches) == (6, 12, 2)
    assert options.prefix_cache_tokens == 100
    args = build_parser().parse_args(["serve", "--model", "M", "--max-rows", "6", "--rows-when-busy", "6"])
    assert serve_engine_options(DecodingOptions(), 1, args).rows_when_waiting == 6  # they wait for a row


def test_serve_fleet_of_a_model_never_deployed_exits_2_before_listening(store: FleetStore, tiny_export: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # it listened, failed to open the chain and exited 1, where generate --fleet and chat --fleet exit 2
    code = main(["serve", "--fleet", "--data-dir", str(store.data_dir), "--model", str(tiny_export), "--listen",
                 "127.0.0.1:0"])
    captured = capsys.readouterr()
    assert code == 2 and "has not been deployed: run `deskfleet fleet deploy" in captured.err
    assert "opening" not in captured.err  # refused before it listened and began to open the chain


@pytest.mark.parametrize(("name", "said"), [("", "is empty"), ("  ", "is empty"), ("\udcff", "not UTF-8 text"),
                                            (" demo", "a space at an end"), ("demo\n", "a control character"),
                                            ("de\x07mo", "a control character")])
def test_a_model_name_no_client_could_give_is_refused(name: str, said: str) -> None:
    # "\udcff" (a byte that is not UTF-8) was listed by /v1/models, and no request could name it; "" fell back to
    # the folder's name without a word
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=said):
        model_name_argument(name)
    assert model_name_argument("deskfleet demo 15M") == "deskfleet demo 15M"
