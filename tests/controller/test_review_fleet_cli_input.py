"""`deskfleet fleet` commands given input they cannot use say so and exit 2, without a traceback."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_store import FleetStore


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    return store.data_dir


def test_serve_on_a_port_in_use_names_the_address(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert main(["fleet", "serve", "--data-dir", str(data_dir), "--listen", address]) == 2
    error = capsys.readouterr().err
    assert f"deskfleet: error: cannot listen on {address}" in error
    assert "in use" in error and "Traceback" not in error
    # and the serve's Ctrl-C handler is gone with its loop (uvloop leaves it: Ctrl-C would be swallowed)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("seconds", ["inf", "nan", "-1", "1e9", "soon"])
def test_discover_seconds_must_be_a_browse_time(data_dir: Path, capsys: pytest.CaptureFixture[str],
                                                seconds: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["fleet", "ls", "--data-dir", str(data_dir), "--discover-seconds", seconds])
    assert exited.value.code == 2
    assert "--discover-seconds" in capsys.readouterr().err


@pytest.mark.parametrize("verbose", [True, False])
def test_serve_with_v_logs_deskfleet_s_own_debug_lines(data_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                       verbose: bool) -> None:
    # `fleet serve` set deskfleet's loggers to INFO over -v's DEBUG: -v showed websockets' frames, none of its own
    import logging

    from deskfleet.controller.fleet_server import FleetServer

    seen: list[int] = []

    async def run(self: FleetServer) -> None:
        seen.append(logging.getLogger("deskfleet").level)

    monkeypatch.setattr(FleetServer, "run", run)
    deskfleet_logger = logging.getLogger("deskfleet")
    monkeypatch.setattr(deskfleet_logger, "level", logging.NOTSET)  # and put back after the test
    argv = ["fleet", "serve", "--data-dir", str(data_dir), "--listen", "127.0.0.1:1"]
    assert main(["-v", *argv] if verbose else argv) == 0
    # with -v, the root's DEBUG (logging.basicConfig) governs; without, serve's INFO lines show over the WARNING
    assert seen == [logging.NOTSET if verbose else logging.INFO]


@pytest.mark.parametrize("address", ["0.0.0.0:7341", "[::]:7341", "[ff02::1]:7341", "224.0.0.1:7341",
                                     "255.255.255.255:7341"])
def test_an_init_address_no_pc_can_reach_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    address: str) -> None:
    # taken, and put in every token: each join then failed at an address nobody listens at (from an exploratory
    # test of an IPv6-only LAN)
    data = tmp_path / "controller"
    assert main(["fleet", "init", "--address", address, "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"--address {address}: " in err and "is no address a PC can reach the controller at" in err
    assert not (data / "ca.pem").exists()


@pytest.mark.parametrize(("address", "said"), [
    ("[fe80::1]:7341", "fe80::1 is a link-local address, which other PCs can dial only through an interface of their "
                       "own"),
    ("[fe80::1%eth0]:7341", "an IPv6 address with a zone, '%eth0', names an interface of one PC"),
])
def test_an_ipv6_link_local_init_address_is_refused_with_what_to_give(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], address: str, said: str) -> None:
    # taken without its zone and put in every token, where no other PC could dial it; with its zone, refused as "not
    # host:port" with no word of why (from an exploratory test of an IPv6-only LAN)
    data = tmp_path / "controller"
    assert main(["fleet", "init", "--address", address, "--data-dir", str(data)]) == 2
    assert said in capsys.readouterr().err
    assert not (data / "ca.pem").exists()


def test_an_ipv4_link_local_init_address_is_taken(tmp_path: Path) -> None:
    # a LAN without DHCP gives every PC a 169.254/16 address, which any PC on it dials without a zone
    assert main(["fleet", "init", "--address", "169.254.7.9:7341", "--data-dir", str(tmp_path / "controller")]) == 0
