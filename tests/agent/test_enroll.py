"""Joining and the agent's credentials: what goes wrong is said with the file or the reason."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
from pathlib import Path

import pytest

from deskfleet.agent import enroll
from deskfleet.agent.enroll import EnrollmentError, Membership, join
from deskfleet.agent.link import TlsFiles, utc_now
from deskfleet.common import join_tokens, pki


def test_a_controller_that_goes_silent_is_named_with_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The reason used to be empty ("could not join: 127.0.0.1:17351: "): str(TimeoutError()) is "".
    async def silent(*args: object) -> Membership:
        raise TimeoutError

    monkeypatch.setattr(enroll, "_join_at", silent)
    token = join_tokens.JoinToken(("127.0.0.1:17351",), "0" * 64, join_tokens.new_secret(),
                                  (utc_now() + datetime.timedelta(hours=1)).replace(microsecond=0))
    with pytest.raises(EnrollmentError, match=r"127\.0\.0\.1:17351: no answer within 20 s"):
        asyncio.run(join(join_tokens.encode_join_token(token), tmp_path / "state"))


@pytest.mark.parametrize("addresses", ["127.0.0.1:17341", ["not an address"], [], [7]])
def test_a_membership_with_bad_controller_addresses_says_join_again(tmp_path: Path, addresses: object) -> None:
    # A string was split into characters and the agent died later with a ProtocolError traceback.
    body = {"format_version": enroll.MEMBERSHIP_FORMAT, "fleet_id": "f", "agent_id": "a", "controller_id": "c",
            "controller_addresses": addresses}
    (tmp_path / enroll.MEMBERSHIP_FILE).write_text(json.dumps(body))
    with pytest.raises(EnrollmentError, match=r"membership\.json is malformed .*join the fleet again"):
        Membership.load(tmp_path)


def test_a_membership_keeps_the_token_it_joined_with_and_one_saved_before_reads_without(tmp_path: Path) -> None:
    joined = Membership("f", "a", "c", ("127.0.0.1:7341",), "0123456789abcdef" * 4)
    joined.save(tmp_path)
    assert Membership.load(tmp_path) == joined
    body = json.loads((tmp_path / enroll.MEMBERSHIP_FILE).read_text())
    del body["token_sha256"]  # saved before agents kept it
    (tmp_path / enroll.MEMBERSHIP_FILE).write_text(json.dumps(body))
    assert Membership.load(tmp_path).token_sha256 is None
    assert Membership.load(tmp_path).hostname is None  # nor the name it joined with
    (tmp_path / enroll.MEMBERSHIP_FILE).write_text(json.dumps({**body, "hostname": 7}))
    with pytest.raises(EnrollmentError, match=r"membership\.json is malformed .*hostname.*join the fleet again"):
        Membership.load(tmp_path)
    for damaged in ("short", 7, "0123456789ABCDEF" * 4):
        (tmp_path / enroll.MEMBERSHIP_FILE).write_text(json.dumps({**body, "token_sha256": damaged}))
        with pytest.raises(EnrollmentError, match=r"membership\.json is malformed .*token_sha256.*join the"
                                                  r" fleet again"):
            Membership.load(tmp_path)


def test_a_membership_that_is_not_json_or_lacks_a_field_says_join_again(tmp_path: Path) -> None:
    # '{"broken' was "membership.json is unreadable: Invalid control character ...", with no fix (a damaged
    # agent.pem said to join again), and a missing field was shown as a KeyError repr
    (tmp_path / enroll.MEMBERSHIP_FILE).write_text('{"broken')
    with pytest.raises(EnrollmentError, match=r"membership\.json is unreadable \(.*\): join the fleet again "
                                              r"\(`deskfleet-agent join TOKEN`, with a new token from the admin\); "
                                              "this PC keeps its key, and so its agent id"):
        Membership.load(tmp_path)
    (tmp_path / enroll.MEMBERSHIP_FILE).write_text(json.dumps({"format_version": enroll.MEMBERSHIP_FORMAT,
                                                               "controller_addresses": ["127.0.0.1:7341"]}))
    with pytest.raises(EnrollmentError, match=r"membership\.json is malformed \(it has no 'fleet_id'\): join the "
                                              "fleet again"):
        Membership.load(tmp_path)


def test_damaged_credentials_are_named(tmp_path: Path) -> None:
    files = TlsFiles.in_folder(tmp_path, "agent")
    for path in (files.ca_path, files.cert_path, files.key_path):
        path.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    with pytest.raises(pki.PkiError, match=f"{files.ca_path} cannot be used .*join the fleet again"):
        files.ca_certificate()
    with pytest.raises(pki.PkiError, match=f"{files.cert_path} or {files.key_path} cannot be used"):
        files.server_context()
    with pytest.raises(EnrollmentError, match=f"{files.key_path} is not a usable key .*delete it and join again"):
        enroll._load_or_create_key(files.key_path)


def test_a_membership_this_user_may_not_read_says_whose_it_is_not_to_join_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an agent or `pause` run by another user was told to join the fleet again, which would have spent a token
    Membership("f" * 52, "a" * 52, "c" * 52, ("127.0.0.1:7341",)).save(tmp_path)

    def denied(path: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(EnrollmentError, match=r"cannot read .*membership\.json \(Permission denied\): run the agent "
                                              r"as the user that joined"):
        Membership.load(tmp_path)


def test_a_damaged_certificate_is_named_with_what_to_do(tmp_path: Path) -> None:
    from tests.fleet_pki import make_ca, make_member

    files = make_member(make_ca(tmp_path / "ca"), tmp_path / "agent", "agent")
    membership = Membership(pki.fleet_id(files.ca_certificate()), files.own_identity().agent_id, "c" * 52,
                            ("127.0.0.1:7341",))
    enroll.check_credentials(files, membership, "deskfleet-agent join TOKEN")
    files.cert_path.write_text("garbage\n")
    with pytest.raises(EnrollmentError, match=f"{files.cert_path} cannot be used .*: this PC's credentials are "
                                              "damaged; join the fleet again with a new token from its admin: "
                                              "`deskfleet-agent join TOKEN`"):
        enroll.check_credentials(files, membership, "deskfleet-agent join TOKEN")


def test_a_token_expired_by_this_pcs_clock_says_what_the_clock_says(monkeypatch: pytest.MonkeyPatch) -> None:
    # A PC whose clock ran 2 h ahead refused every new 1-h token as expired, blaming the token alone
    now = datetime.datetime(2026, 12, 7, 12, 0, tzinfo=datetime.UTC)
    token = join_tokens.encode_join_token(join_tokens.JoinToken(("127.0.0.1:7341",), "0" * 64, join_tokens.new_secret(),
                                                                now - datetime.timedelta(hours=1)))
    monkeypatch.setattr(enroll, "utc_now", lambda: now)
    with pytest.raises(EnrollmentError, match=r"^the join token expired at 2026-12-07T11:00:00\+00:00, and this PC's "
                                              r"clock says 2026-12-07T12:00:00\+00:00: ask for a new one \(where this "
                                              r"PC's clock is wrong, set it right"):
        enroll.read_join_token(token)


def test_a_token_that_expired_while_the_join_ran_is_said_to_have(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the controller refuses "unknown, expired or used up" (it tells a stranger no more); the PC knows the token's end
    expires = (utc_now() + datetime.timedelta(seconds=30)).replace(microsecond=0)

    async def refused(*args: object) -> Membership:
        monkeypatch.setattr(enroll, "utc_now", lambda: expires + datetime.timedelta(seconds=1))  # it ran out meanwhile
        raise EnrollmentError("join_refused: the join token is unknown, expired or used up: ask the admin for a new "
                              "one")

    monkeypatch.setattr(enroll, "_join_at", refused)
    token = join_tokens.JoinToken(("127.0.0.1:17351",), "0" * 64, join_tokens.new_secret(), expires)
    with pytest.raises(EnrollmentError, match=rf"used up: ask the admin for a new one \(the token expired at "
                                              rf"{re.escape(expires.isoformat())}, while this join ran\)$"):
        asyncio.run(join(join_tokens.encode_join_token(token), tmp_path / "state"))
