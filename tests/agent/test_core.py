"""The agent core's message handling, without sockets: roles, shards, assignments, forwards."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from deskfleet.agent import core as core_module
from deskfleet.agent.core import INLINE_STEP_TOKENS, AgentCore, CommandError, HostedStage, runs_inline
from deskfleet.agent.link import Link, LinkError
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common import pki
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import MonitorReading
from deskfleet.common.kv_ledger import AdmitRow, AppendSlots, Compact
from deskfleet.common.model_spec import MANIFEST_NAME, load_manifest
from deskfleet.common.prefill_scratch import PREFILL_SCRATCH_FIRST
from deskfleet.common.wire import (
    MAX_KNOWN_REMOVALS,
    AssignStage,
    Error,
    ErrorCode,
    Forward,
    ForwardResult,
    KnownRemovals,
    ManifestEntry,
    Message,
    NextHop,
    Precision,
    ReleaseMicroBatch,
    ResultsHere,
    RevocationUpdate,
    Role,
    ShardChunk,
    ShardComplete,
    ShardHave,
    ShardQuery,
    StageReady,
    StageRef,
    StatusReport,
    StatusRequest,
)
from deskfleet.controller.batch_track import BatchTrack
from tests.fleet_pki import FAR_FUTURE, make_ca, make_member, removals


class FakeMonitor:
    def read(self) -> MonitorReading:
        return MonitorReading(cpu_load=0.1, memory_free_bytes=8 << 30, memory_total_bytes=16 << 30,
                              battery_percent=None, on_ac_power=None, temperatures=(), igpu_busy=None)


class FakeLink:
    def __init__(self, role: Role) -> None:
        self.peer = pki.PeerIdentity("a" * 52, role, "0" * 64, FAR_FUTURE)
        self.large_frames = False  # whether the core let it carry frames past link.SMALL_FRAME_BYTES

    def take_large_frames(self) -> None:
        self.large_frames = True

    def take_small_frames(self) -> None:
        self.large_frames = False

    async def send(self, message: Message) -> None:
        pass

    def describe(self) -> str:
        return f"fake {self.peer.role.value}"


@pytest.fixture
def core(tmp_path: Path) -> AgentCore:
    ca = make_ca(tmp_path / "ca")
    pki.write_private_key(tmp_path / "ca" / "ca-key.pem", ca.private_key)  # for fleet_ca (other files import core)
    files = make_member(ca, tmp_path / "agent", "agent")
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    return AgentCore(files, settings, ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor())


@pytest.fixture
def fleet_ca(core: AgentCore, tmp_path: Path) -> pki.FleetCa:
    """The CA of `core`'s fleet, with its key: it signs removals."""
    return pki.FleetCa(pki.load_certificate_pem((tmp_path / "ca" / "ca.pem").read_bytes()),
                       pki.load_private_key_pem((tmp_path / "ca" / "ca-key.pem").read_bytes()))


def handle(core: AgentCore, role: Role, message: Message) -> Message | None:
    return asyncio.run(core.handle(cast(Link, FakeLink(role)), message))


def test_status_report_comes_from_the_monitor(core: AgentCore) -> None:
    report = handle(core, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport)
    assert report.state is AgentState.AVAILABLE and report.free_memory_bytes == 8 << 30
    assert report.temperature_c is None and report.stages == ()


def test_only_the_controller_may_command(core: AgentCore) -> None:
    for message in (StatusRequest(), ShardQuery(()), ShardComplete("0" * 64)):
        with pytest.raises(CommandError) as refusal:
            handle(core, Role.AGENT, message)
        assert refusal.value.code is ErrorCode.UNAUTHORIZED


def test_a_shard_arrives_in_chunks_and_is_then_held(core: AgentCore) -> None:
    data = bytes(range(256)) * 40
    digest = hashlib.sha256(data).hexdigest()
    have = handle(core, Role.CONTROLLER, ShardQuery((digest,)))
    assert isinstance(have, ShardHave) and have.complete == () and have.partial == ()
    handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data[:4000]))
    have = handle(core, Role.CONTROLLER, ShardQuery((digest,)))
    assert isinstance(have, ShardHave) and have.partial[0].offset == 4000  # resumable
    handle(core, Role.CONTROLLER, ShardChunk(digest, 4000, len(data), data[4000:]))
    handle(core, Role.CONTROLLER, ShardComplete(digest))
    have = handle(core, Role.CONTROLLER, ShardQuery((digest,)))
    assert isinstance(have, ShardHave) and have.complete == (digest,)


def test_a_corrupted_shard_is_refused(core: AgentCore) -> None:
    digest = hashlib.sha256(b"right").hexdigest()
    handle(core, Role.CONTROLLER, ShardChunk(digest, 0, 5, b"wrong"))
    with pytest.raises(CommandError) as refusal:
        handle(core, Role.CONTROLLER, ShardComplete(digest))
    assert refusal.value.code is ErrorCode.SHARD_MISMATCH
    with pytest.raises(CommandError, match="out of order"):
        handle(core, Role.CONTROLLER, ShardChunk(digest, 3, 5, b"gh"))


def test_an_assignment_names_the_shards_it_lacks(core: AgentCore) -> None:
    entry = ManifestEntry("layer_000.bin", "1" * 64, 10)
    assignment = AssignStage(StageRef("m@1", 0, 1), True, True, "CPU", Precision.F32, None, (entry,))
    with pytest.raises(CommandError, match=r"shards not in the cache: layer_000\.bin") as refusal:
        handle(core, Role.CONTROLLER, assignment)
    assert refusal.value.code is ErrorCode.SHARD_MISMATCH


