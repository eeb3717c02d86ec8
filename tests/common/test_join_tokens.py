from __future__ import annotations

import base64
import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deskfleet.common import join_tokens as jt

NOW = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
SECRET = bytes(range(32))
AGENT, OTHER_AGENT = "a" * 52, "b" * 52
TOKEN = jt.JoinToken(("192.168.1.10:7443", "[fe80::2]:7443", "controller.office.lan:7443"),
                     "ab" * 32, SECRET, NOW + datetime.timedelta(hours=24))


def test_token_round_trip_is_compact_and_url_safe() -> None:
    text = jt.encode_join_token(TOKEN)
    assert text.startswith("dfj.") and len(text) < 200
    assert set(text[4:]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert jt.decode_join_token(f"  {text}\n") == TOKEN
    assert not TOKEN.is_expired(NOW) and TOKEN.is_expired(NOW + datetime.timedelta(days=1))


def body(token: jt.JoinToken = TOKEN) -> bytes:
    text = jt.encode_join_token(token)[4:]
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def reencode(raw: bytes, fix_checksum: bool = True) -> str:
    import hashlib
    if fix_checksum:
        raw = raw[:-4] + hashlib.sha256(raw[:-4]).digest()[:4]
    return "dfj." + base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize("text, message", [
    ("", "the join token is empty"),  # an unset variable: "starts with dfj." said nothing of it
    ("  \n", "the join token is empty"),
    ("dfj.abc+def", "outside base64url"),
    ("dfj.é", "outside base64url"),
    ("dfj.a", "not base64url"),
    ("dfj.AAAA", "too short"),
    (jt.encode_join_token(TOKEN)[:-6], "damaged|not base64url"),
    (reencode(body()[:1].replace(b"\x01", b"\x02") + body()[1:]), "version 2"),
    (reencode(body()[:-10] + body()[-4:]), "truncated|trailing"),
    (reencode(body()[:-4] + b"zz" + body()[-4:]), "trailing bytes"),
    (reencode(body(), fix_checksum=False)[:-2] + "AA", "damaged"),
])
def test_bad_tokens_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(jt.JoinTokenError, match=message):
        jt.decode_join_token(text)


def test_encoding_refuses_bad_fields() -> None:
    from dataclasses import replace
    for changes, message in [({"secret": b"short"}, "secret"), ({"ca_fingerprint": "xyz"}, "fingerprint"),
                             ({"controller_addresses": ()}, "1 to 8"),
                             ({"controller_addresses": ("nohost",)}, "host:port"),
                             ({"expires_at": datetime.datetime(1960, 1, 1, tzinfo=datetime.UTC)},
                              "1970")]:
        with pytest.raises(jt.JoinTokenError, match=message):
            jt.encode_join_token(replace(TOKEN, **changes))  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(max_size=200))
def test_fuzz_decode_gives_a_token_or_a_clear_error(text: str) -> None:
    try:
        jt.decode_join_token("dfj." + text)
    except jt.JoinTokenError:
        pass


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(min_size=1, max_size=160))
def test_fuzz_well_checksummed_bodies(raw: bytes) -> None:
    try:
        jt.decode_join_token(reencode(raw + bytes(4)))
    except jt.JoinTokenError:
        pass


def test_secret_text_round_trip() -> None:
    assert jt.secret_from_text(jt.secret_to_text(SECRET)) == SECRET
    assert len(jt.new_secret()) == 32 and jt.new_secret() != jt.new_secret()
    with pytest.raises(jt.JoinTokenError, match="32 bytes"):
        jt.secret_from_text("AAAA")


