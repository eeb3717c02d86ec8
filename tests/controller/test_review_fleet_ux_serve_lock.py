"""One `fleet serve` per controller data dir: a second one (on another port) refuses to start, naming the
first one's pid, instead of both writing the roster and telling the agents of removals."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import time

import pytest

from deskfleet.controller.cli import build_parser, log_format, main
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import SERVE_LOCK, FleetStore, FleetStoreError
from tests.ports import free_address


def test_a_second_serve_of_the_data_dir_names_the_first(store: FleetStore,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    first = subprocess.Popen([sys.executable, "-m", "deskfleet.controller.cli", "fleet", "serve", "--data-dir",
                              str(store.data_dir), "--listen", free_address()],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        lock = store.data_dir / SERVE_LOCK
        while not (lock.exists() and lock.read_text().split()[:1] == [str(first.pid)]):  # its pid, then "fleet serve"
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first serve did not start"
            time.sleep(0.05)
        assert main(["fleet", "serve", "--data-dir", str(store.data_dir), "--listen", free_address()]) == 2
        error = capsys.readouterr().err
        assert f"is served already by `deskfleet fleet serve` (pid {first.pid})" in error
        assert str(store.data_dir) in error and "Traceback" not in error
    finally:
        first.terminate()
        first.wait(30)
    with store.serving():  # the lock went with the first serve
        pass


def test_the_lock_is_held_while_running_and_released_after(store: FleetStore) -> None:
    async def scenario() -> None:
        server = FleetServer(store, free_address())
        running = asyncio.create_task(server.run())
        while server.bound_port is None:
            assert not running.done()
            await asyncio.sleep(0.01)
        with pytest.raises(FleetStoreError, match=r"served already .*pid \d+"):
            await FleetServer(store, free_address()).run()
        server.stop()
        await running
        again = FleetServer(store, free_address())
        second = asyncio.create_task(again.run())
        while again.bound_port is None:
            assert not second.done()
            await asyncio.sleep(0.01)
        again.stop()
        await second

    asyncio.run(scenario())


def test_fleet_serve_logs_each_line_with_its_time_and_one_shot_commands_do_not() -> None:
    # `fleet serve` runs for days; its lines ("agent ... registered") said no time, the agents' did.
    parser = build_parser()
    assert parser.parse_args(["fleet", "serve"]).log_times is True
    assert getattr(parser.parse_args(["fleet", "ls"]), "log_times", False) is False
    record = logging.LogRecord("deskfleet.x", logging.INFO, __file__, 1, "agent registered", None, None)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO deskfleet.x: agent registered",
                        logging.Formatter(log_format(True)).format(record))
    assert logging.Formatter(log_format(False)).format(record) == "INFO deskfleet.x: agent registered"
