"""Security review: what a join token holder can put into the controller's roster and log (loopback only)."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest

from deskfleet.agent.enroll import join
from deskfleet.agent.link import utc_now
from deskfleet.common import join_tokens
from deskfleet.controller.fleet_ca import init_fleet, issue_token
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import with_server

# A newline forges a log line; ESC [2J clears the admin's terminal in `fleet ls`; U+202E reverses the text after it.
HOSTILE_HOSTNAME = "pc-7\n2026-01-01 ERROR forged line\x1b[2J\u202etxt.exe"


@pytest.fixture
def store(tmp_path: Path) -> FleetStore:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    return store


def test_a_joining_hostname_reaches_roster_and_log_without_control_characters(
        store: FleetStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        token = issue_token(store, utc_now(), datetime.timedelta(minutes=5), 1, (address,))
        with caplog.at_level(logging.INFO, logger="deskfleet.controller.fleet_ca"):
            membership = await join(join_tokens.encode_join_token(token), tmp_path / "agent", HOSTILE_HOSTNAME)
        hostname = store.roster()[membership.agent_id].hostname
        assert hostname.isprintable()
        assert hostname.startswith("pc-7?2026-01-01 ERROR forged line?[2J?txt.exe")
        enrolled = [record.getMessage() for record in caplog.records if "enrolled agent" in record.getMessage()]
        assert len(enrolled) == 1 and enrolled[0].isprintable()

    with_server(store, scenario)


def test_a_long_joining_hostname_is_cut_in_roster_and_log(store: FleetStore, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        token = issue_token(store, utc_now(), datetime.timedelta(minutes=5), 1, (address,))
        with caplog.at_level(logging.INFO, logger="deskfleet.controller.fleet_ca"):
            membership = await join(join_tokens.encode_join_token(token), tmp_path / "agent", "h" * 30_000)
        assert store.roster()[membership.agent_id].hostname == "h" * 200
        enrolled = [record.getMessage() for record in caplog.records if "enrolled agent" in record.getMessage()]
        assert len(enrolled) == 1 and len(enrolled[0]) < 300

    with_server(store, scenario)


def test_an_empty_joining_hostname_is_kept_as_a_question_mark(store: FleetStore, tmp_path: Path) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        token = issue_token(store, utc_now(), datetime.timedelta(minutes=5), 1, (address,))
        membership = await join(join_tokens.encode_join_token(token), tmp_path / "agent", "\x00\x07")
        assert store.roster()[membership.agent_id].hostname == "??"

    with_server(store, scenario)