def test_ledger_spends_uses_and_honours_expiry() -> None:
    ledger = jt.TokenLedger()
    ledger.issue(SECRET, NOW + datetime.timedelta(hours=1), uses=2)
    other = b"\x01" * 32
    ledger.issue(other, NOW + datetime.timedelta(minutes=1))
    assert all(SECRET.hex() not in repr(record) for record in ledger.records)
    ledger.redeem(SECRET, NOW, AGENT)
    ledger.redeem(SECRET, NOW, AGENT)  # the same PC again (a script run twice): no use spent
    assert ledger.records[0].uses_left == 1
    ledger.redeem(SECRET, NOW, OTHER_AGENT)
    assert ledger.records[0].redeemed_by == (AGENT, OTHER_AGENT)
    with pytest.raises(jt.TokenRejected) as used_up:
        ledger.redeem(SECRET, NOW, "c" * 52)
    assert used_up.value.reason is jt.Rejection.USED_UP
    ledger.redeem(SECRET, NOW, OTHER_AGENT)  # one of its PCs joining again, after the last use: taken, as before it
    assert ledger.records[0].uses_left == 0
    with pytest.raises(jt.TokenRejected) as unknown:
        ledger.redeem(b"\x02" * 32, NOW, AGENT)
    assert unknown.value.reason is jt.Rejection.UNKNOWN
    before = ledger.records
    with pytest.raises(jt.TokenRejected) as expired:
        ledger.redeem(other, NOW + datetime.timedelta(minutes=1), AGENT)
    assert expired.value.reason is jt.Rejection.EXPIRED and ledger.records == before
    restored = jt.TokenLedger(ledger.records)
    # ended tokens stay a while, so that a join with one is refused as what it is (expired, used up), not unknown
    assert restored.prune(NOW + datetime.timedelta(minutes=5)) == 0 and len(restored.records) == 2
    with pytest.raises(jt.TokenRejected) as ended:
        restored.redeem(other, NOW + datetime.timedelta(minutes=5), AGENT)
    assert ended.value.reason is jt.Rejection.EXPIRED
    later = NOW + datetime.timedelta(minutes=1) + jt.KEEP_ENDED_TOKENS
    assert restored.prune(later) == 1 and len(restored.records) == 1  # the 1-minute one, 30 days past its expiry
    assert restored.prune(NOW + datetime.timedelta(hours=1) + jt.KEEP_ENDED_TOKENS) == 1 and restored.records == ()
    assert ledger.revoke(other) and not ledger.revoke(other)
    with pytest.raises(ValueError, match="uses"):
        ledger.issue(SECRET, NOW, uses=0)


def test_a_join_the_ledger_does_not_count_is_spent_again_once_only() -> None:
    # A controller data dir restored from a backup older than a join counts the token as unused: the agent's
    # registration says which secret it joined with, and the use is spent again.
    backup = jt.TokenLedger()
    backup.issue(SECRET, NOW + datetime.timedelta(hours=1), uses=2)
    ledger = jt.TokenLedger(backup.records)
    ledger.redeem(SECRET, NOW, AGENT)
    digest = jt.secret_sha256(SECRET)
    assert not ledger.spend_again(digest, AGENT, NOW)  # counted already: nothing spent
    restored = jt.TokenLedger(backup.records)
    assert restored.spend_again(digest, AGENT, NOW) and not restored.spend_again(digest, AGENT, NOW)
    assert restored.records[0].uses_left == 1 and restored.records[0].redeemed_by == (AGENT,)
    assert restored.spend_again(digest, OTHER_AGENT, NOW) and restored.records[0].uses_left == 0
    assert not restored.spend_again(digest, "c" * 52, NOW)  # used up: nothing to spend
    assert not restored.spend_again(jt.secret_sha256(b"\x09" * 32), AGENT, NOW)  # not in this ledger
    late = jt.TokenLedger(backup.records)
    assert not late.spend_again(digest, AGENT, NOW + datetime.timedelta(hours=2))  # expired: refused anyway


def test_a_record_that_does_not_know_who_redeemed_it_is_never_spent_again() -> None:
    ledger = jt.TokenLedger([jt.IssuedSecret(jt.secret_sha256(SECRET), NOW + datetime.timedelta(hours=1), 2, None)])
    assert not ledger.spend_again(jt.secret_sha256(SECRET), AGENT, NOW)
    ledger.redeem(SECRET, NOW, AGENT)  # a join still spends, and the record stays "not known"
    assert ledger.records[0].uses_left == 1 and ledger.records[0].redeemed_by is None