def test_a_forward_without_a_stage_is_refused(core: AgentCore) -> None:
    forward = Forward(0, 0, (0,), (AppendSlots(1, (1,), (0,)),), np.zeros(1, np.int64),
                      np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64), None, None)
    with pytest.raises(CommandError) as refusal:
        handle(core, Role.AGENT, forward)
    assert refusal.value.code is ErrorCode.NOT_ASSIGNED


class RecordingLink(FakeLink):
    """A fake link that keeps what the core sends on it, and whether it was refused."""

    def __init__(self, role: Role, agent_id: str = "a" * 52) -> None:
        super().__init__(role)
        self.peer = pki.PeerIdentity(agent_id, role, "0" * 64, FAR_FUTURE)
        self.sent: list[Message] = []
        self.refused: str | None = None

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def refuse(self, code: ErrorCode, text: str) -> None:
        self.refused = f"{code.value}: {text}"


class ClosingLink(RecordingLink):
    """A recording link whose peer closes it at once (serve_link then returns)."""

    async def receive(self) -> Message:
        raise LinkError("closed by the peer")


def test_results_and_relayed_errors_go_to_the_driver_that_said_results_here(core: AgentCore) -> None:
    async def scenario() -> tuple[RecordingLink, RecordingLink]:
        driver, other = RecordingLink(Role.CONTROLLER), RecordingLink(Role.CONTROLLER)
        core._controller_links += [cast(Link, driver), cast(Link, other)]  # other spoke last
        await core.handle(cast(Link, driver), ResultsHere(0, 1 << 62))
        # a failure upstream arrives from the previous stage: this agent (the last stage) hands it back
        last = AssignStage(StageRef("m@1", 2, 4), False, True, "CPU", Precision.F32, None, (),
                           previous_agent_id="b" * 52)
        core.stages[last.stage] = HostedStage(last, cast(StageExecutor, None), asyncio.Lock(), "m_1-2-4")
        await core.handle(cast(Link, RecordingLink(Role.AGENT, "b" * 52)), Error(ErrorCode.INTERNAL, "stage 1 died"))
        return driver, other

    driver, other = asyncio.run(scenario())
    assert [type(m) for m in driver.sent] == [Error] and other.sent == []
    assert isinstance(driver.sent[0], Error) and driver.sent[0].message == "stage 1 died"


def test_release_micro_batch_is_accepted_from_the_previous_stage(core: AgentCore) -> None:
    assert handle(core, Role.AGENT, ReleaseMicroBatch(5)) is None  # no stage hosted: nothing to free


def test_a_removed_agent_is_dropped_and_its_forwards_refused(core: AgentCore, fleet_ca: pki.FleetCa) -> None:
    removed = "c" * 52

    async def scenario() -> RecordingLink:
        link = RecordingLink(Role.AGENT, removed)
        core._links.add(cast(Link, link))
        await core.handle(cast(Link, RecordingLink(Role.CONTROLLER)), removals(fleet_ca, removed))
        return link

    link = asyncio.run(scenario())
    assert link.refused is not None and "removed" in link.refused
    assert core.revocations().is_revoked(removed)
    with pytest.raises(CommandError) as refusal:
        handle(core, Role.AGENT, removals(fleet_ca))  # only the controller may say who is removed
    assert refusal.value.code is ErrorCode.UNAUTHORIZED


def test_a_removal_the_fleets_ca_did_not_sign_is_refused_and_changes_nothing(
        core: AgentCore, fleet_ca: pki.FleetCa, tmp_path: Path) -> None:
    kept, new = "c" * 52, "d" * 52
    handle(core, Role.CONTROLLER, removals(fleet_ca, kept))
    stranger = make_ca(tmp_path / "stranger")
    for update in (removals(stranger, new),  # another fleet's CA
                   RevocationUpdate.of((kept, new), (removals(fleet_ca, kept).signatures[0],) * 2)):  # kept's for new
        with pytest.raises(CommandError, match=f"removal of agent {new[:12]} is not signed") as refusal:
            handle(core, Role.CONTROLLER, update)
        assert refusal.value.code is ErrorCode.BAD_MESSAGE
        assert core.revocations().agent_ids == {kept}


def test_the_removed_agents_are_remembered_across_a_restart_and_never_forgotten(
        core: AgentCore, fleet_ca: pki.FleetCa, tmp_path: Path) -> None:
    # A restarted agent must refuse a removed agent even while the controller is out of reach, and a controller
    # restored from a backup older than a removal must not make it forget one (removal is for good: the PC
    # joins again with a new key, so a new id).
    saved = tmp_path / "state" / "revoked.json"
    removed, later = "c" * 52, "d" * 52

    def restarted() -> AgentCore:
        return AgentCore(core.files, core.settings, core.cache, FakeMonitor(), revocations_file=saved)

    first = restarted()
    assert not first.revocations().agent_ids  # nothing saved yet
    handle(first, Role.CONTROLLER, removals(fleet_ca, removed))
    assert restarted().revocations().is_revoked(removed)
    handle(first, Role.CONTROLLER, removals(fleet_ca, later))  # a restored controller's list: added to, not replacing
    handle(first, Role.CONTROLLER, removals(fleet_ca))
    assert first.revocations().agent_ids == restarted().revocations().agent_ids == {removed, later}
    signatures = restarted()._removal_signatures  # kept with each removal, to give a restored controller back
    assert set(signatures) == {removed, later}
    for agent_id, signature in signatures.items():
        pki.check_removal(fleet_ca.certificate, agent_id, signature)
    for damaged in ("{not json", '{"revoked_agent_ids": ["not an id"]}', '{"revoked_agent_ids": 7}', "[]",
                    f'{{"revoked_agent_ids": ["{removed}"], "signatures": []}}',
                    f'{{"revoked_agent_ids": ["{removed}"], "signatures": {{"{removed}": "00"}}}}',
                    f'{{"revoked_agent_ids": [], "signatures": {{"{removed}": "{"0" * 128}"}}}}'):
        saved.write_text(damaged)
        agent = restarted()  # no traceback; and not read as "nobody removed": every agent link is refused
        refused = ClosingLink(Role.AGENT)
        asyncio.run(agent.serve_link(cast(Link, refused)))
        assert refused.refused is not None and refused.refused.startswith("unauthorized: "), damaged
        assert "until the controller sends its list of removed agents" in refused.refused
        handle(agent, Role.CONTROLLER, removals(fleet_ca, removed))  # the controller's list replaces it
        assert agent.revocations().is_revoked(removed) and restarted().revocations().is_revoked(removed)
        served = ClosingLink(Role.AGENT)  # known again: an agent not removed is served
        asyncio.run(agent.serve_link(cast(Link, served)))
        assert served.refused is None


