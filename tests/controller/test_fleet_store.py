"""The controller's data dir: damaged files are refused by name (file and field), and left as they were."""

from __future__ import annotations

import datetime
import logging
import os
import re
from pathlib import Path

import pytest

from deskfleet.agent.link import utc_now
from deskfleet.common import pki
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_ca import init_fleet
from deskfleet.controller.fleet_store import FleetStore, FleetStoreError, RosterEntry, agent_label
from tests.log_records import records_of


def new_agent_id() -> str:
    return pki.agent_id_for_key(pki.create_private_key().public_key())


def entry_fields(agent_id: str) -> dict[str, object]:
    return {"agent_id": agent_id, "hostname": "pc-1", "enrolled_at": utc_now().isoformat(),
            "addresses": ["127.0.0.1:7431"], "registered_at": None}


@pytest.mark.parametrize(("field", "value", "named"), [
    ("hostname", 5, "hostname must be a string"),
    ("enrolled_at", None, "enrolled_at must be a string"),
    ("registered_at", 3, "registered_at must be a string or null"),
    ("addresses", "127.0.0.1:7431", "addresses must be a list"),
    ("addresses", [1], "addresses must be a list"),
    ("agent_id", 7, "agent_id must be a string"),
    ("agent_id", "x" * 52, "differs from the id it is filed under"),
    ("colour", "red", "unknown fields"),
])
def test_a_malformed_roster_entry_names_the_file_and_the_field(store: FleetStore, field: str, value: object,
                                                               named: str) -> None:
    # A number for a hostname gave a TypeError traceback in `fleet ls`, a bad address "address '1' is not
    # host:port" with no file named.
    agent_id = new_agent_id()
    store.write("agents", {agent_id: {**entry_fields(agent_id), field: value}})
    before = (store.data_dir / "agents.json").read_bytes()
    with pytest.raises(FleetStoreError, match=named) as refused:
        store.roster()
    assert str(store.data_dir / "agents.json") in str(refused.value) and agent_id[:12] in str(refused.value)
    assert (store.data_dir / "agents.json").read_bytes() == before


def test_a_roster_address_that_cannot_be_dialled_is_left_out_not_the_roster(store: FleetStore) -> None:
    # a roster written before Register's addresses were checked as strictly may hold "[..]:1", which failed every
    # survey; refusing the whole file would fail every fleet command instead
    agent_id = new_agent_id()
    store.write("agents", {agent_id: {**entry_fields(agent_id), "addresses": ["[..]:1", "garbage", "127.0.0.1:7431"]}})
    with records_of("deskfleet.controller.fleet_store", logging.WARNING) as logged:
        assert store.roster()[agent_id].addresses == ("127.0.0.1:7431",)
    said = "\n".join(logged.messages())
    assert "address '[..]:1' names no host that can be dialled" in said and agent_id[:12] in said


def test_roster_keys_and_entries_must_be_agents(store: FleetStore) -> None:
    for body, named in (({"not-an-id": entry_fields("not-an-id")}, "is not an agent id"),
                        ({new_agent_id(): ["pc-1"]}, "entry must be an object")):
        store.write("agents", body)
        with pytest.raises(FleetStoreError, match=named):
            store.roster()


def test_a_good_roster_reads_back_as_written(store: FleetStore) -> None:
    agent_id = new_agent_id()
    entry = RosterEntry(agent_id, "pc-1", utc_now().isoformat(), ("127.0.0.1:7431", "[::1]:7431"),
                        utc_now().isoformat())
    store.save_roster({agent_id: entry})
    assert store.roster() == {agent_id: entry}
    store.write("agents", {agent_id: {"agent_id": agent_id, "hostname": "pc-1", "enrolled_at": "x"}})
    assert store.roster()[agent_id].addresses == ()  # written before agents registered an address


