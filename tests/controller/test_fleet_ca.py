"""The fleet CA on disk, join tokens, removal, and enrollment against an in-process controller server."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from deskfleet.agent.enroll import EnrollmentError, Membership, agent_tls_files, join
from deskfleet.agent.link import LinkError, open_link, utc_now
from deskfleet.agent.standing import note_removed, removed_seen
from deskfleet.common import join_tokens, pki, tls
from deskfleet.common.wire import Register, RevocationUpdate
from deskfleet.controller import fleet_ca, fleet_server, fleet_store, fleet_survey
from deskfleet.controller.fleet_ca import (
    Revocations,
    init_fleet,
    issue_token,
    load_ca,
    parse_duration,
    remove_agent,
)
from deskfleet.controller.fleet_server import FleetServer
from deskfleet.controller.fleet_store import UNKNOWN_HOSTNAME, FleetStore, FleetStoreError, RosterEntry
from tests.ports import free_port


def with_server(store: FleetStore, scenario: Callable[[FleetServer, str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = FleetServer(store, f"127.0.0.1:{free_port()}")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(server.run())
            while server.bound_port is None:
                await asyncio.sleep(0.01)
            try:
                await scenario(server, f"127.0.0.1:{server.bound_port}")
            finally:
                server.stop()

    asyncio.run(main())




def token_for(store: FleetStore, address: str, uses: int = 1) -> str:
    token = issue_token(store, utc_now(), datetime.timedelta(minutes=5), uses, (address,))
    return join_tokens.encode_join_token(token)


def test_init_keeps_private_keys_owner_only_and_refuses_a_second_fleet(store: FleetStore) -> None:
    for path in (store.ca_key_path, store.tls_files.key_path):
        assert path.stat().st_mode & 0o077 == 0
    with pytest.raises(FleetStoreError, match="already holds a fleet"):
        init_fleet(store, "again", ("127.0.0.1:1",), utc_now())


def enroll_one(store: FleetStore) -> str:
    """Put an enrolled agent in the roster, as a join would; return its id."""
    agent_id = pki.agent_id_for_key(pki.create_private_key().public_key())
    store.save_roster({agent_id: RosterEntry(agent_id, "pc-1", utc_now().isoformat())})
    return agent_id


@pytest.mark.parametrize("lost", ["controller.pem", "ca.pem", "ca-key.pem", "agents.json"])
def test_init_refuses_a_data_dir_holding_part_of_a_fleet(store: FleetStore, lost: str) -> None:
    # Without controller.pem or ca.pem the store read as "no fleet", and init made a new CA key and emptied the
    # roster: every agent had to join again.
    enroll_one(store)
    kept = {path.name: path.read_bytes() for path in store.data_dir.iterdir() if path.name != lost}
    (store.data_dir / lost).unlink()
    with pytest.raises(FleetStoreError, match="already holds") as refused:
        init_fleet(store, "again", ("127.0.0.1:1",), utc_now())
    assert "--force" in str(refused.value)
    if lost in ("ca.pem", "ca-key.pem"):  # it says what is lost (a missing controller.pem is issued again)
        assert lost in str(refused.value).split("already holds")[1].split("--force")[0]
    for name, data in kept.items():
        assert (store.data_dir / name).read_bytes() == data, name


def test_init_refuses_a_data_dir_holding_any_store_file(tmp_path: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    store.data_dir.mkdir()
    store.write("agents", {})
    with pytest.raises(FleetStoreError, match=r"part of a fleet \(agents\.json\)"):
        init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    assert sorted(path.name for path in store.data_dir.iterdir()) == [".lock", "agents.json"]
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now(), force=True)
    store.require_initialised()


@pytest.mark.parametrize(("made", "given", "what"), [
    ("state/membership.json", "", "an agent's data dir (it holds state/membership.json)"),
    ("state/agent-key.pem", "", "an agent's data dir (it holds state/agent-key.pem)"),  # a join that failed
    ("settings/agent-settings.json", "", "an agent's data dir (it holds settings/agent-settings.json)"),
    ("state/membership.json", "state", "an agent's state folder (it holds membership.json)"),
    ("settings/agent-settings.json", "settings", "an agent's settings folder (it holds agent-settings.json)"),
])
def test_an_agents_folder_is_never_taken_for_a_controllers(tmp_path: Path, made: str, given: str, what: str) -> None:
    # `fleet ls --data-dir AGENT_DIR` said to `fleet init` there, and init made a fleet beside the running agent's
    # keys; `fleet serve` on an agent's state folder (it holds ca.pem) said to `fleet init --force` there
    agent_dir = tmp_path / "agent"
    (agent_dir / made).parent.mkdir(parents=True)
    (agent_dir / made).write_text("{}")
    store = FleetStore(agent_dir / given)
    before = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*"))
    message = re.escape(f"{store.data_dir} is {what}, not a controller's: give the controller a --data-dir of its own")
    with pytest.raises(FleetStoreError, match=message):
        store.require_initialised()
    for force in (False, True):
        with pytest.raises(FleetStoreError, match=message):
            init_fleet(store, "test", ("127.0.0.1:1",), utc_now(), force=force)
    assert sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*")) == before


def test_a_lost_file_is_named_and_a_lost_controller_certificate_issued_again(store: FleetStore) -> None:
    agent_id = enroll_one(store)
    files = store.tls_files
    fleet = pki.fleet_id(files.ca_certificate())
    controller_id = files.own_identity().agent_id  # agents pin it at registration
    ca_pem = files.ca_path.read_bytes()
    files.ca_path.unlink()
    with pytest.raises(FleetStoreError, match=r"lacks ca\.pem .*state/ca\.pem from the data dir of any enrolled agent"):
        store.require_initialised()
    files.ca_path.write_bytes(ca_pem)  # as copied from an agent
    files.cert_path.unlink()
    store.require_initialised()
    assert files.own_identity().agent_id == controller_id and pki.fleet_id(files.ca_certificate()) == fleet
    pki.verify_certificate(pki.load_certificate_pem(files.cert_path.read_bytes()), files.ca_certificate(), utc_now())
    assert store.roster()[agent_id].hostname == "pc-1"
    assert load_ca(store).certificate == files.ca_certificate()


def test_of_two_concurrent_inits_the_second_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check ran before the lock: both inits of one data dir succeeded, each printing its own fleet id.
    store = FleetStore(tmp_path / "controller")
    waiting = threading.Event()
    lock_file = fleet_store.lock_file
    outcome: list[BaseException | None] = []

    def lock_announced(descriptor: int) -> None:
        waiting.set()
        lock_file(descriptor)

    def second_init() -> None:
        try:
            init_fleet(FleetStore(store.data_dir), "second", ("127.0.0.1:1",), utc_now())
            outcome.append(None)
        except FleetStoreError as error:
            outcome.append(error)

    with store.locked():  # the first init, between its check and its writes
        monkeypatch.setattr(fleet_store, "lock_file", lock_announced)
        second = threading.Thread(target=second_init)
        second.start()
        assert waiting.wait(10)
        store.ca_key_path.write_bytes(b"the first init's CA key")
    second.join(10)
    assert isinstance(outcome[0], FleetStoreError) and "ca-key.pem" in str(outcome[0])
    assert store.ca_key_path.read_bytes() == b"the first init's CA key"


def test_fleet_json_addresses_that_are_not_a_list_of_addresses_are_named(store: FleetStore) -> None:
    for addresses in ("127.0.0.1:17341", ["garbage"], [7]):
        store.write("fleet", {"name": "test", "addresses": addresses})
        with pytest.raises(FleetStoreError, match=r"fleet\.json: addresses"):
            issue_token(store, utc_now(), datetime.timedelta(hours=1), 1)
    store.write("fleet", ["x"])
    with pytest.raises(FleetStoreError, match=r"fleet\.json must hold an object"):
        issue_token(store, utc_now(), datetime.timedelta(hours=1), 1)


def test_parse_duration() -> None:
    assert parse_duration("24h") == datetime.timedelta(hours=24)
    assert parse_duration("1d12h") == datetime.timedelta(hours=36)
    for bad in ("", "24", "h", "0s", "3w", "\u0661d", "1_0h"):  # "١d" (an Arabic-Indic 1) was read as a day
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_tokens_are_persisted_as_hashes(store: FleetStore) -> None:
    text = token_for(store, "127.0.0.1:9", uses=2)
    secret = join_tokens.decode_join_token(text).secret
    on_disk = (store.data_dir / "tokens.json").read_text()
    assert join_tokens.secret_to_text(secret) not in on_disk and '"uses_left": 2' in on_disk


def test_a_token_valid_past_the_cas_end_is_refused(store: FleetStore) -> None:
    # `fleet token --ttl 99999d` was valid until 2300, long after the CA (10 years) can sign a joining PC
    ends = store.tls_files.ca_certificate().not_valid_after_utc
    ledger = (store.data_dir / "tokens.json").read_text()
    for days in (99999, 3_000_000):  # the second overflowed the year 9999 with a traceback
        with pytest.raises(ValueError, match=rf"--ttl {days} days reaches past the fleet CA's end on "
                                             rf"{ends.date().isoformat()}, after which no PC can join: give a shorter "
                                             "--ttl"):
            issue_token(store, utc_now(), datetime.timedelta(days=days), 1, ("127.0.0.1:9",))
    assert (store.data_dir / "tokens.json").read_text() == ledger  # nothing recorded
    with pytest.raises(ValueError, match="duration '99999999999d' is longer than 100 years"):
        parse_duration("99999999999d")  # past what a timedelta holds: an OverflowError traceback
    issue_token(store, utc_now(), ends - utc_now() - datetime.timedelta(days=1), 1, ("127.0.0.1:9",))


def test_join_then_register_then_remove(store: FleetStore, tmp_path: Path) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")
        assert membership == Membership.load(tmp_path / "agent")
        files = agent_tls_files(tmp_path / "agent")
        assert files.key_path.stat().st_mode & 0o077 == 0
        assert store.roster()[membership.agent_id].hostname == "pc-1"
        link = await open_link(address, files, expected_agent_id=membership.controller_id)
        await link.send(Register(membership.agent_id, ("127.0.0.1:7431",)))
        for _ in range(100):
            if membership.agent_id in server.live:
                break
            await asyncio.sleep(0.02)
        assert store.roster()[membership.agent_id].addresses == ("127.0.0.1:7431",)
        assert remove_agent(store, "pc-1") == membership.agent_id
        with pytest.raises(LinkError):  # dropped at once...
            for _ in range(20):
                await link.receive()
        with pytest.raises(LinkError, match="403"):  # ...and refused from now on
            await open_link(address, files, expected_agent_id=membership.controller_id)

    with_server(store, scenario)


def test_a_used_token_and_a_wrong_ca_are_refused(store: FleetStore, tmp_path: Path) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        text = token_for(store, address)
        await join(text, tmp_path / "first")
        with pytest.raises(EnrollmentError, match=r"refused: .*used up: ask the fleet's admin for a new one "
                                                  r"\(`deskfleet fleet token`\)"):
            await join(text, tmp_path / "second")
        token = join_tokens.decode_join_token(token_for(store, address))
        forged = join_tokens.encode_join_token(dataclasses.replace(token, ca_fingerprint="0" * 64))
        with pytest.raises(EnrollmentError, match="refusing to send the secret"):
            await join(forged, tmp_path / "third")
        ledger = (store.data_dir / "tokens.json").read_text()
        assert '"uses_left": 1' in ledger  # the forged attempt never spent the real token

    with_server(store, scenario)


def test_a_join_while_fleet_serve_is_stopped_says_to_start_it(store: FleetStore, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # it said "cannot reach the controller: [Errno 111] Connect call failed", twice (a warning, then the error)
    address = f"127.0.0.1:{free_port()}"
    expected = rf"{address}: cannot reach the controller: .* \(is `deskfleet fleet serve` running there\?\)"
    with caplog.at_level(logging.WARNING), pytest.raises(EnrollmentError, match=expected):
        asyncio.run(join(token_for(store, address), tmp_path / "agent"))
    assert "join via" not in caplog.text  # one address: the error alone says it


def test_a_join_while_the_roster_is_damaged_is_refused_and_spends_no_token(store: FleetStore, tmp_path: Path) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        text = token_for(store, address)
        agent_id = enroll_one(store)
        damaged = {agent_id: {"agent_id": agent_id, "hostname": 5, "enrolled_at": utc_now().isoformat()}}
        store.write("agents", damaged)
        with pytest.raises(EnrollmentError, match="needs repair"):
            await join(text, tmp_path / "agent")
        assert store.read("agents", {}) == damaged
        assert '"uses_left": 1' in (store.data_dir / "tokens.json").read_text()
        store.write("agents", {})
        await join(text, tmp_path / "agent")  # the same token, once the roster is repaired

    with_server(store, scenario)


def test_a_join_after_tokens_json_is_lost_names_the_file(store: FleetStore, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        text = token_for(store, address)
        (store.data_dir / "tokens.json").unlink()
        with caplog.at_level(logging.ERROR), pytest.raises(EnrollmentError, match="needs repair"):
            await join(text, tmp_path / "agent")
        assert "tokens.json is missing" in caplog.text and "deskfleet fleet token" in caplog.text
        assert not (store.data_dir / "tokens.json").exists()  # the join wrote no empty ledger in its place
        await join(token_for(store, address), tmp_path / "agent")  # a new token writes the file again

    with_server(store, scenario)


def test_a_survey_of_the_controllers_own_address_is_told_what_it_reached(store: FleetStore) -> None:
    # `fleet ls --peer` at fleet serve's address said only "unauthorized: only agents register with the controller"
    async def scenario(server: FleetServer, address: str) -> None:
        found = await fleet_survey.survey(store, fleet_survey.SurveyOptions(peers=(address,), discover_seconds=0,
                                                                            use_roster=False))
        try:
            [view] = found.agents
            assert view.report is None and view.problem is not None
            assert "this address is the fleet's controller (`deskfleet fleet serve`), not an agent" in view.problem
        finally:
            await found.close()

    with_server(store, scenario)


def test_revocations_reload_when_the_file_changes(store: FleetStore) -> None:
    revocations = Revocations(store)
    assert not revocations().agent_ids
    store.write("revoked", ["a" * 52])
    assert revocations().is_revoked("a" * 52)


def test_remove_names_what_it_cannot_find(store: FleetStore) -> None:
    with pytest.raises(FleetStoreError, match="no enrolled agent"):
        remove_agent(store, "nobody")


def test_a_name_that_matches_several_agents_lists_them(store: FleetStore) -> None:
    # "'vm' matches 2 agents: give more of the agent id", and which they were the admin had to find out
    first, second = "vm" + "a" * 50, "vm" + "b" * 50
    store.save_roster({agent_id: RosterEntry(agent_id, "desk", utc_now().isoformat()) for agent_id in (first, second)})
    with pytest.raises(FleetStoreError, match=rf"'desk' matches 2 agents: {first[:12]} \(desk\), {second[:12]} "
                                              r"\(desk\); give more of the agent id"):
        store.resolve_agent("desk")


def test_a_name_a_removed_agent_shares_with_a_live_one_is_refused_naming_the_live_ones_id(store: FleetStore) -> None:
    # it said "'pc6' matches 2 agents", the removed one among them; then (stop 53) it took the live one, which
    # removed for good the other of two PCs that had shared the name when the first was removed again by name
    old, new = "vm" + "a" * 50, "vm" + "b" * 50
    store.save_roster({agent_id: RosterEntry(agent_id, "pc6", utc_now().isoformat()) for agent_id in (old, new)})
    store.write("revoked", [old])
    with pytest.raises(FleetStoreError, match=rf"'pc6' names agent {new[:12]}, and also {old[:12]}, removed already: "
                                              rf"give the id \(`{new}`\)"):
        remove_agent(store, "pc6")
    assert store.read("revoked", []) == [old]  # nothing removed
    assert remove_agent(store, new) == new
    assert sorted(store.read("revoked", [])) == sorted([old, new])
    assert remove_agent(store, "pc6") in (old, new)  # both removed: removing it again changes nothing
    store.write("revoked", [])
    with pytest.raises(FleetStoreError, match="'pc6' matches 2 agents"):  # both live: which, the admin says
        remove_agent(store, "pc6")
    # an id prefix that matches a removed agent and a live one of another name is not narrowed to the live one
    store.save_roster({old: RosterEntry(old, "pc-a", utc_now().isoformat()),
                       "vmaacc" + "c" * 46: RosterEntry("vmaacc" + "c" * 46, "pc-b", utc_now().isoformat())})
    store.write("revoked", [old])
    with pytest.raises(FleetStoreError, match="'vmaa' matches 2 agents"):
        remove_agent(store, "vmaa")


def test_a_client_without_a_certificate_may_send_only_small_frames_and_only_so_many_at_once(
        store: FleetStore, tmp_path: Path) -> None:
    # Anyone on the LAN can open the enrollment side: at the fleet's frame limit, three such clients made the
    # controller buffer 1.2 GB. They get the join exchange's few KB, MAX_CONCURRENT_JOINS of them at a time, and
    # MAX_JOINS_PER_HOST from one address: one host holding all 16 slots open blocked every join of the fleet.
    from deskfleet.agent.link import ENROLLMENT_MAX_FRAME_BYTES, MAX_CONCURRENT_JOINS, MAX_JOINS_PER_HOST

    hosts = MAX_CONCURRENT_JOINS // MAX_JOINS_PER_HOST  # loopback's 127.0.0.2.. as that many hosts

    async def scenario(server: FleetServer, address: str) -> None:
        big = await _stranger(address)
        await big.recv()  # the JoinOffer
        await big.send(b"\0" * (ENROLLMENT_MAX_FRAME_BYTES + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await big.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big
        idle = [await _stranger(address, f"127.0.0.{2 + index // MAX_JOINS_PER_HOST}")
                for index in range(MAX_JOINS_PER_HOST)]
        for connection in idle:
            await connection.recv()  # each is being served: it got its JoinOffer
        await _refused_for_now(await _stranger(address, "127.0.0.2"), "too many joins in progress from 127.0.0.2")
        idle += [await _stranger(address, f"127.0.0.{2 + index // MAX_JOINS_PER_HOST}")
                 for index in range(MAX_JOINS_PER_HOST, MAX_CONCURRENT_JOINS)]  # the other hosts are served
        for connection in idle[MAX_JOINS_PER_HOST:]:
            await connection.recv()
        await _refused_for_now(await _stranger(address, f"127.0.0.{2 + hosts}"), "too many joins in progress")
        for connection in idle:
            await connection.close()
        await asyncio.sleep(0.1)
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")  # a real join still works
        assert store.roster()[membership.agent_id].hostname == "pc-1"

    with_server(store, scenario)


def test_a_client_that_sends_no_join_request_is_dropped_soon(store: FleetStore, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # a silent client kept its join slot for the whole JOIN_TIMEOUT_S (30 s), and simply opened another then
    from deskfleet.controller import fleet_ca

    monkeypatch.setattr(fleet_ca, "JOIN_REQUEST_TIMEOUT_S", 0.3)

    async def scenario(server: FleetServer, address: str) -> None:
        silent = await _stranger(address)
        await silent.recv()  # the JoinOffer, then nothing
        began = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            await silent.recv()
        assert time.monotonic() - began < 5
        assert closed.value.rcvd is not None and closed.value.rcvd.reason == "no JoinRequest in time"
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")  # a real one is in time
        assert store.roster()[membership.agent_id].hostname == "pc-1"

    with_server(store, scenario)


async def _stranger(address: str, source: str = "127.0.0.1") -> ClientConnection:
    """A certificate-less client of the enrollment side, from `source` (any of loopback's 127.0.0.0/8)."""
    # a minute to open, not websockets' 10 s: a fresh-clone CI run on a busy 2-core host timed out one of the
    # MAX_CONCURRENT_JOINS handshakes opened in turn here (the limits under test do not depend on it)
    return await connect(f"wss://{address}/", ssl=tls.enrollment_client_context(), server_hostname="127.0.0.1",
                         open_timeout=60, local_addr=(source, 0))


async def _refused_for_now(connection: ClientConnection, reason: str) -> None:
    with pytest.raises(ConnectionClosed) as closed:
        await connection.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013  # try again later
    assert closed.value.rcvd.reason == reason


def test_a_lost_list_of_removed_agents_is_never_read_as_nobody_removed(store: FleetStore, tmp_path: Path) -> None:
    # `fleet init` writes revoked.json; read as empty when missing, it would let removed agents back in and
    # tell every agent to forget them.
    removed_file = store.data_dir / "revoked.json"
    removed_file.unlink()
    revocations = Revocations(store)
    with pytest.raises(pki.PkiError, match=r"revoked\.json is missing"):
        revocations()
    store.save_roster({"a" * 52: RosterEntry("a" * 52, "pc-9", utc_now().isoformat())})
    with pytest.raises(FleetStoreError, match=r"revoked\.json is missing.*state/revoked\.json"):
        remove_agent(store, "pc-9")
    assert not removed_file.exists()  # not written with only the one removed now
    with pytest.raises(FleetStoreError, match=r"revoked\.json is missing"):
        FleetServer(store, "127.0.0.1:7430")  # refuses to serve rather than serve without it
    removed_file.write_text('{"format": 1, "body": null}')
    with pytest.raises(FleetStoreError, match=r"revoked\.json must hold a list of agent ids\. Restore it"):
        remove_agent(store, "pc-9")
    removed_file.write_text('{"format": 1, "body": [')  # half written: not "fix or remove it", which loses it
    with pytest.raises(FleetStoreError, match=r"revoked\.json is damaged.*Restore it") as damaged:
        remove_agent(store, "pc-9")
    assert "remove it" not in str(damaged.value)  # the read's own "fix or remove it" contradicted what follows
    with pytest.raises(pki.PkiError) as refused:  # what a peer's refusal logs: said once, not twice over
        revocations()
    assert str(refused.value).startswith(f"{removed_file} is damaged, and the list of agents removed")
    assert str(refused.value).count("cannot be read") == 1
    removed_file.write_text('{"format": 1, "body": []}')  # the recovery the message describes
    assert not revocations().agent_ids


def test_a_list_lost_between_start_and_serving_does_not_stop_the_server(store: FleetStore) -> None:
    async def main() -> None:
        server = FleetServer(store, f"127.0.0.1:{free_port()}")
        (store.data_dir / "revoked.json").write_text('{"format": 1, "body": [')  # damaged before run()
        async with asyncio.TaskGroup() as tasks:
            running = tasks.create_task(server.run())
            await asyncio.sleep(3 * fleet_server.REVOCATION_POLL_S)
            assert not running.done()  # still serving (refusing new links), not ended by the watcher
            server.stop()

    asyncio.run(main())


def test_while_the_list_is_lost_new_agent_links_are_refused_and_the_live_ones_kept(store: FleetStore,
                                                                                   tmp_path: Path) -> None:
    async def scenario(server: FleetServer, address: str) -> None:
        membership = await join(token_for(store, address, uses=2), tmp_path / "agent", "pc-1")
        files = agent_tls_files(tmp_path / "agent")
        link = await open_link(address, files, expected_agent_id=membership.controller_id)
        await link.send(Register(membership.agent_id, ("127.0.0.1:7431",)))
        assert isinstance(await link.receive(), RevocationUpdate)  # told the (empty) list on registering
        saved = (store.data_dir / "revoked.json").read_bytes()
        (store.data_dir / "revoked.json").unlink()
        with pytest.raises(LinkError, match="403"):
            await open_link(address, files, expected_agent_id=membership.controller_id)
        await asyncio.sleep(3 * fleet_server.REVOCATION_POLL_S)
        assert membership.agent_id in server.live  # the registered agent stays, told nothing new
        (store.data_dir / "revoked.json").write_bytes(saved)
        again = await open_link(address, files, expected_agent_id=membership.controller_id)
        await again.close()
        await link.close()

    with_server(store, scenario)


@pytest.mark.parametrize(("held", "message"), [("serving", r"is served by `deskfleet fleet serve` \(pid \d+\)"),
                                               ("deploying", r"a deploy from .* is running \(pid \d+\)")])
def test_init_force_refuses_a_fleet_being_served_or_deployed(store: FleetStore, held: str, message: str) -> None:
    # --force under a running serve replaced the CA the serve had loaded: it went on serving the old fleet, new
    # tokens were refused by it and the enrolled agents by the new store, and no error named the cause
    kept = {path.name: path.read_bytes() for path in store.data_dir.iterdir() if not path.name.startswith(".")}
    with getattr(store, held)(), pytest.raises(FleetStoreError, match=message):
        init_fleet(store, "again", ("127.0.0.1:1",), utc_now(), force=True)
    assert {name: (store.data_dir / name).read_bytes() for name in kept} == kept
    init_fleet(store, "again", ("127.0.0.1:1",), utc_now(), force=True)  # once it has stopped
    assert store.tls_files.ca_path.read_bytes() != kept["ca.pem"]


def test_a_token_without_fleet_json_names_the_missing_file(store: FleetStore) -> None:
    # it said only "no controller address to put in the token", while every other command still worked
    (store.data_dir / "fleet.json").unlink()
    with pytest.raises(FleetStoreError, match=r"fleet\.json is missing: it held the addresses .* pass --address"):
        issue_token(store, utc_now(), datetime.timedelta(hours=1), 1)
    assert issue_token(store, utc_now(), datetime.timedelta(hours=1), 1, ("127.0.0.1:7341",)).controller_addresses
    store.write("fleet", {"name": "test", "addresses": []})
    with pytest.raises(FleetStoreError, match=r"^no controller address to put in the token: pass --address"):
        issue_token(store, utc_now(), datetime.timedelta(hours=1), 1)


def test_a_folder_an_earlier_fleet_init_shared_with_an_agent_says_how_to_part_them(tmp_path: Path) -> None:
    # an earlier deskfleet let `fleet init` into an agent's data dir: "give the controller a --data-dir of its own"
    # would have the admin make a new fleet, and every PC join again
    store = FleetStore(tmp_path / "shared")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    (store.data_dir / "state").mkdir()
    (store.data_dir / "state" / "membership.json").write_text("{}")
    with pytest.raises(FleetStoreError, match=re.escape(
            f"{store.data_dir} holds both an agent's files (state/membership.json) and a controller's (")
            + r".*ca-key\.pem.*\): move the controller's files into a folder of their own and give that as "
            r"--data-dir .*; the fleet, its CA and its PCs stay as they are"):
        store.require_initialised()


def test_an_agents_state_folder_is_not_said_to_hold_a_controllers_files(tmp_path: Path) -> None:
    # `fleet init --data-dir AGENT/state` said the folder held a controller's files too (its ca.pem), to be moved:
    # that ca.pem is the agent's own copy of the fleet's CA certificate
    state = tmp_path / "agent" / "state"
    state.mkdir(parents=True)
    for name in ("membership.json", "agent-key.pem", "agent.pem", "ca.pem"):
        (state / name).write_text("x")
    with pytest.raises(FleetStoreError, match=re.escape(
            f"{state} is an agent's state folder (it holds membership.json), not a controller's: give the controller "
            "a --data-dir of its own")):
        FleetStore(state).refuse_agent_folder()


def test_a_removed_pc_that_joins_again_is_told_how(store: FleetStore, tmp_path: Path) -> None:
    # it was told "join with a new key", and not how a PC gets one
    async def scenario(server: FleetServer, address: str) -> None:
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")
        remove_agent(store, membership.agent_id)
        # the controller cannot know where the PC keeps its key: the joining agent names its own
        key = re.escape(str(tmp_path / "agent" / "agent-key.pem"))
        with pytest.raises(EnrollmentError, match=rf"agent {membership.agent_id[:12]} was removed from the fleet: a "
                                                  r"PC can join again only as a new agent, with a new key \(delete "
                                                  rf"{key}, then join with a new token\)"):
            await join(token_for(store, address), tmp_path / "agent", "pc-1")
        (tmp_path / "agent" / "agent-key.pem").unlink()  # as it says: a new key, a new agent
        note_removed(tmp_path / "agent", "2026-12-05T01:00:00+00:00")  # as the running agent noted the refusal
        assert (await join(token_for(store, address), tmp_path / "agent", "pc-1")).agent_id != membership.agent_id
        assert removed_seen(tmp_path / "agent") is None  # a member again: `resume` is not told otherwise

    with_server(store, scenario)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_controller_dir_variable_is_refused_not_taken_for_the_platforms(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str) -> None:
    # as --data-dir "" is refused: an unset variable's empty value silently meant the platform's folder
    from deskfleet.controller.cli import main

    monkeypatch.setenv("DESKFLEET_CONTROLLER_DIR", value)
    assert main(["fleet", "ls", "--discover-seconds", "0"]) == 2
    assert "$DESKFLEET_CONTROLLER_DIR is set but empty (an unset variable?)" in capsys.readouterr().err


def test_a_pc_that_joins_with_another_pcs_name_is_logged(store: FleetStore, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    # a second `bob-pc` joined without a word; `fleet remove bob-pc` then asked which one was meant
    async def scenario(server: FleetServer, address: str) -> None:
        first = await join(token_for(store, address), tmp_path / "first", "bob-pc")
        with caplog.at_level(logging.WARNING):
            second = await join(token_for(store, address), tmp_path / "second", "bob-pc")
        assert [record.getMessage() for record in caplog.records if "joined as" in record.getMessage()] == [
            f"agent {second.agent_id[:12]} joined as bob-pc, the name agent(s) {first.agent_id[:12]} have too: `fleet "
            "ls` and `fleet remove` tell them apart by agent id (join again with --hostname for a name of its own)"]

    with_server(store, scenario)


def test_a_data_dir_without_a_fleet_says_the_init_that_makes_one_there(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # `fleet token --data-dir EMPTY` said "run `deskfleet fleet init` first", which would make the fleet elsewhere
    from deskfleet.controller.cli import main

    assert main(["fleet", "token", "--data-dir", str(tmp_path / "empty")]) == 2
    said = capsys.readouterr().err
    assert f"holds no fleet: run `deskfleet fleet init --data-dir {tmp_path / 'empty'}` first" in said


def test_joins_refused_as_too_many_are_logged_once_a_minute_a_host(store: FleetStore,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # a host that reopened its connections at once wrote 1,671 warning lines in 30 s
    from deskfleet.agent.link import MAX_JOINS_PER_HOST

    async def scenario(server: FleetServer, address: str) -> None:
        idle = [await _stranger(address) for _ in range(MAX_JOINS_PER_HOST)]
        for connection in idle:
            await connection.recv()
        with caplog.at_level(logging.WARNING, logger="deskfleet.agent.link"):
            for _ in range(3):
                await _refused_for_now(await _stranger(address), "too many joins in progress from 127.0.0.1")
        for connection in idle:
            await connection.close()

    with_server(store, scenario)
    assert len([record for record in caplog.records if "refused a join from" in record.getMessage()]) == 1


def test_a_join_refused_while_the_controller_is_busy_tries_again(store: FleetStore, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # an office's PCs joined by one script at once were refused ("too many joins in progress"), each with exit 2
    from deskfleet.agent import enroll
    from deskfleet.agent.link import MAX_JOINS_PER_HOST

    async def scenario(server: FleetServer, address: str) -> None:
        idle = [await _stranger(address) for _ in range(MAX_JOINS_PER_HOST)]  # the slots of this host, taken
        for connection in idle:
            await connection.recv()

        async def free_them() -> None:
            await asyncio.sleep(0.5)
            for connection in idle:
                await connection.close()

        freeing = asyncio.create_task(free_them())
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")  # tried again, joined
        await freeing
        assert store.roster()[membership.agent_id].hostname == "pc-1"
        idle = [await _stranger(address) for _ in range(MAX_JOINS_PER_HOST)]
        for connection in idle:
            await connection.recv()
        monkeypatch.setattr(enroll, "JOIN_BUSY_WAIT_S", 1.5)
        with pytest.raises(EnrollmentError, match=r"the controller is busy with other joins \(too many joins in "
                                                  r"progress from 127\.0\.0\.1\), for 2 s: join again later"):
            await join(token_for(store, address), tmp_path / "other", "pc-2")
        for connection in idle:
            await connection.close()

    with_server(store, scenario)


def test_a_join_dropped_as_its_address_holds_too_many_opening_connections_tries_again(
        store: FleetStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # from an exploratory test: the port's gate drops a connection before TLS while its address has too many
    # opening (a flood from a PC behind the same address), and the join failed at once as "cannot reach"
    from deskfleet.agent import enroll, tls_gate

    monkeypatch.setattr(tls_gate, "MAX_OPENING_PER_HOST", 2)

    async def scenario(server: FleetServer, address: str) -> None:
        host, port = address.rsplit(":", 1)
        held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]  # silent: their handshakes wait

        async def free_them() -> None:
            await asyncio.sleep(1.0)
            for _reader, writer in held:
                writer.close()

        freeing = asyncio.create_task(free_them())
        membership = await join(token_for(store, address), tmp_path / "agent", "pc-1")  # tried again, joined
        await freeing
        assert store.roster()[membership.agent_id].hostname == "pc-1"
        held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        monkeypatch.setattr(enroll, "JOIN_BUSY_WAIT_S", 1.5)
        with pytest.raises(EnrollmentError, match=r"the controller dropped the connection as it opened \(\w+: it "
                                                  r"turns an address away while 64 of its connections are opening; "
                                                  r"or no deskfleet controller listens there\), for 2 s: join again"):
            await join(token_for(store, address), tmp_path / "other", "pc-2")
        for _reader, writer in held:
            writer.close()

    with_server(store, scenario)


def test_the_hostname_shown_for_a_pc_the_roster_never_saw_join_names_no_pc(store: FleetStore) -> None:
    # an agent that joined a controller restored from an older backup is listed as host '?': `fleet remove '?'`
    # removed it, for good
    unknown = "vm" + "c" * 50
    store.save_roster({unknown: RosterEntry(unknown, UNKNOWN_HOSTNAME, utc_now().isoformat())})
    with pytest.raises(FleetStoreError, match=r"'\?' is how `fleet ls` shows a PC whose hostname this controller "
                                              r"never learnt .*: give its agent id"):
        remove_agent(store, "?")
    assert not store.read("revoked", []) and store.resolve_agent(unknown[:10]) == unknown


@pytest.mark.parametrize(("routes", "expected"), [
    ({socket.AF_INET: "10.1.0.5", socket.AF_INET6: "fd61::12"}, "10.1.0.5:7341"),  # dual stack: IPv4, as before
    ({socket.AF_INET: None, socket.AF_INET6: "fd61::12"}, "[fd61::12]:7341"),  # IPv6 alone: gave 127.0.0.1
    ({socket.AF_INET: None, socket.AF_INET6: None}, "127.0.0.1:7341"),  # no network yet
])
def test_the_default_address_is_the_routes_of_either_family(monkeypatch: pytest.MonkeyPatch,
                                                            routes: dict[int, str | None], expected: str) -> None:
    monkeypatch.setattr(fleet_ca, "route_source", lambda family, target: routes[family])
    monkeypatch.setattr(fleet_ca, "interface_addresses", lambda: [])
    assert fleet_ca.default_address() == expected


@pytest.mark.parametrize(("here", "expected"), [(["10.62.0.1", "fd62::1"], "10.62.0.1:7341"),
                                                (["fd62::1"], "[fd62::1]:7341")])
def test_on_a_lan_with_no_default_route_the_default_address_is_an_interfaces(
        monkeypatch: pytest.MonkeyPatch, here: list[str], expected: str) -> None:
    # it was 127.0.0.1, put in every token without a word (from an exploratory test of a mixed IPv4/IPv6 office)
    monkeypatch.setattr(fleet_ca, "route_source", lambda family, target: None)
    monkeypatch.setattr(fleet_ca, "interface_addresses", lambda: here)
    assert fleet_ca.default_address() == expected


def test_a_route_from_this_pc_alone_is_no_address_to_give_out() -> None:
    assert fleet_ca.route_source(socket.AF_INET, "127.0.0.1") is None  # loopback: no other PC dials it
    assert fleet_ca.route_source(socket.AF_INET6, "::1") is None