def test_a_list_saved_before_removals_were_signed_holds_until_the_controllers_list_replaces_it(
        core: AgentCore, fleet_ca: pki.FleetCa, tmp_path: Path) -> None:
    saved = tmp_path / "state" / "revoked.json"
    saved.parent.mkdir(parents=True)
    removed, other = "c" * 52, "d" * 52
    saved.write_text(json.dumps({"revoked_agent_ids": [removed, other]}))  # what agents before protocol 6 saved
    agent = AgentCore(core.files, core.settings, core.cache, FakeMonitor(), revocations_file=saved)
    assert agent.revocations().agent_ids == {removed, other}  # refused while the controller is out of reach
    registration = RecordingLink(Role.CONTROLLER)
    agent._registration_links.add(cast(Link, registration))
    asyncio.run(agent.handle(cast(Link, registration), removals(fleet_ca, removed)))
    assert agent.revocations().agent_ids == {removed}  # replaced, as lists were before they were signed
    assert registration.sent == []  # nothing signed to give back
    signatures = json.loads(saved.read_text())["signatures"]
    assert list(signatures) == [removed]
    pki.check_removal(fleet_ca.certificate, removed, bytes.fromhex(signatures[removed]))  # kept as hex


def test_removals_saved_under_another_fleets_ca_are_dropped_at_start(
        core: AgentCore, fleet_ca: pki.FleetCa, tmp_path: Path) -> None:
    # The PC joined another fleet since (join keeps its key): the old fleet's removals mean nothing here, and
    # would refuse a PC that fleet removed which joined this one with the same key.
    saved = tmp_path / "state" / "revoked.json"
    saved.parent.mkdir(parents=True)
    ours, theirs = "c" * 52, "d" * 52
    old_fleet = make_ca(tmp_path / "old fleet")
    saved.write_text(json.dumps({"revoked_agent_ids": [ours, theirs], "signatures": {
        ours: pki.sign_removal(fleet_ca, ours).hex(), theirs: pki.sign_removal(old_fleet, theirs).hex()}}))
    agent = AgentCore(core.files, core.settings, core.cache, FakeMonitor(), revocations_file=saved)
    assert agent.revocations().agent_ids == {ours} and list(agent._removal_signatures) == [ours]


def test_removals_the_controller_lacks_are_given_back_to_it(
        core: AgentCore, fleet_ca: pki.FleetCa) -> None:
    kept = [f"{letter}" * 52 for letter in "cdefg"]
    handle(core, Role.CONTROLLER, removals(fleet_ca, *kept))
    registration, survey = RecordingLink(Role.CONTROLLER), RecordingLink(Role.CONTROLLER)
    core._registration_links.add(cast(Link, registration))
    restored = removals(fleet_ca, kept[1], kept[3])  # a data dir restored from a backup older than 3 removals

    async def scenario() -> None:
        await core.handle(cast(Link, survey), restored)
        await core.handle(cast(Link, registration), restored)
        await core.handle(cast(Link, registration), removals(fleet_ca, *kept))  # up to date: nothing to say

    asyncio.run(scenario())
    assert survey.sent == registration.sent[:1]  # a survey (`fleet ls`, `deploy`...) is told them too
    (told,) = registration.sent  # and not again once the list has them
    assert isinstance(told, KnownRemovals) and told.agent_ids == (kept[0], kept[2], kept[4])
    for agent_id, signature in zip(told.agent_ids, told.signatures, strict=True):
        pki.check_removal(fleet_ca.certificate, agent_id, signature)


def test_many_known_removals_are_told_in_messages_of_at_most_the_limit(
        core: AgentCore, fleet_ca: pki.FleetCa) -> None:
    many = sorted(pki.agent_id_for_key(pki.create_private_key().public_key()) for _ in range(MAX_KNOWN_REMOVALS + 3))
    signatures = {agent_id: pki.sign_removal(fleet_ca, agent_id) for agent_id in many}
    handle(core, Role.CONTROLLER, RevocationUpdate.of(many, [signatures[agent_id] for agent_id in many]))
    registration = RecordingLink(Role.CONTROLLER)
    core._registration_links.add(cast(Link, registration))
    asyncio.run(core.handle(cast(Link, registration), removals(fleet_ca)))
    assert [len(cast(KnownRemovals, message).agent_ids) for message in registration.sent] == [MAX_KNOWN_REMOVALS, 3]
    assert [agent_id for message in registration.sent for agent_id in cast(KnownRemovals, message).agent_ids] == many


def test_status_carries_the_measured_speed_and_probes_once(core: AgentCore) -> None:
    from deskfleet.agent.speed_probe import SpeedMeasurement

    probes: list[int] = []

    def probe() -> SpeedMeasurement:
        probes.append(1)
        return SpeedMeasurement("CPU", "test", 21.5, 0.003)

    core._speed_probe = probe
    for _ in range(2):
        report = handle(core, Role.CONTROLLER, StatusRequest())
        assert isinstance(report, StatusReport) and report.weight_gb_per_s == 21.5
    assert probes == [1]


