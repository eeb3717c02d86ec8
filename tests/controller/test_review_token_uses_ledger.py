"""Review of 6952f69: tokens.json records that are malformed, or older than redeemed_by, meet spend_token_again."""

from __future__ import annotations

import json

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.common import join_tokens
from deskfleet.controller.fleet_ca import spend_token_again
from deskfleet.controller.fleet_store import FleetStore, FleetStoreError
from tests.controller.test_fleet_ca import token_for


def test_a_record_whose_secret_sha256_is_not_ascii_is_named_not_a_type_error(store: FleetStore) -> None:
    token = join_tokens.decode_join_token(token_for(store, "127.0.0.1:1", uses=2))
    digest = join_tokens.secret_sha256(token.secret)
    path = store.data_dir / "tokens.json"
    document = json.loads(path.read_text())
    damaged = {**document["body"][0], "secret_sha256": "\u00e9" * 64}
    document["body"].insert(0, damaged)
    path.write_text(json.dumps(document))
    # fleet serve's _count_join catches OSError and FleetStoreError only: anything else escapes the
    # registration handler as a traceback
    with pytest.raises(FleetStoreError, match=r"tokens\.json holds a malformed record: .*secret_sha256 must be 64"):
        spend_token_again(store, digest, "a" * 52, utc_now())


def test_a_record_written_before_ledgers_kept_who_redeemed_it_is_never_spent_again(store: FleetStore) -> None:
    # An older `fleet token` rewrote tokens.json without redeemed_by: read as "nobody", every registration of an
    # agent that joined with it spent a use again, and a legitimate join could find the token used up.
    token = join_tokens.decode_join_token(token_for(store, "127.0.0.1:1", uses=3))
    path = store.data_dir / "tokens.json"
    document = json.loads(path.read_text())
    for record in document["body"]:
        del record["redeemed_by"]
    path.write_text(json.dumps(document))
    assert not spend_token_again(store, join_tokens.secret_sha256(token.secret), "a" * 52, utc_now())
    assert [record["uses_left"] for record in json.loads(path.read_text())["body"]] == [3]