def test_messages_name_an_agent_by_its_hostname_where_the_roster_has_it(store: FleetStore) -> None:
    known, stranger = new_agent_id(), new_agent_id()
    store.save_roster({known: RosterEntry(known, "alice-pc", utc_now().isoformat())})
    hostnames = store.hostnames()
    assert hostnames == {known: "alice-pc"}
    assert agent_label(known, hostnames) == f"agent {known[:12]} on alice-pc"
    assert agent_label(stranger, hostnames) == f"agent {stranger[:12]}"  # not enrolled here: the id alone


def test_a_damaged_roster_names_agents_by_id_alone_and_is_still_named_where_it_is_needed(store: FleetStore) -> None:
    (store.data_dir / "agents.json").write_text("{not json", encoding="utf-8")
    assert store.hostnames() == {}  # a message's label does not end a run
    with pytest.raises(FleetStoreError, match=r"agents\.json"):
        store.roster()


def test_json_nested_too_deeply_names_the_file(store: FleetStore) -> None:
    path = store.data_dir / "tokens.json"
    path.write_text('{"format": 1, "body": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(FleetStoreError, match=r"tokens\.json.*nests too deeply"):
        store.read("tokens", [])


@pytest.mark.parametrize(("name", "damage", "named"), [
    ("ca.pem", b"garbage", r"ca\.pem \(the fleet CA's certificate\) is unreadable or damaged"),
    ("ca-key.pem", None, r"ca-key\.pem \(the fleet CA's key\) is unreadable or damaged"),
    ("controller.pem", b"garbage", r"controller\.pem \(the controller's certificate\) is unreadable or damaged"),
    ("controller-key.pem", b"", r"controller-key\.pem \(the controller's key\) is unreadable or damaged"),
])
def test_a_damaged_pem_file_is_named(store: FleetStore, name: str, damage: bytes | None, named: str) -> None:
    path = store.data_dir / name
    path.write_bytes(path.read_bytes()[:50] if damage is None else damage)
    before = path.read_bytes()
    with pytest.raises(FleetStoreError, match=named):
        store.require_initialised()
    assert path.read_bytes() == before


def test_pem_files_that_do_not_belong_together_are_named(store: FleetStore, tmp_path: Path) -> None:
    other = FleetStore(tmp_path / "other")
    init_fleet(other, "other", ("127.0.0.1:1",), utc_now())
    files, other_files = store.tls_files, other.tls_files
    ca_pem = files.ca_path.read_bytes()
    files.ca_path.write_bytes(other_files.ca_path.read_bytes())
    with pytest.raises(FleetStoreError, match=r"ca\.pem is not the certificate of .*ca-key\.pem"):
        store.require_initialised()
    files.ca_path.write_bytes(ca_pem)
    files.cert_path.write_bytes(other_files.cert_path.read_bytes())
    with pytest.raises(FleetStoreError, match=r"controller\.pem .*not the certificate of .*controller-key\.pem"):
        store.require_initialised()
    files.key_path.write_bytes(other_files.key_path.read_bytes())  # its own key, but another fleet's CA
    with pytest.raises(FleetStoreError, match=r"controller\.pem .*not issued by this fleet's CA"):
        store.require_initialised()


def test_the_cli_prints_a_damaged_file_without_a_traceback(store: FleetStore,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # A garbage ca.pem gave an ssl.SSLError traceback from `fleet ls` once it dialled an agent of the roster.
    agent_id = new_agent_id()
    store.write("agents", {agent_id: entry_fields(agent_id)})
    store.tls_files.ca_path.write_bytes(b"garbage")
    assert main(["fleet", "ls", "--discover-seconds", "0", "--data-dir", str(store.data_dir)]) == 2
    assert "ca.pem" in capsys.readouterr().err


def test_an_expired_controller_certificate_or_ca_is_named_with_its_day_and_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It said "certificate is not valid at <now> (valid <from> to <until>); delete it, and the next fleet command
    # issues it again", also of an expired CA, which a new controller.pem does not mend
    made = utc_now() - datetime.timedelta(days=826)
    store = FleetStore(tmp_path / "old")
    init_fleet(store, "test", ("127.0.0.1:1",), made)
    day = (made + datetime.timedelta(days=825)).date().isoformat()
    assert main(["fleet", "ls", "--discover-seconds", "0", "--data-dir", str(store.data_dir)]) == 2
    error = capsys.readouterr().err
    assert "controller.pem (the controller's certificate): the certificate of controller" in error
    assert f"expired on {day}: delete controller.pem" in error and error.count("issues it again") == 1
    store.tls_files.cert_path.unlink()  # the fix it names
    store.require_initialised()
    assert store.tls_files.own_identity().not_valid_after > utc_now() + datetime.timedelta(days=824)
    ancient = FleetStore(tmp_path / "ancient")
    init_fleet(ancient, "test", ("127.0.0.1:1",), utc_now() - datetime.timedelta(days=3651))
    with pytest.raises(FleetStoreError, match=r"ca.pem \(the fleet CA's certificate\): the fleet CA .* expired on "
                                              r".*`deskfleet fleet init --force`") as expired:
        ancient.require_initialised()
    assert "delete it" not in str(expired.value)


@pytest.mark.parametrize(("name", "fix"), [
    ("agents", "fix it, or remove it: `fleet ls` then lists each agent again only once it registers"),
    ("deployments", "fix it, or remove it and deploy the models again"),
    ("tokens", "fix it, or remove it: every join token issued so far is then void"),
    ("fleet", "fix it, or restore it from a backup"),
])
def test_a_damaged_file_says_what_removing_it_costs(store: FleetStore, name: str, fix: str) -> None:
    # "fix or remove it" for every file: a removed agents.json hid the whole fleet ("no agents found") until each
    # agent registered again, and nothing said so
    (store.data_dir / f"{name}.json").write_text('{"format": 1, "body": {')
    with pytest.raises(FleetStoreError, match=rf"{name}\.json is unreadable or not JSON \(.*\); {re.escape(fix)}"):
        store.read(name, {})


def test_a_file_this_user_may_not_read_says_whose_it_is_not_to_restore_it(store: FleetStore,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # it said "fleet.json is unreadable or not JSON (Permission denied); fix it, or restore it from a backup"
    def denied(path: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(FleetStoreError, match=re.escape(f"cannot read {store.data_dir / 'fleet.json'} (Permission "
                                                        "denied): run deskfleet as the user that owns the data dir")):
        store.read("fleet", None)


def test_a_damaged_removal_list_says_how_to_mend_it_once(store: FleetStore) -> None:
    from deskfleet.controller.fleet_ca import Revocations

    (store.data_dir / "revoked.json").write_text("{not json")
    with pytest.raises(pki.PkiError) as refused:  # what a survey's or a server's look at it raises
        Revocations(store)()
    said = str(refused.value)
    assert "revoked.json is damaged, and the list of agents removed from this fleet cannot be read" in said
    assert said.lower().count("restore it from a backup") == 1, said  # it was said twice



def test_a_key_this_user_may_not_read_is_not_called_damaged(store: FleetStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # "ca-key.pem (the fleet CA's key) is unreadable or damaged ([Errno 13] ...); restore it from a backup ... `fleet
    # init --force` makes a new fleet": advice that loses a whole fleet over a file's owner
    def denied(path: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(FleetStoreError, match=r"cannot read .*ca\.pem \(.*: Permission denied\): run deskfleet as the "
                                              r"user that owns the data dir"):
        store.require_initialised()


def test_a_lock_held_by_fleet_init_force_is_named_as_such(tmp_path: Path) -> None:
    # six `fleet init --force` at once: those refused were told a `fleet serve` held the data dir
    store = FleetStore(tmp_path / "controller")
    with store.replacing():
        with pytest.raises(FleetStoreError, match=r"`deskfleet fleet init --force` is replacing the fleet of .* \(pid "
                                                  rf"{os.getpid()}\): serve it once it has finished"):
            with store.serving():
                pass
        with pytest.raises(FleetStoreError, match=r"is replacing the fleet of .*: deploy once it has finished"):
            with store.deploying():
                pass
        with pytest.raises(FleetStoreError, match=r"is replacing the fleet of .*: one replacement at a time"):
            with store.replacing():
                pass
    with store.serving():  # and a serve is still named as one
        with pytest.raises(FleetStoreError, match=rf"is served by `deskfleet fleet serve` \(pid {os.getpid()}\)"):
            with store.replacing():
                pass


def test_a_command_waiting_for_the_data_dirs_lock_says_so_and_who_holds_it(tmp_path: Path) -> None:
    # a command stopped (Ctrl-Z) while it held .lock made `fleet token` wait without a word
    import threading

    from deskfleet.common.file_lock import try_lock_file, unlock_file
    from tests.log_records import records_of

    store = FleetStore(tmp_path / "controller")
    with store.locked():
        pass
    with open(store.data_dir / ".lock", "a+b") as other, records_of("deskfleet.controller.fleet_store") as logged:
        assert try_lock_file(other.fileno())
        other.truncate(0)  # as a holder writes its pid
        other.write(b"\n4242")
        other.flush()
        entered = threading.Event()

        def waiter() -> None:
            with store.locked():
                entered.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        assert not entered.wait(0.5)  # it waits...
        unlock_file(other.fileno())
        assert entered.wait(10)  # ...until the holder lets go
        thread.join()
    assert logged.messages() == [f"waiting for the data dir's lock {store.data_dir / '.lock'}, which another "
                                 "deskfleet command holds (pid 4242)"]


def test_a_stamp_is_later_than_every_time_on_record_whatever_the_clock_says(tmp_path: Path) -> None:
    # a controller clock stepped back 5 minutes recorded a PC's call-in before the re-plan that had left it out: no
    # run took it back until it called in again (from an exploratory test of clocks)
    store = FleetStore(tmp_path / "controller")
    noon = datetime.datetime(2026, 12, 7, 12, 0, tzinfo=datetime.UTC)
    store.save_roster({"a" * 52: RosterEntry("a" * 52, "pc-1", noon.isoformat(), (), registered_at=noon.isoformat())})
    replanned = noon + datetime.timedelta(minutes=5)
    store.write("deployments", {"m@1": {"replanned_at": replanned.isoformat(), "assigned_at": "not a time",
                                        "rejoin_tried_at": None}, "m@2": "damaged"})
    assert store.stamp(noon - datetime.timedelta(hours=1)) == replanned + datetime.timedelta(milliseconds=1)
    later = noon + datetime.timedelta(hours=1)
    assert store.stamp(later) == later  # a clock past every record: itself
    (store.data_dir / "agents.json").write_text("{")  # unreadable: the clock alone
    assert store.stamp(noon) == noon


def test_a_call_in_is_recorded_after_the_re_plan_that_came_before_it(tmp_path: Path) -> None:
    from deskfleet.controller.fleet_deploy import called_in_since
    from deskfleet.controller.fleet_server import FleetServer

    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    agent_id = "b" * 52
    replanned = utc_now()
    store.save_roster({agent_id: RosterEntry(agent_id, "pc-2", replanned.isoformat(), ())})
    store.write("deployments", {"m@1": {"replanned_at": replanned.isoformat()}})
    stepped_back = replanned - datetime.timedelta(minutes=5)  # the clock as the PC called in, after the re-plan
    FleetServer(store, "127.0.0.1:1")._save_addresses({agent_id: (("10.0.0.2:7431",), stepped_back.isoformat())})
    assert called_in_since(store.roster()[agent_id], replanned)