def test_a_status_waits_for_a_slow_speed_probe_only_so_long_and_the_next_has_the_speed(
        core: AgentCore, monkeypatch: pytest.MonkeyPatch) -> None:
    # the first status waited for the whole probe (29 s on a loaded PC), and a survey, which gives up after 5 s,
    # listed the PC as unreachable
    from deskfleet.agent.speed_probe import SpeedMeasurement

    monkeypatch.setattr(core_module, "SPEED_PROBE_WAIT_S", 0.05)
    measured = threading.Event()
    probes: list[int] = []

    def probe() -> SpeedMeasurement:
        probes.append(1)
        measured.wait(10)
        return SpeedMeasurement("CPU", "test", 21.5, 0.003)

    core._speed_probe = probe

    async def two_statuses() -> tuple[Message | None, Message | None]:
        first = await core.handle(cast(Link, FakeLink(Role.CONTROLLER)), StatusRequest())
        measured.set()
        assert core._speed_measuring is not None
        await core._speed_measuring
        return first, await core.handle(cast(Link, FakeLink(Role.CONTROLLER)), StatusRequest())

    first, second = asyncio.run(two_statuses())
    assert isinstance(first, StatusReport) and first.weight_gb_per_s is None
    assert isinstance(second, StatusReport) and second.weight_gb_per_s == 21.5
    assert probes == [1]  # one probe, waited on by both


def test_a_speed_probe_that_fails_for_a_passing_reason_is_tried_again(core: AgentCore) -> None:
    # a MemoryError at start-up was kept in the probe's future and raised by every later status: INTERNAL to every
    # survey until the agent restarted
    from deskfleet.agent.speed_probe import SpeedMeasurement

    tries: list[int] = []

    def probe() -> SpeedMeasurement:
        tries.append(1)
        if len(tries) == 1:
            raise MemoryError
        return SpeedMeasurement("CPU", "test", 21.5, 0.003)

    core._speed_probe = probe

    async def two_statuses() -> tuple[Message | None, Message | None]:
        link = cast(Link, FakeLink(Role.CONTROLLER))
        return await core.handle(link, StatusRequest()), await core.handle(link, StatusRequest())

    first, second = asyncio.run(two_statuses())
    assert isinstance(first, StatusReport) and first.weight_gb_per_s is None
    assert core.last_error is not None and "speed probe failed, to be tried again: MemoryError()" in core.last_error
    assert isinstance(second, StatusReport) and second.weight_gb_per_s == 21.5 and len(tries) == 2


def test_a_failing_speed_probe_reports_no_speed_and_says_why(core: AgentCore) -> None:
    def probe() -> object:
        raise RuntimeError("GPU device not found")

    core._speed_probe = probe  # type: ignore[assignment]
    report = handle(core, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport) and report.weight_gb_per_s is None
    assert core.last_error is not None and "GPU device not found" in core.last_error


def test_status_carries_the_devices_openvino_finds_asked_once(core: AgentCore) -> None:
    from deskfleet.agent.stage import openvino_devices

    probes: list[int] = []

    def probe() -> tuple[str, ...]:
        probes.append(1)
        return openvino_devices()

    core._device_probe = probe
    for _ in range(2):
        report = handle(core, Role.CONTROLLER, StatusRequest())
        assert isinstance(report, StatusReport) and "CPU" in report.devices
    assert probes == [1]


def test_status_carries_the_shard_caches_room_for_new_shards(core: AgentCore) -> None:
    # a plan leaves out a PC whose shard cache has no room for a stage (StatusReport.shard_room_bytes)
    report = handle(core, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport)
    assert report.shard_room_bytes == core.cache.room_for_new_bytes() > 0
    assert report.clock_s is not None and abs(report.clock_s - time.time()) < 60  # its clock, for `fleet ls`
    core.cache.limit_bytes = 1000  # an admin's cache_limit_bytes of 1000 (the cache is empty)
    report = handle(core, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport) and report.shard_room_bytes == 1000


def test_a_status_asked_while_the_devices_are_listed_waits_for_them(core: AgentCore) -> None:
    # at start the mDNS record and a survey ask at once: the second was reported as knowing no devices
    started, release = threading.Event(), threading.Event()

    def probe() -> tuple[str, ...]:
        started.set()
        release.wait(10)
        return ("CPU", "GPU.0")

    core._device_probe = probe

    async def both() -> list[StatusReport]:
        first = asyncio.create_task(core.status())
        await asyncio.to_thread(started.wait, 10)
        second = asyncio.create_task(core.status())
        await asyncio.sleep(0.05)
        release.set()
        return list(await asyncio.gather(first, second))

    assert [report.devices for report in asyncio.run(both())] == [("CPU", "GPU.0")] * 2


@pytest.mark.parametrize(("listed", "why"), [(RuntimeError("plugin failed to load"), "plugin failed to load"),
                                             (("CPU", "GPU,CPU"), "devices must be at most 32 OpenVINO device names")])
def test_devices_that_cannot_be_listed_are_reported_as_not_known(core: AgentCore, listed: object, why: str) -> None:
    # not known: no plan leaves the PC out for them, and the status itself still goes out
    def probe() -> object:
        if isinstance(listed, Exception):
            raise listed
        return listed

    core._device_probe = probe  # type: ignore[assignment]
    report = handle(core, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport) and report.devices == ()
    assert core.last_error is not None and why in core.last_error


