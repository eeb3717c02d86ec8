"""A stage takes steps and relayed Errors only from its rightful previous hop, and checks a relayed Error's blame.

Any holder of a fleet-signed agent certificate can open a link to any agent. Before, such a stranger's
Forward ran on the stage as if it came from the previous stage (hidden states injected into another PC's
chain) and its Error was relayed to the driver with the blame it named (a healthy PC left out of the next
plan). Now a stage takes Forward, ReleaseMicroBatch and Error only from the agent AssignStage.previous_agent_id
names (the controller for a first stage), answers anyone else with Error(UNAUTHORIZED) naming both, logs that
once, and leaves the rightful chain's state as it was; a blame its previous hop cannot know is dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest

from deskfleet.agent.core import AgentCore, CommandError, HostedStage
from deskfleet.agent.link import Link, LinkError
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common import pki
from deskfleet.common.kv_ledger import AppendSlots
from deskfleet.common.model_spec import MANIFEST_NAME, load_manifest
from deskfleet.common.wire import (
    AssignStage,
    Error,
    ErrorCode,
    Forward,
    ForwardResult,
    ManifestEntry,
    Message,
    NextHop,
    Precision,
    ReleaseMicroBatch,
    ReleaseStage,
    ResultsHere,
    Role,
    ShardChunk,
    ShardComplete,
    StageReady,
    StageRef,
    StatusRequest,
)
from deskfleet.controller.batch_track import BatchTrack
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import FAR_FUTURE, make_ca, make_member
from tests.log_records import records_of

PREVIOUS = "b" * 52  # the agent hosting the stage before: the rightful previous hop
STRANGER = "s" * 52  # another enrolled PC, in no chain with this one
NEXT = "n" * 52  # the agent hosting the stage after
UPSTREAM = "u" * 52  # an agent earlier in the chain than the previous hop: unknown to this stage


class FakeLink:
    """One served link: delivers `incoming` in order, then closes; keeps what the core sends and any refusal."""

    def __init__(self, role: Role, agent_id: str, incoming: list[Message] | None = None) -> None:
        self.peer = pki.PeerIdentity(agent_id, role, "0" * 64, FAR_FUTURE)
        self.incoming = list(incoming or [])
        self.sent: list[Message] = []
        self.refused: str | None = None
        self.large_frames = False  # whether the core let it carry frames past link.SMALL_FRAME_BYTES

    def take_large_frames(self) -> None:
        self.large_frames = True

    def take_small_frames(self) -> None:
        self.large_frames = False

    def describe(self) -> str:
        return f"{self.peer.role.value} {self.peer.agent_id[:12]}"

    async def receive(self) -> Message:
        if not self.incoming or self.refused is not None:
            raise LinkError("closed")
        return self.incoming.pop(0)

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    async def refuse(self, code: ErrorCode, text: str) -> None:
        self.refused = f"{code.value}: {text}"


def make_core(tmp_path: Path, name: str) -> AgentCore:
    ca = make_ca(tmp_path / "ca")
    files = make_member(ca, tmp_path / name, "agent")
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    return AgentCore(files, settings, ShardCache(tmp_path / f"{name}-cache", 1 << 30), FakeMonitor())


def command(core: AgentCore, message: Message) -> Message | None:
    return asyncio.run(core.handle(cast(Link, FakeLink(Role.CONTROLLER, "c" * 52)), message))


def host(core: AgentCore, export: Path, start: int, end: int, previous: str | None) -> AssignStage:
    """Push layers [start, end) of the export to `core` and assign them (f32), fed by `previous`."""
    manifest = load_manifest(export)
    names = [MANIFEST_NAME, *(name for stem in manifest.stage_ir_stems(start, end) for name in manifest.ir_files(stem))]
    entries = []
    for name in names:
        data = (export / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        command(core, ShardChunk(digest, 0, len(data), data))
        command(core, ShardComplete(digest))
        entries.append(ManifestEntry(name, digest, len(data)))
    assignment = AssignStage(StageRef("tiny@1", start, end), start == 0, end == manifest.spec.num_layers, "CPU",
                             Precision.F32, None, tuple(entries), None, previous)
    assert isinstance(command(core, assignment), StageReady)
    return assignment


def fake_stage(core: AgentCore, model_id: str, previous: str | None, next_hop: str | None = None) -> AssignStage:
    """A stage that is never run (Errors and refusals only): layers [1, 2) of `model_id`."""
    hop = NextHop("127.0.0.1:9", next_hop) if next_hop is not None else None
    assignment = AssignStage(StageRef(model_id, 1, 2), previous is None, next_hop is None, "CPU", Precision.F32,
                             hop, (), None, previous)
    core.stages[assignment.stage] = HostedStage(assignment, cast(StageExecutor, None), asyncio.Lock(),
                                                f"{model_id}-1-2")
    return assignment


def hidden_step(micro_batch_id: int, model_id: str = "", hidden: int = 8) -> Forward:
    return Forward(micro_batch_id, 0, (0,), (AppendSlots(1, (1,), (0,)),), np.zeros(1, np.int64),
                   np.zeros((1, 1), np.int64), None, np.ones((1, 1, hidden), np.float32), None, layer_start=1,
                   model_id=model_id)


def test_a_strangers_forward_is_refused_and_the_previous_hops_next_step_still_runs(
        tmp_path: Path, tiny_export: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, last = make_core(tmp_path, "first"), make_core(tmp_path, "last")
    head = host(first, tiny_export, 0, 2, None)
    host(last, tiny_export, 2, 4, PREVIOUS)
    run_first = first.stages[head.stage].executor.run
    max_context = load_manifest(tiny_export).spec.max_context
    attacked, clean = BatchTrack(1, max_context), BatchTrack(2, max_context)  # the same stream, twice
    for track in (attacked, clean):
        track.add_row(0)
    driver = FakeLink(Role.CONTROLLER, "c" * 52)
    previous = FakeLink(Role.AGENT, PREVIOUS)

    async def step(track: BatchTrack, tokens: list[int]) -> Forward:
        output = run_first(track.step([tokens]))
        assert isinstance(output, Forward)
        return output

    async def scenario() -> tuple[dict[int, list[int]], list[FakeLink]]:
        last._controller_links.append(cast(Link, driver))
        await last.handle(cast(Link, driver), ResultsHere(0, 1 << 62))
        tokens: dict[int, list[int]] = {1: [], 2: []}
        strangers = []
        for index in range(4):
            for track in (attacked, clean):
                hidden = await step(track, tokens[track.micro_batch_id][-1:] or [1, 7, 9, 3])
                if track is attacked and index in (1, 2):
                    # the stranger sends the very step the previous hop is about to send, or frees the
                    # micro-batch: taken, either would have changed the stage's KV state (and the first sent the
                    # driver a result), and the previous hop's own step would have been refused as a desync
                    incoming: list[Message] = [hidden, Error(ErrorCode.INTERNAL, "down", agent_id=PREVIOUS)] \
                        if index == 1 else [ReleaseMicroBatch(1)]
                    stranger = FakeLink(Role.AGENT, STRANGER, incoming)
                    before = len(driver.sent)
                    await last.serve_link(cast(Link, stranger))
                    strangers.append(stranger)
                    assert len(driver.sent) == before  # nothing reached the driver
                await last.handle(cast(Link, previous), hidden)
                result = driver.sent[-1]
                assert isinstance(result, ForwardResult), result
                tokens[track.micro_batch_id].append(result.next_token_ids[0])
        return tokens, strangers

    with caplog.at_level(logging.WARNING, logger="deskfleet.agent.core"):
        tokens, strangers = asyncio.run(scenario())
    assert tokens[1] == tokens[2] and len(tokens[1]) == 4  # the stage ran exactly the rightful steps
    assert [type(message) for message in driver.sent] == [ForwardResult] * 8
    for stranger in strangers:
        assert stranger.refused is not None and stranger.refused.startswith("unauthorized: ")
        assert f"agent {STRANGER[:12]}" in stranger.refused and f"from agent {PREVIOUS[:12]}" in stranger.refused
    assert strangers[0].incoming == [Error(ErrorCode.INTERNAL, "down", agent_id=PREVIOUS)]  # link closed: unread
    logged = [record for record in caplog.records if STRANGER[:12] in record.getMessage()]
    assert len(logged) == 1, [record.getMessage() for record in logged]  # logged once, not per attempt
    assert last.last_error is not None and "previous hop of none" in last.last_error


def test_a_stage_after_the_first_takes_no_step_from_a_controller(tmp_path: Path) -> None:
    core = make_core(tmp_path, "agent")
    fake_stage(core, "m@1", PREVIOUS)
    with pytest.raises(CommandError, match=r"controller c{12} is the previous hop of none") as refused:
        command(core, hidden_step(3, "m@1"))
    assert refused.value.code is ErrorCode.UNAUTHORIZED


def test_the_previous_hop_of_one_stage_is_refused_on_another_and_its_link_kept(tmp_path: Path) -> None:
    # One PC holds stages of two models; the agent before its stage of model m sends a step of model n, whose
    # previous hop is another agent: refused to that agent alone, the link (its rightful model's) left open.
    core = make_core(tmp_path, "agent")
    fake_stage(core, "m@1", PREVIOUS)
    fake_stage(core, "n@1", UPSTREAM)
    driver = FakeLink(Role.CONTROLLER, "c" * 52)
    previous = FakeLink(Role.AGENT, PREVIOUS, [hidden_step(4, "n@1"), hidden_step(5, "n@1")])

    async def scenario() -> None:
        core._controller_links.append(cast(Link, driver))
        await core.handle(cast(Link, driver), ResultsHere(0, 1 << 62))
        await core.serve_link(cast(Link, previous))

    asyncio.run(scenario())
    assert previous.refused is None and driver.sent == []
    assert [(type(m), m.code, m.micro_batch_id) for m in previous.sent if isinstance(m, Error)] == [
        (Error, ErrorCode.UNAUTHORIZED, 4), (Error, ErrorCode.UNAUTHORIZED, 5)]
    assert isinstance(previous.sent[0], Error)
    assert f"from agent {UPSTREAM[:12]}" in previous.sent[0].message and "n_1-1-2" in previous.sent[0].message


def relay(core: AgentCore, sender: str, message: Message, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[list[Message], FakeLink]:
    """Serve a link from `sender` that brings `message`; what the stage sent on to its next hop, and the link."""
    onward: list[Message] = []

    async def send_next(hop: NextHop, message: Message) -> None:
        assert hop.agent_id == NEXT
        onward.append(message)

    monkeypatch.setattr(core, "_send_next", send_next)
    link = FakeLink(Role.AGENT, sender, [message])
    asyncio.run(core.serve_link(cast(Link, link)))
    return onward, link


@pytest.mark.parametrize(("blamed", "relayed_blame"), [
    (None, None),
    (PREVIOUS, PREVIOUS),  # the sender about itself
    (UPSTREAM, UPSTREAM),  # an earlier stage's error the sender relayed: not known here, the driver checks it
    ("self", None),  # this agent: it is reading the error, so reachable and hosting
    (NEXT, None),  # this stage's next hop: the previous hop knows nothing of it
])
def test_a_relayed_blame_is_kept_only_where_the_previous_hop_can_know_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blamed: str | None, relayed_blame: str | None) -> None:
    core = make_core(tmp_path, "agent")
    fake_stage(core, "m@1", PREVIOUS, NEXT)
    blamed = core.agent_id if blamed == "self" else blamed
    onward, link = relay(core, PREVIOUS, Error(ErrorCode.INTERNAL, "stage 0 failed", 7, blamed), monkeypatch)
    assert link.refused is None and len(onward) == 1
    error = onward[0]
    assert isinstance(error, Error) and (error.code, error.micro_batch_id) == (ErrorCode.INTERNAL, 7)
    assert error.agent_id == relayed_blame
    assert error.message.startswith("stage 0 failed")
    if blamed is not None and relayed_blame is None:
        assert f"dropped the blame of agent {blamed[:12]}" in error.message
        assert core.last_error is not None and "dropped the blame" in core.last_error


def test_a_strangers_error_is_refused_and_relayed_to_no_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core(tmp_path, "agent")
    fake_stage(core, "m@1", PREVIOUS, NEXT)
    driver = FakeLink(Role.CONTROLLER, "c" * 52)
    core._controller_links.append(cast(Link, driver))
    onward, link = relay(core, STRANGER, Error(ErrorCode.INTERNAL, "the previous hop died", agent_id=PREVIOUS),
                         monkeypatch)
    assert onward == [] and driver.sent == []
    assert link.refused is not None and link.refused.startswith("unauthorized: ")
    assert f"agent {STRANGER[:12]}" in link.refused and f"from agent {PREVIOUS[:12]}" in link.refused


def test_an_agent_hosting_no_stage_relays_no_error(tmp_path: Path) -> None:
    core = make_core(tmp_path, "agent")
    driver = FakeLink(Role.CONTROLLER, "c" * 52)
    core._controller_links.append(cast(Link, driver))
    link = FakeLink(Role.AGENT, STRANGER, [Error(ErrorCode.INTERNAL, "gone", agent_id=PREVIOUS)])
    asyncio.run(core.serve_link(cast(Link, link)))
    assert driver.sent == [] and link.refused is not None and "hosts no stage" in link.refused


def test_steps_an_agent_sends_a_pc_hosting_no_stage_are_each_answered_and_logged_once_a_minute(
        tmp_path: Path) -> None:
    # any enrolled PC could send Forwards to a PC hosting no stage as fast as it liked: each wrote a warning here
    core = make_core(tmp_path, "agent")
    driver = FakeLink(Role.CONTROLLER, "c" * 52)
    core._controller_links.append(cast(Link, driver))
    link = FakeLink(Role.AGENT, STRANGER, [hidden_step(micro_batch_id) for micro_batch_id in range(5)])
    with records_of("deskfleet.agent.core", logging.DEBUG) as logged:
        asyncio.run(core.serve_link(cast(Link, link)))
    assert link.refused is None
    assert [(error.code, error.micro_batch_id) for error in driver.sent if isinstance(error, Error)] == \
        [(ErrorCode.NOT_ASSIGNED, micro_batch_id) for micro_batch_id in range(5)]  # the driver hears each
    lines = [record for record in logged.records if "hosts no stage" in record.getMessage()]
    assert [record.levelno for record in lines] == [logging.WARNING] + [logging.DEBUG] * 4
    assert core.last_error is not None and "hosts no stage" in core.last_error


@pytest.mark.parametrize("sender", [STRANGER, PREVIOUS])
@pytest.mark.parametrize("next_hop", [NEXT, None])
def test_what_only_the_controller_sends_is_refused_to_an_agent_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sender: str, next_hop: str | None) -> None:
    # A walk's rogue PC sent a StatusRequest to a serving stage every 0.2 s: the refusal ("only the controller may
    # send StatusRequest") went down the chain naming no micro-batch, every driver read it as a broken chain, and a
    # 400-prompt `generate --fleet` re-planned twice onto the same PC and ended.
    core = make_core(tmp_path, "agent")
    fake_stage(core, "m@1", PREVIOUS, next_hop)
    driver = FakeLink(Role.CONTROLLER, "c" * 52)
    core._controller_links.append(cast(Link, driver))
    onward, link = relay(core, sender, StatusRequest(), monkeypatch)
    assert onward == [] and driver.sent == []
    assert link.refused is not None and link.refused.startswith("unauthorized: ")
    assert "only the controller may send StatusRequest" in link.refused


def test_an_error_relayed_by_the_previous_hop_that_fails_here_still_goes_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the rightful previous hop relays Errors: one that failed here must reach the driver, not close that hop's link
    core = make_core(tmp_path, "agent")
    fake_stage(core, "m@1", PREVIOUS, NEXT)

    def fails(*args: object) -> Error:
        raise RuntimeError("a fault of ours")

    monkeypatch.setattr(core, "_checked_blame", fails)
    onward, link = relay(core, PREVIOUS, Error(ErrorCode.INTERNAL, "stage 0 failed"), monkeypatch)
    assert link.refused is None
    (sent,) = onward
    assert isinstance(sent, Error) and "a fault of ours" in sent.message


def test_what_a_closed_link_sent_before_it_closed_is_still_read(tmp_path: Path, tiny_export: Path) -> None:
    # a deploy stopped by Ctrl-C while this agent compiled its stage asked it to release the stage, then closed the
    # link: the StageReady the agent answered could not be sent, it stopped reading, and the stage stayed, unused
    class ClosedLink(FakeLink):
        async def send(self, message: Message) -> None:
            raise LinkError("link to controller cccccccccccc closed: the peer went away")

    core = make_core(tmp_path, "agent")
    layers = load_manifest(tiny_export).spec.num_layers
    assignment = host(core, tiny_export, 0, layers, None)
    assert core.stages
    link = ClosedLink(Role.CONTROLLER, "c" * 52, [StatusRequest(), ReleaseStage(assignment.stage)])
    asyncio.run(core.serve_link(cast(Link, link)))
    assert not core.stages


def test_a_pc_refused_again_and_again_is_logged_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # a walk's rogue PC, refused and reconnecting, wrote 1,344 warning lines in 24 s
    core = make_core(tmp_path, "agent")
    fake_stage(core, "m@1", PREVIOUS, None)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            relay(core, STRANGER, StatusRequest(), monkeypatch)
    assert len([record for record in caplog.records if "StatusRequest from" in record.getMessage()]) == 1


def test_a_next_hop_that_acknowledges_nothing_is_given_up_and_not_dialled_again_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A firewall cut an established hop mid-run: the send waited on a peer that acknowledged nothing, for good (the
    # keepalive waits on the same full buffer), and each queued step then dialled the hop anew (two 10 s dials), so
    # the run stalled 6 minutes and failed without naming the link.
    from deskfleet.agent import core as core_module

    class StalledLink(FakeLink):
        closed = False

        async def send(self, message: Message) -> None:
            await asyncio.Event().wait()  # the peer's window never opens

        async def close(self) -> None:
            StalledLink.closed = True

    dials: list[str] = []

    async def dial(address: str, *args: object, **kwargs: object) -> StalledLink:
        dials.append(address)
        return StalledLink(Role.AGENT, NEXT)

    monkeypatch.setattr(core_module, "open_link", dial)
    monkeypatch.setattr(core_module, "HOP_SEND_TIMEOUT_S", 0.2)
    core = make_core(tmp_path, "agent")
    hop = NextHop("10.0.0.9:7431", NEXT)

    async def scenario() -> list[str]:
        said = []
        for _ in range(3):  # the stalled step, then two queued behind it
            with pytest.raises(CommandError) as refused:
                await core._send_next(hop, ReleaseMicroBatch(7))
            said.append(str(refused.value))
            assert refused.value.agent_id == NEXT
        await core.close()
        return said

    said = asyncio.run(scenario())
    assert "made no progress in 0 s" in said[0] and "a firewall or a network fault between the two PCs?" in said[0]
    assert said[1] == said[2] == said[0]  # the queued ones told at once, from what the first found
    assert len(dials) == 2 and StalledLink.closed  # the stalled link given up, dialled once more, then not again


def test_a_report_no_controller_link_takes_is_said_in_words(tmp_path: Path) -> None:
    # "no controller link for ForwardResult": internal names, no cause, no action
    core = make_core(tmp_path, "agent")
    asyncio.run(core._tell_controller(Error(ErrorCode.INTERNAL, "stage failed", micro_batch_id=5)))
    assert core.last_error == ("dropped an error report of micro-batch 5: no link to a controller is open to take it "
                               "(the run it belonged to has ended or moved on, e.g. while this PC did not answer); "
                               "nothing to do")


def test_a_stopping_agent_gives_up_a_step_stuck_dialling_its_next_hop(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # an agent stuck dialling an unreachable next hop (10 s a dial, a step after another) ignored SIGTERM for minutes
    from deskfleet.agent import core as core_module

    async def hangs(*args: object, **kwargs: object) -> Link:
        await asyncio.Event().wait()
        raise AssertionError("never")

    monkeypatch.setattr(core_module, "open_link", hangs)
    core = make_core(tmp_path, "agent")

    async def scenario() -> float:
        stuck = asyncio.create_task(core._send_next(NextHop("10.0.0.9:7431", NEXT), ReleaseMicroBatch(7)))
        await asyncio.sleep(0.1)
        began = time.monotonic()
        await core.close()
        with pytest.raises(CommandError, match="this agent is stopping"):
            await asyncio.wait_for(stuck, 5)
        return time.monotonic() - began

    assert asyncio.run(scenario()) < 2


def test_a_next_hop_link_a_stopping_agent_cut_a_step_short_on_is_closed_and_the_stop_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # From an exploratory test: an agent stopped mid-run hung for good (2-3 of 5 SIGINTs, either loop). The step's
    # send, cut short by the stop, dropped its link from the map without closing it; close() closed only the map's
    # links, and waited on the watcher that read the open one (its peer answered the pings).
    from deskfleet.agent import core as core_module

    class LiveLink(FakeLink):
        def __init__(self, role: Role, agent_id: str) -> None:
            super().__init__(role, agent_id)
            self.gone = asyncio.Event()

        async def receive(self) -> Message:
            await self.gone.wait()  # a live peer says nothing back until the link closes
            raise LinkError("closed")

        async def send(self, message: Message) -> None:
            await asyncio.Event().wait()  # a large step still going out as the stop begins

        async def close(self) -> None:
            self.gone.set()

    opened: list[LiveLink] = []

    async def dial(address: str, *args: object, **kwargs: object) -> LiveLink:
        opened.append(LiveLink(Role.AGENT, NEXT))
        return opened[-1]

    monkeypatch.setattr(core_module, "open_link", dial)
    monkeypatch.setattr(core_module, "HOP_WATCHERS_CLOSE_S", 30.0)  # the stop must end by the link's closing
    core = make_core(tmp_path, "agent")

    async def scenario() -> float:
        step = asyncio.create_task(core._send_next(NextHop("10.0.0.9:7431", NEXT), ReleaseMicroBatch(7)))
        await asyncio.sleep(0.1)
        core.begin_closing()  # as the service stops: the step gives up before close() runs
        with pytest.raises(CommandError, match="this agent is stopping") as refused:
            await asyncio.wait_for(step, 5)
        assert refused.value.agent_id == core.agent_id  # this PC is going: its healthy next hop was blamed
        began = time.monotonic()
        await asyncio.wait_for(core.close(), 10)
        return time.monotonic() - began

    assert asyncio.run(scenario()) < 2
    assert len(opened) == 1 and opened[0].gone.is_set()


def test_a_next_hop_watcher_that_outlives_its_links_close_does_not_hold_the_agents_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deskfleet.agent import core as core_module

    monkeypatch.setattr(core_module, "HOP_WATCHERS_CLOSE_S", 0.2)
    core = make_core(tmp_path, "agent")

    async def scenario() -> None:
        watcher = asyncio.create_task(asyncio.Event().wait())  # a link some bug left open
        core._hop_watchers.add(watcher)
        with records_of("deskfleet.agent.core", logging.WARNING) as records:
            await asyncio.wait_for(core.close(), 5)
        assert watcher.cancelled()
        assert records.messages() == ["a next hop's link was still open as the agent stopped: its watcher is "
                                      "cancelled"]

    asyncio.run(scenario())


@pytest.mark.parametrize(("closed_here", "own_address_gone"), [(False, False), (True, False), (False, True)])
def test_a_next_hop_link_that_dies_under_steps_is_reported_to_their_drivers(tmp_path: Path, closed_here: bool,
                                                                              own_address_gone: bool) -> None:
    # A firewall cut the hop mid-run; the steps had fitted in the send buffer, so no send failed: the link died by
    # its keepalive without a word, the run waited out its 120 s step timeout, re-planned onto the same chain, and
    # only a second re-plan found the link (netns walk: 143 s to go on).
    class Holding:
        def micro_batch_ids(self) -> list[int]:
            return [3, 4]

    core = make_core(tmp_path, "agent")
    assignment = AssignStage(StageRef("m@1", 1, 2), False, False, "CPU", Precision.F32, NextHop("10.0.0.9:7431", NEXT),
                             (), None, PREVIOUS)
    core.stages[assignment.stage] = HostedStage(assignment, cast(StageExecutor, Holding()), asyncio.Lock(), "m-1-2")
    driver = FakeLink(Role.CONTROLLER, "c" * 52)
    core._controller_links.append(cast(Link, driver))
    dead = FakeLink(Role.AGENT, NEXT)  # its receive fails at once: the link closed
    dead.address = "10.0.0.9:7431"  # where it was opened
    if own_address_gone:  # this PC's address went under the link (a renewed lease): its next hop was blamed
        async def receive() -> Message:
            raise LinkError("closed", own_address_gone="10.0.0.4")

        dead.receive = receive  # type: ignore[method-assign]
    if not closed_here:
        core._next_hops[NEXT] = cast(Link, dead)
    asyncio.run(core._watch_next_hop(assignment.next_hop, cast(Link, dead)))  # type: ignore[arg-type]
    if closed_here:  # a stage released or re-planned: this agent closed it, nobody is told
        assert driver.sent == []
        return
    if own_address_gone:
        assert [(error.micro_batch_id, error.agent_id) for error in driver.sent] == [(3, None), (4, None)]  # type: ignore[attr-defined]
        assert all("died with steps in flight as this PC lost its address 10.0.0.4" in error.message
                   for error in driver.sent)  # type: ignore[attr-defined]
        return
    assert [(error.micro_batch_id, error.agent_id) for error in driver.sent] == [(3, NEXT), (4, NEXT)]  # type: ignore[attr-defined]
    assert all("next hop agent nnnnnnnnnnnn at 10.0.0.9:7431 is unreachable: the link to it died with steps in "
               "flight" in error.message for error in driver.sent)  # type: ignore[attr-defined]
    assert NEXT not in core._next_hops  # the next step dials it anew


def test_an_assignment_lets_its_previous_hops_open_links_carry_hidden_states(tmp_path: Path,
                                                                              tiny_export: Path) -> None:
    # a link opened before the stage that it feeds was assigned reads small frames (link.SMALL_FRAME_BYTES): the
    # assignment, built or only given new neighbours, widens the links of its previous hop and of no other PC
    core = make_core(tmp_path, "agent")
    early, other = FakeLink(Role.AGENT, PREVIOUS), FakeLink(Role.AGENT, STRANGER)
    core._links.update({cast(Link, early), cast(Link, other)})
    assignment = host(core, tiny_export, 2, 4, PREVIOUS)  # built
    assert early.large_frames and not other.large_frames
    assert isinstance(command(core, replace(assignment, previous_agent_id=STRANGER)), StageReady)  # new neighbours
    assert other.large_frames and not early.large_frames  # the hop before it moved: the old one's link narrowed


class _HopLink:
    """An open next-hop link that answers a ping, or does not (a link waiting out TCP's back-off after a drop)."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.pinged = self.closed = False
        self.peer = SimpleNamespace(agent_id=NEXT)

    async def answers_within(self, seconds: float) -> bool:
        self.pinged = True
        return self.answers

    def sending(self) -> bool:
        return False

    async def close(self) -> None:
        self.closed = True

    def describe(self) -> str:
        return f"agent {NEXT[:12]}"


@pytest.mark.parametrize("answers", [True, False])
def test_a_stage_assigned_again_keeps_its_next_hop_link_only_if_it_answers_a_ping(tmp_path: Path,
                                                                                   answers: bool) -> None:
    # a re-plan onto the same chain kept the link opened before a network drop, still waiting out TCP's back-off:
    # its keepalive closed it seconds into the new chain's run, a second failover (from an exploratory test of blips)
    core = make_core(tmp_path, "agent")
    assignment = fake_stage(core, "tiny@1", PREVIOUS, NEXT)
    hop_link = _HopLink(answers)
    core._next_hops[NEXT] = cast(Link, hop_link)
    assert isinstance(command(core, assignment), StageReady)  # the re-plan's assignment: the same stage
    assert hop_link.pinged
    assert (core._next_hops.get(NEXT) is hop_link) is answers and hop_link.closed is not answers


def test_a_next_hop_link_still_sending_is_kept_unpinged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # another driver's hidden states in its buffer would queue the pong behind them: a healthy link was dropped
    core = make_core(tmp_path, "agent")
    assignment = fake_stage(core, "tiny@1", PREVIOUS, NEXT)
    hop_link = _HopLink(answers=False)
    monkeypatch.setattr(hop_link, "sending", lambda: True)
    core._next_hops[NEXT] = cast(Link, hop_link)
    assert isinstance(command(core, assignment), StageReady)
    assert not hop_link.pinged and core._next_hops.get(NEXT) is hop_link
