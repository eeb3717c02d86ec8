"""Review of 7d0dfa0 (removals as bytes): concurrent give-backs checked once; a malformed signature refused."""

from __future__ import annotations

import asyncio

import pytest

from deskfleet.common import pki
from deskfleet.common.wire import KnownRemovals, ProtocolError, RevocationUpdate
from deskfleet.controller.fleet_ca import Revocations, load_ca, take_known_removals
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_restored_removals import new_agent_id


def test_review_removals_bytes_agents_giving_the_same_removals_at_once_are_checked_once(
        store: FleetStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # A restored `fleet serve` restarts: every agent registers again within seconds, and each gives back the same
    # removals the data dir lacks. Each take_known_removals reads `known` before its thread verifies, so all of
    # them verify every signature (N agents x M removals ECDSA checks, ~50 us each under the GIL).
    ca = load_ca(store)
    ids = sorted(new_agent_id() for _ in range(20))
    message = KnownRemovals.of(ids, [pki.sign_removal(ca, agent_id) for agent_id in ids])
    checked: list[str] = []
    real_check = pki.check_removal

    def counted(ca_certificate: object, agent_id: str, signature: bytes) -> None:
        checked.append(agent_id)
        real_check(ca_certificate, agent_id, signature)  # type: ignore[arg-type]

    monkeypatch.setattr(pki, "check_removal", counted)
    revocations = Revocations(store)

    async def scenario() -> None:
        senders = [new_agent_id() for _ in range(5)]
        results = await asyncio.gather(*(take_known_removals(store, revocations, message, sender)
                                         for sender in senders))
        assert set(ids) in results and all(result is not None for result in results)

    asyncio.run(scenario())
    assert Revocations(store)().agent_ids == set(ids)
    assert len(checked) == len(ids), f"{len(checked)} signature checks for {len(ids)} removals"


def test_review_removals_bytes_of_refuses_a_signature_of_the_wrong_length() -> None:
    # .of joins id + signature without checking each signature's length; a short one followed by a long one keeps
    # the total a multiple of 116, and the message then names an agent that was never given (shifted by a byte).
    first, second = "c" * 52, "d" * 52
    with pytest.raises(ProtocolError, match="signature of removed agent cccccccccccc is not 64 bytes"):
        RevocationUpdate.of([first, second], [b"x" * 63, b"a" * 65])
    with pytest.raises(ProtocolError, match="is not 64 bytes"):
        RevocationUpdate.of([first], ["ab" * 64])  # type: ignore[list-item]  # hex, as protocol 6's first draft


def test_review_removals_bytes_a_huge_revocation_update_is_refused_before_any_per_record_work() -> None:
    # Any member may send one to an agent's port (frames up to 320 MB); the role check comes after decoding.
    from deskfleet.common.wire_messages import MAX_REMOVALS, REMOVAL_RECORD_BYTES

    with pytest.raises(ProtocolError, match=f"at most {MAX_REMOVALS} removals, not {MAX_REMOVALS + 1}"):
        RevocationUpdate(b"c" * (REMOVAL_RECORD_BYTES * (MAX_REMOVALS + 1)))
    with pytest.raises(ProtocolError, match="'CCCC"):  # the regex over the records names the bad id
        RevocationUpdate(b"c" * REMOVAL_RECORD_BYTES + b"C" * 52 + bytes(64))


def test_review_removals_bytes_removals_verified_are_refused_even_where_revoked_json_cannot_take_them(
        store: FleetStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # `fleet ls` run by a user who cannot write the data dir: the survey must still leave the removed PC out.
    from deskfleet.controller import fleet_ca

    ca = load_ca(store)
    removed = new_agent_id()

    def read_only(*args: object) -> list[str]:
        raise PermissionError("revoked.json: permission denied")

    monkeypatch.setattr(fleet_ca, "add_removals", read_only)
    revocations = Revocations(store)
    message = KnownRemovals.of([removed], [pki.sign_removal(ca, removed)])
    assert asyncio.run(take_known_removals(store, revocations, message, new_agent_id())) == {removed}
    assert revocations().is_revoked(removed) and not Revocations(store)().is_revoked(removed)