def _host_tiny_stage(core: AgentCore, tiny_export: Path, kv_cache: str | None = None, layers: int | None = None,
                     next_hop: NextHop | None = None) -> AssignStage:
    """Push the tiny model's shards to the core and assign it its first `layers` (default: the whole model)."""
    manifest = load_manifest(tiny_export)
    total = manifest.spec.num_layers
    layers = total if layers is None else layers
    names = [MANIFEST_NAME, *(name for stem in manifest.stage_ir_stems(0, layers) for name in manifest.ir_files(stem))]
    entries = []
    for name in names:
        data = (tiny_export / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        handle(core, Role.CONTROLLER, ShardChunk(digest, 0, len(data), data))
        handle(core, Role.CONTROLLER, ShardComplete(digest))
        entries.append(ManifestEntry(name, digest, len(data)))
    assignment = AssignStage(StageRef("tiny@1", 0, layers), True, layers == total, "CPU", Precision.DEVICE_DEFAULT,
                             next_hop, tuple(entries), kv_cache)
    assert isinstance(handle(core, Role.CONTROLLER, assignment), StageReady)
    return assignment


@pytest.mark.parametrize(("kv_cache", "compiled"), [(None, "u8"), ("f32", "f32")])
def test_an_assignment_compiles_with_the_kv_cache_it_names(core: AgentCore, tiny_export: Path, kv_cache: str | None,
                                                           compiled: str) -> None:
    assignment = _host_tiny_stage(core, tiny_export, kv_cache)
    stage = core.stages[assignment.stage].executor.stage
    assert stage.compiled.get_property("KV_CACHE_PRECISION").to_string() == compiled


def test_decode_steps_run_on_the_loop_thread_and_prompts_in_a_worker(core: AgentCore, tiny_export: Path) -> None:
    assignment = _host_tiny_stage(core, tiny_export)
    executor = core.stages[assignment.stage].executor
    ran_on: list[str] = []
    run = executor.run

    def recording_run(message: Forward, return_logits: bool = False) -> object:
        ran_on.append(threading.current_thread().name)
        return run(message, return_logits)

    executor.run = recording_run  # type: ignore[method-assign]
    track = BatchTrack(1, load_manifest(tiny_export).spec.max_context)
    track.add_row(0)
    prompt = list(range(3, 3 + INLINE_STEP_TOKENS + 1))  # one token more than a step that runs inline

    async def scenario() -> tuple[str, list[Message]]:
        driver = RecordingLink(Role.CONTROLLER)
        core._controller_links.append(cast(Link, driver))
        await core.handle(cast(Link, driver), ResultsHere(0, 1 << 62))
        await core.handle(cast(Link, driver), track.step([prompt]))
        first = driver.sent[-1]
        assert isinstance(first, ForwardResult)
        await core.handle(cast(Link, driver), track.step([[first.next_token_ids[0]]]))
        return threading.current_thread().name, driver.sent

    loop_thread, sent = asyncio.run(scenario())
    assert [type(message) for message in sent] == [ForwardResult, ForwardResult]
    assert ran_on[0] != loop_thread and ran_on[1] == loop_thread


def test_prompts_and_host_side_state_edits_do_not_run_inline() -> None:
    track = BatchTrack(1, 4096)
    track.add_row(0)
    prompt = track.step([list(range(3, 3 + INLINE_STEP_TOKENS + 1))])
    decode = track.step([[5]])
    assert not runs_inline(prompt) and runs_inline(decode)
    assert runs_inline(track.step([list(range(3, 3 + INLINE_STEP_TOKENS))]))  # the largest inline step
    compacting = replace(decode, slot_deltas=(Compact(new_slots=1, keep=(((0, 1),),)), *decode.slot_deltas))
    admitting = replace(decode, slot_deltas=(AdmitRow(3), *decode.slot_deltas), admit_from=(9,))
    assert not runs_inline(compacting) and not runs_inline(admitting)


def _pinned_shards_survive_eviction(core: AgentCore, assignment: AssignStage) -> bool:
    core.cache.evict(0)
    return all(core.cache.has(entry.sha256) for entry in assignment.manifest)


def test_a_failed_rebuild_leaves_the_hosted_stage_as_it_was(core: AgentCore, tiny_export: Path) -> None:
    assignment = _host_tiny_stage(core, tiny_export)
    executor = core.stages[assignment.stage].executor
    failing = replace(assignment, device="NOSUCHDEVICE")
    with pytest.raises(CommandError, match="cannot host"):
        handle(core, Role.CONTROLLER, failing)
    assert core.stages[assignment.stage].executor is executor
    assert _pinned_shards_survive_eviction(core, assignment)


def test_the_same_stage_listed_in_another_order_is_not_rebuilt(core: AgentCore, tiny_export: Path) -> None:
    assignment = _host_tiny_stage(core, tiny_export)
    executor = core.stages[assignment.stage].executor
    reordered = replace(assignment, manifest=tuple(reversed(assignment.manifest)))
    assert isinstance(handle(core, Role.CONTROLLER, reordered), StageReady)
    assert core.stages[assignment.stage].executor is executor
    assert _pinned_shards_survive_eviction(core, assignment)


def test_a_rebuild_with_new_settings_replaces_the_stage_and_keeps_its_files(core: AgentCore, tiny_export: Path) -> None:
    assignment = _host_tiny_stage(core, tiny_export)
    old = core.stages[assignment.stage]
    assert isinstance(handle(core, Role.CONTROLLER, replace(assignment, kv_cache="f32")), StageReady)
    new = core.stages[assignment.stage]
    assert new.executor is not old.executor and new.cache_key != old.cache_key
    assert new.executor.stage.compiled.get_property("KV_CACHE_PRECISION").to_string() == "f32"
    assert (core.cache.root / "views" / new.cache_key).is_dir()
    assert not (core.cache.root / "views" / old.cache_key).exists()
    assert _pinned_shards_survive_eviction(core, assignment)


class ScriptedLink(RecordingLink):
    """A recording link that delivers `incoming` in order, then closes."""

    def __init__(self, role: Role, incoming: list[Message]) -> None:
        super().__init__(role)
        self.incoming = list(incoming)

    async def receive(self) -> Message:
        if not self.incoming:
            raise LinkError("closed")
        return self.incoming.pop(0)


def test_a_fault_while_handling_a_message_is_answered_and_the_link_kept(core: AgentCore,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    handle_message = core.handle
    calls = 0

    async def failing_once(link: Link, message: Message) -> Message | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise IndexError("index 1512 is out of bounds")
        return await handle_message(link, message)

    monkeypatch.setattr(core, "handle", failing_once)
    link = ScriptedLink(Role.CONTROLLER, [StatusRequest(), StatusRequest()])
    asyncio.run(core.serve_link(cast(Link, link)))
    assert [type(message) for message in link.sent] == [Error, StatusReport]
    first = link.sent[0]
    assert isinstance(first, Error) and first.code is ErrorCode.INTERNAL and "1512" in first.message
    assert core.last_error is not None and "StatusRequest" in core.last_error


def test_an_unreachable_next_hop_is_named_in_the_error_the_driver_gets(core: AgentCore, tiny_export: Path) -> None:
    # The driver learns which agent is gone even when this stage, not its own link to that agent, tells it
    # first: the failover then leaves the dead agent out of the next plan.
    dead = "c" * 52
    _host_tiny_stage(core, tiny_export, layers=2, next_hop=NextHop("127.0.0.1:9", dead))
    track = BatchTrack(1, load_manifest(tiny_export).spec.max_context)
    track.add_row(0)
    driver = ScriptedLink(Role.CONTROLLER, [track.step([[1, 5, 9]])])
    asyncio.run(core.serve_link(cast(Link, driver)))
    assert len(driver.sent) == 1
    error = driver.sent[0]
    assert isinstance(error, Error) and "is unreachable" in error.message
    assert (error.agent_id, error.micro_batch_id) == (dead, 1)
    # this agent named once, at the start (it was said twice: "agent X: agent X: next hop ...")
    assert error.message.startswith(f"agent {core.agent_id[:12]}: next hop agent {dead[:12]} at 127.0.0.1:9 is "
                                    "unreachable: ") and error.message.count(core.agent_id[:12]) == 1


def test_a_shard_sent_by_two_deploys_at_once_is_taken_from_the_first(core: AgentCore) -> None:
    # Two controllers deploying the same model to this PC interleaved its chunks ("chunk at offset 0 is out of
    # order") and both deploys failed; now the second is told to wait, and the first one's shard arrives whole
    data = bytes(range(256)) * 40
    digest = hashlib.sha256(data).hexdigest()
    first, second = RecordingLink(Role.CONTROLLER), RecordingLink(Role.CONTROLLER, "b" * 52)
    core._links |= {cast(Link, first), cast(Link, second)}

    def send(link: RecordingLink, message: Message) -> Message | None:
        return asyncio.run(core.handle(cast(Link, link), message))

    send(first, ShardChunk(digest, 0, len(data), data[:4000]))
    with pytest.raises(CommandError, match=r"is being received from .*another deploy to this PC") as refused:
        send(second, ShardChunk(digest, 0, len(data), data[:4000]))
    assert refused.value.code is ErrorCode.BUSY
    with pytest.raises(CommandError, match="another deploy"):
        send(second, ShardComplete(digest))
    send(first, ShardChunk(digest, 4000, len(data), data[4000:]))
    send(first, ShardComplete(digest))
    assert core.cache.has(digest)
    other = bytes(range(200)) * 30  # once the first link is gone, another may take up a shard it left half-sent
    other_digest = hashlib.sha256(other).hexdigest()
    send(first, ShardChunk(other_digest, 0, len(other), other[:1000]))
    core._links.discard(cast(Link, first))
    send(second, ShardChunk(other_digest, 1000, len(other), other[1000:]))
    send(second, ShardComplete(other_digest))
    assert core.cache.has(other_digest)


def test_two_drivers_on_one_stage_each_get_their_own_results(core: AgentCore, tiny_export: Path) -> None:
    # One results link per agent: the driver that said ResultsHere last got every driver's results, and the
    # other waited out its step timeout. Now each gets the results of its own range, and only those.
    _host_tiny_stage(core, tiny_export)
    mine, theirs = BatchTrack(5, 64), BatchTrack(1 << 40, 64)
    for track in (mine, theirs):
        track.add_row(0)

    async def scenario() -> tuple[RecordingLink, RecordingLink, RecordingLink]:
        first, second, other = (RecordingLink(Role.CONTROLLER) for _ in range(3))
        core._controller_links += [cast(Link, first), cast(Link, second), cast(Link, other)]  # other spoke last
        await core.handle(cast(Link, first), ResultsHere(0, 1 << 40))
        await core.handle(cast(Link, second), ResultsHere(1 << 40, 1 << 41))  # the later driver
        await core.handle(cast(Link, first), mine.step([[3, 4, 5]]))
        await core.handle(cast(Link, second), theirs.step([[6, 7]]))
        await core._tell_controller(Error(ErrorCode.NOT_ASSIGNED, "paused", micro_batch_id=7))  # a refusal: its own
        await core._tell_controller(Error(ErrorCode.INTERNAL, "the stage failed as a whole"))  # no micro-batch
        await core._tell_controller(ForwardResult((1 << 41) + 3, 0, (1,), None, None))  # a driver gone: dropped
        return first, second, other

    first, second, other = asyncio.run(scenario())
    assert [(type(m), getattr(m, "micro_batch_id", None)) for m in first.sent] == [(ForwardResult, 5), (Error, 7),
                                                                                    (Error, None)]
    assert [(type(m), getattr(m, "micro_batch_id", None)) for m in second.sent] == [(ForwardResult, 1 << 40),
                                                                                     (Error, None)]
    assert other.sent == []


def test_a_first_stages_refused_step_is_answered_to_its_driver_not_sent_down_the_chain(
        core: AgentCore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A deploy reshaped the chain under a running generate: this PC's stage became the first of two, with a new
    # next hop that knew nothing of the run. The run's next step did not fit the new stage, and its error went
    # down the chain to that hop, which passed it to `fleet serve`: the driver waited out its step timeout (120 s).
    relayed: list[Message] = []

    async def send_next(hop: NextHop, message: Message) -> None:
        relayed.append(message)

    monkeypatch.setattr(core, "_send_next", send_next)
    _host_tiny_stage(core, tiny_export, layers=2, next_hop=NextHop("127.0.0.1:9", "c" * 52))
    track = BatchTrack(1, load_manifest(tiny_export).spec.max_context)
    track.add_row(0)
    track.step([[1, 5, 9]])  # the prompt went to the stage this PC hosted before the deploy
    driver = ScriptedLink(Role.CONTROLLER, [track.step([[7]])])
    asyncio.run(core.serve_link(cast(Link, driver)))
    assert relayed == []
    (error,) = driver.sent
    assert isinstance(error, Error) and error.code is ErrorCode.BAD_MESSAGE and error.micro_batch_id == 1
    assert f"agent {core.agent_id[:12]}: micro-batch 1 step 1 failed on " in error.message
    assert error.message.endswith("this stage holds nothing of micro-batch 1, whose step 1 is not its first (the stage "
                                  "was assigned anew, by a deploy or a re-plan, or rebuilt since its earlier steps, "
                                  "or it freed the micro-batch as idle)")


def test_a_refusal_by_the_next_hop_reaches_the_drivers_at_once(core: AgentCore,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A deploy made this stage's next hop a first stage while the old stage here still forwarded the steps in
    # flight: the next hop refused them on the link this agent opened, which nobody read, and the run waited out
    # its 120 s step timeout
    hop = NextHop("127.0.0.1:9", "n" * 52)
    refusal = Error(ErrorCode.UNAUTHORIZED, f"agent {'n' * 12}: Forward refused: this agent's stage takes steps only "
                                            "from the controller")
    class NextHopLink(ScriptedLink):
        async def close(self) -> None:
            pass

    next_hop = NextHopLink(Role.AGENT, [refusal])

    async def open_link(address: str, *args: object, **kwargs: object) -> Link:
        next_hop.address = address
        return cast(Link, next_hop)

    monkeypatch.setattr(core_module, "open_link", open_link)

    async def scenario() -> RecordingLink:
        driver = RecordingLink(Role.CONTROLLER)
        core._controller_links.append(cast(Link, driver))
        await core.handle(cast(Link, driver), ResultsHere(0, 1 << 62))
        await core._send_next(hop, ReleaseMicroBatch(7))
        await core.close()  # after the watcher has read the refusal and the link's close
        return driver

    driver = asyncio.run(scenario())
    (told,) = driver.sent
    assert isinstance(told, Error) and told.code is ErrorCode.UNAUTHORIZED
    assert told.message == (f"agent {core.agent_id[:12]}: next hop agent {'n' * 12} at 127.0.0.1:9 refused this "
                            f"stage's step: {refusal.message}")


def test_a_step_the_pcs_memory_has_no_room_for_is_refused_blaming_this_pc_and_changes_nothing(
        core: AgentCore, tiny_export: Path) -> None:
    # A driver with more streams than planned, or a hostile previous hop claiming thousands of rows, grew a stage's
    # KV cache until the PC swapped or the kernel killed a process, perhaps the employee's own
    from deskfleet.agent.kv_memory_guard import KvMemoryGuard

    assignment = _host_tiny_stage(core, tiny_export)
    spec = load_manifest(tiny_export).spec
    context = spec.max_context
    # a slot of the whole model in its u8 cache: every layer's keys and values, head_dim bytes and a scale and zero
    assert core.stages[assignment.stage].executor.kv_bytes_per_slot == spec.num_layers * 2 * spec.num_kv_heads * (
        spec.head_dim + 8)
    # and a token of a call larger than any its request ran, what the CPU plugin keeps of a first stage's call
    assert core.stages[assignment.stage].executor.scratch_bytes_per_token == math.ceil(
        PREFILL_SCRATCH_FIRST * (spec.hidden_size + spec.intermediate_size))
    free = [8 << 30]
    guard = core.kv_memory
    assert isinstance(guard, KvMemoryGuard)
    guard.free_memory = lambda: (free[0], 16 << 30)
    guard.recheck_s = 0.0

    def decode(micro_batch_id: int, refuse_at: int | None) -> tuple[list[int], list[Message]]:
        track = BatchTrack(micro_batch_id, context)
        track.add_row(0)
        tokens, refusals = [], []
        message = track.step([[1, 5, 9]])
        for step in range(4):
            driver = RecordingLink(Role.CONTROLLER)
            free[0] = guard.floor_bytes + 1 if step == refuse_at else 8 << 30
            asyncio.run(core.handle(cast(Link, driver), ResultsHere(0, 1 << 62)))
            core._controller_links.append(cast(Link, driver))
            asyncio.run(core.handle(cast(Link, driver), message))
            core._controller_links.remove(cast(Link, driver))
            (answer,) = driver.sent
            if isinstance(answer, Error):
                refusals.append(answer)
                free[0] = 8 << 30
                driver.sent.clear()
                core._controller_links.append(cast(Link, driver))
                asyncio.run(core.handle(cast(Link, driver), message))  # the same step again: nothing was changed
                core._controller_links.remove(cast(Link, driver))
                (answer,) = driver.sent
            assert isinstance(answer, ForwardResult)
            tokens.append(answer.next_token_ids[0])
            message = track.step([[answer.next_token_ids[0]]])
        return tokens, refusals

    plain, none = decode(1, refuse_at=None)
    assert none == []
    prompt_refused, (refusal,) = decode(2, refuse_at=0)
    decode_refused, _ = decode(3, refuse_at=2)
    assert prompt_refused == plain and decode_refused == plain
    assert isinstance(refusal, Error) and refusal.code is ErrorCode.OUT_OF_MEMORY and refusal.micro_batch_id == 2
    assert refusal.agent_id == core.agent_id  # the re-plan leaves this PC out
    assert ("micro-batch 2 step 0 (1 rows x 3 slots; a call of 3 tokens) would grow this PC's KV cache and call "
            "buffers by up to") in refusal.message


def test_a_stage_the_agent_lets_go_of_is_freed_at_once(core: AgentCore, tiny_export: Path) -> None:
    # A redeploy or a re-plan releases a stage: its compiled model, weight files and their mappings stayed held
    # until Python's full collection, seldom in a busy agent (the soak walk: 314 -> 835 MB over 8 rebuilds)
    import gc
    import weakref

    first = _host_tiny_stage(core, tiny_export)
    held = weakref.ref(core.stages[first.stage].executor.stage)
    track = BatchTrack(1, load_manifest(tiny_export).spec.max_context)
    track.add_row(0)
    driver = RecordingLink(Role.CONTROLLER)
    core._controller_links.append(cast(Link, driver))
    asyncio.run(core.handle(cast(Link, driver), ResultsHere(0, 1 << 62)))
    asyncio.run(core.handle(cast(Link, driver), track.step([[1, 5, 9]])))  # a micro-batch's KV state held
    assert isinstance(driver.sent[-1], ForwardResult)
    core.stages[first.stage].executor.release(1)  # the run over: its session idle, kept by the stage for the next
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _host_tiny_stage(core, tiny_export, layers=2)  # the model re-planned: this PC's stage replaced
        assert first.stage not in core.stages and held() is None
    finally:
        if was_enabled:
            gc.enable()


def test_a_released_stage_has_the_plugin_free_its_call_buffers_once_no_step_runs(
        core: AgentCore, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the CPU plugin did not free a request's buffers with the compiled model: an agent whose stage a failover moved
    # kept each released stage's largest call (+40 MB a cycle on the demo target; 630 MB over a soak's 4 failovers)
    from deskfleet.agent.stage import Stage

    freed: list[tuple[int, int]] = []
    monkeypatch.setattr(Stage, "release_memory", lambda stage: freed.append((stage.layers.start, stage.layers.stop)))
    first = _host_tiny_stage(core, tiny_export)

    async def released(step_running: bool) -> list[tuple[int, int]]:
        hosted = core.stages[first.stage]
        if not step_running:
            core._release(first.stage)
            await asyncio.sleep(0.01)
            return freed
        before = list(freed)
        async with hosted.lock:  # a prompt's step in a worker thread
            core._release(first.stage)
            await asyncio.sleep(0.01)
            assert freed == before  # not while the step runs: the plugin refuses then
        await asyncio.sleep(0.01)
        return freed

    assert asyncio.run(released(step_running=False)) == [(0, 4)]
    first = _host_tiny_stage(core, tiny_export)
    assert asyncio.run(released(step_running=True)) == [(0, 4), (0, 4)]

    def refused(stage: Stage) -> None:
        raise RuntimeError("infer requests are running")

    monkeypatch.setattr(Stage, "release_memory", refused)
    first = _host_tiny_stage(core, tiny_export)
    with caplog.at_level(logging.WARNING, logger="deskfleet.agent.core"):
        asyncio.run(released(step_running=False))
    assert first.stage not in core.stages  # released all the same: only the memory stays with the process
    assert "could not free the call buffers of released" in caplog.text


@pytest.mark.parametrize("normally", [True, False])
def test_a_driver_link_closed_at_the_end_of_its_run_is_not_logged_at_info(
        core: AgentCore, caplog: pytest.LogCaptureFixture, normally: bool) -> None:
    class ClosingLink(RecordingLink):
        async def receive(self) -> Message:
            raise LinkError("link to controller cccccccccccc closed: received 1000 (OK)", closed_normally=normally)

    with caplog.at_level(logging.DEBUG, logger="deskfleet.agent.core"):
        asyncio.run(core.serve_link(cast(Link, ClosingLink(Role.CONTROLLER))))
    (record,) = [record for record in caplog.records if "closed: received" in record.getMessage()]
    assert record.levelno == (logging.DEBUG if normally else logging.INFO)


def test_the_kv_bytes_the_guard_counts_follow_the_stage_s_cache_precision_and_layers(tiny_export: Path) -> None:
    from deskfleet.agent.core import kv_bytes_per_slot

    spec = load_manifest(tiny_export).spec
    per_head = spec.num_kv_heads * spec.head_dim  # keys and values: twice this a token and layer

    def assignment(device: str, precision: Precision, kv_cache: str | None, layers: int) -> AssignStage:
        return AssignStage(StageRef("tiny@1", 0, layers), True, layers == spec.num_layers, device, precision, None,
                           (), kv_cache)

    assert kv_bytes_per_slot(assignment("CPU", Precision.DEVICE_DEFAULT, None, 2), spec) == \
        2 * 2 * spec.num_kv_heads * (spec.head_dim + 8)  # u8 with a scale and zero point
    assert kv_bytes_per_slot(assignment("CPU", Precision.F32, None, 1), spec) == 2 * per_head * 4
    # a GPU's own precision is f16: counted as f32, its steps were refused at half the memory they needed
    assert kv_bytes_per_slot(assignment("GPU", Precision.DEVICE_DEFAULT, None, 1), spec) == 2 * per_head * 2
    assert kv_bytes_per_slot(assignment("GPU", Precision.DEVICE_DEFAULT, "f32", 3), spec) == 3 * 2 * per_head * 4
