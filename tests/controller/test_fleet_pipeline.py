"""FleetPipeline against a scripted last-stage agent over the real TLS transport: results it has no step in
flight for (another driver's, or a duplicate) are dropped, never handed to the engine."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deskfleet.agent.link import Link, LinkError, start_server
from deskfleet.common.kv_ledger import AppendSlots
from deskfleet.common.stop_signal import Stopped, StopSignal
from deskfleet.common.wire import Error, ErrorCode, Forward, ForwardResult, Message, ResultsHere, Role
from deskfleet.controller import fleet_pipeline
from deskfleet.controller.fleet_deploy import StagePlacement
from deskfleet.controller.fleet_pipeline import ChainError, FleetPipeline
from tests.fleet_pki import make_ca, make_member
from tests.ports import free_address

Reply = Callable[[Link, Forward], Awaitable[None]]
SEEN: list[Message] = []  # what the scripted agent of the test running received, in order


@pytest.fixture
def scripted_chain(tmp_path: Path) -> Iterator[Callable[..., FleetPipeline]]:
    """A one-stage chain whose agent answers every Forward with `reply` (and the chain's other options); the server
    runs in a thread."""
    ca = make_ca(tmp_path / "ca")
    agent_files = make_member(ca, tmp_path / "agent", "agent")
    driver_files = make_member(ca, tmp_path / "driver", "driver", Role.CONTROLLER)
    chains: list[FleetPipeline] = []
    stop = threading.Event()
    SEEN.clear()

    def open_chain(reply: Reply, **options: Any) -> FleetPipeline:
        started = threading.Event()
        ports: list[int] = []

        async def handler(link: Link) -> None:
            try:
                while True:
                    message = await link.receive()
                    SEEN.append(message)
                    if isinstance(message, Forward):
                        await reply(link, message)
            except LinkError:
                return

        async def serve() -> None:
            async with await start_server(handler, "127.0.0.1", 0, agent_files) as server:
                ports.append(server.sockets[0].getsockname()[1])
                started.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)

        threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
        assert started.wait(10)
        placement = StagePlacement(agent_files.own_identity().agent_id, f"127.0.0.1:{ports[0]}", 0, 4)
        chain = FleetPipeline([placement], driver_files, step_timeout_s=5, **options)
        chains.append(chain)
        return chain

    yield open_chain
    for chain in chains:
        chain.close()
    stop.set()


def one_step(micro_batch_id: int = 0, step_id: int = 0) -> Forward:
    return Forward(micro_batch_id, step_id, (0,), (AppendSlots(1, (1,), (0,)),), np.zeros(1, np.int64),
                   np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64), None, None)


def test_another_drivers_result_is_dropped_and_ours_still_arrives(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    async def reply(link: Link, message: Forward) -> None:
        await link.send(ForwardResult(5, 0, (9,), None, None))  # a micro-batch of a driver whose base is 0
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))

    chain = scripted_chain(reply)
    chain.submit(one_step(micro_batch_id=3, step_id=7))
    result = chain.collect()
    assert (result.micro_batch_id, result.step_id, result.next_token_ids) == (3, 7, (1,))


def test_a_result_is_stamped_with_when_it_arrived_not_when_the_driver_took_it(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    # Adaptive K times the chain's round trip to this stamp: a result that waited for a busy driver must not
    # read as a slow chain.
    answered = threading.Event()

    async def reply(link: Link, message: Forward) -> None:
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))
        answered.set()

    chain = scripted_chain(reply)
    sent = time.perf_counter()
    chain.submit(one_step())
    assert answered.wait(10)
    time.sleep(0.3)  # the driver is busy elsewhere
    chain.collect()
    taken = time.perf_counter()
    assert sent < chain.last_arrival_s < taken - 0.25


def test_a_duplicated_result_is_handed_over_once(scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    async def reply(link: Link, message: Forward) -> None:
        for _ in range(2):
            await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))

    chain = scripted_chain(reply)
    chain.submit(one_step())
    assert chain.collect().micro_batch_id == 0
    with pytest.raises(ChainError, match="no result within"):
        chain.collect(timeout=0.5)


def test_a_second_step_of_a_micro_batch_in_flight_is_refused(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    async def reply(link: Link, message: Forward) -> None:
        await asyncio.sleep(1.0)

    chain = scripted_chain(reply)
    chain.submit(one_step())
    with pytest.raises(ValueError, match="already has a step in flight"):
        chain.submit(one_step(step_id=1))


def test_a_late_result_of_the_previous_run_is_dropped_after_renumber(
        scripted_chain: Callable[[Reply], FleetPipeline], caplog: pytest.LogCaptureFixture) -> None:
    # A chat reply stopped by Ctrl-C leaves a step in flight; the next reply's engine renumbers the chain
    # and starts again at micro-batch 1: the old step's result must not reach it.
    async def reply(link: Link, message: Forward) -> None:
        if message.step_id == 5:  # the old run's step answers late, after the new run's
            await asyncio.sleep(0.5)
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (message.step_id,), None, None))

    chain = scripted_chain(reply)
    chain.submit(one_step(micro_batch_id=1, step_id=5))
    chain.renumber()
    chain.submit(one_step(micro_batch_id=1, step_id=0))
    result = chain.collect()
    assert (result.micro_batch_id, result.step_id) == (1, 0)
    with pytest.raises(ChainError, match="no result within"):
        chain.collect(timeout=1.0)
    # known as this chain's own stopped run: not reported as another driver's (the user would see a warning)
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_an_error_about_another_runs_micro_batch_is_dropped(scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    # An agent dropped from this chain by a failover wakes up and relays its old steps; the refusal its old
    # next hop sends names that run's micro-batch, and must not break this healthy chain.
    async def reply(link: Link, message: Forward) -> None:
        await link.send(Error(ErrorCode.BAD_MESSAGE, "append for 1 rows, the micro-batch has 0",
                              micro_batch_id=message.micro_batch_id + 7))
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))

    chain = scripted_chain(reply)
    chain.submit(one_step(micro_batch_id=3))
    assert chain.collect().next_token_ids == (1,)


def test_errors_about_other_runs_micro_batches_are_logged_once_then_counted(
        scripted_chain: Callable[[Reply], FleetPipeline], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A woken agent relays a whole old run: one warning per micro-batch, the same text, filled the log
    async def reply(link: Link, message: Forward) -> None:
        for stray in range(30):
            await link.send(Error(ErrorCode.BAD_MESSAGE, "append for 1 rows, the micro-batch has 0",
                                  micro_batch_id=message.micro_batch_id + 100 + stray))
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))

    chain = scripted_chain(reply)
    with caplog.at_level(logging.DEBUG, logger=fleet_pipeline.log.name):
        chain.submit(one_step(micro_batch_id=3))
        assert chain.collect().next_token_ids == (1,)
        warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "dropped an error about wire micro-batch" in warnings[0]
        assert "any more such are counted" in warnings[0] and "stage 0" in warnings[0]
        monkeypatch.setattr(fleet_pipeline, "STRAY_ERROR_LOG_S", 0.0)  # a minute later: the count
        caplog.clear()
        chain.submit(one_step(micro_batch_id=4))
        assert chain.collect().next_token_ids == (1,)
    counts = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert "31 errors about micro-batches with no step in flight here dropped so far" in counts[0]


def test_an_error_about_a_step_in_flight_breaks_the_chain_naming_the_agent_at_fault(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    # (the blame must fit the stage's place in the chain: here the one stage blames itself, having given its
    # stages up; tests/controller/test_review_hop_auth.py covers blames that do not fit)
    blamed: list[str] = []

    async def reply(link: Link, message: Forward) -> None:
        await link.send(Error(ErrorCode.NOT_ASSIGNED, "this agent gave its stages up",
                              micro_batch_id=message.micro_batch_id, agent_id=blamed[0]))

    chain = scripted_chain(reply)
    blamed.append(chain.stages[0].agent_id)
    chain.submit(one_step(micro_batch_id=3))
    with pytest.raises(ChainError, match="gave its stages up") as caught:
        chain.collect()
    assert caught.value.agent_id == blamed[0]
    # the stage, its layers and address, and the kind of error in words (it said "not_assigned from the chain")
    assert str(caught.value).startswith(f"stage 0 [0:4] on agent {blamed[0][:12]} at 127.0.0.1:")
    assert " reported no stage for the step: this agent gave its stages up" in str(caught.value)


def test_a_closed_chain_wakes_a_waiting_collect_and_refuses_the_next_at_once(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    async def never(link: Link, message: Forward) -> None:
        pass  # the step is in flight and stays so

    chain = scripted_chain(never)  # step_timeout_s=5: a collect that waited for it would take 5 s
    chain.submit(one_step())
    outcome: list[BaseException] = []

    def waiting() -> None:
        try:
            chain.collect()
        except ChainError as error:
            outcome.append(error)

    waiter = threading.Thread(target=waiting)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    chain.close()  # from another thread, as a library user stopping a run would
    waiter.join(timeout=3)
    assert not waiter.is_alive() and time.monotonic() - started < 3
    assert [str(error) for error in outcome] == ["the chain is closed"]  # not "an agent may be stuck"
    with pytest.raises(ChainError, match="the chain is closed"):
        chain.collect()


def test_a_stop_wakes_a_waiting_collect_with_stopped_and_the_next_collect_is_refused_at_once(
        scripted_chain: Callable[..., FleetPipeline]) -> None:
    # serve --fleet's close waited for a step to a stalled PC (the step timeout), then 30 s more were cut short
    async def never(link: Link, message: Forward) -> None:
        pass

    stop = StopSignal()
    chain = scripted_chain(never, stop=stop)
    chain.submit(one_step())
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        chain.collect()
    assert time.monotonic() - started < 3  # step_timeout_s=5
    with pytest.raises(Stopped):
        chain.collect()


def test_a_chain_opened_under_a_stop_set_already_gives_up_its_opening(
        scripted_chain: Callable[..., FleetPipeline]) -> None:
    stop = StopSignal()
    stop.set()

    async def never(link: Link, message: Forward) -> None:
        pass

    with pytest.raises(Stopped, match="opening the chain"):
        scripted_chain(never, stop=stop)


# A prompt is one step: its wait grows with the tokens it feeds. With a fixed 120 s, a long prompt (or a failover's
# resume: the prompt plus every token so far) through slow PCs looked like a stuck agent, and the re-plan, blaming no
# one, ran the same prefill again until --max-failovers gave up.

def step_of(tokens: int, micro_batch_id: int = 0) -> Forward:
    return Forward(micro_batch_id, 0, (0,), (AppendSlots(tokens, (tokens,), (0,)),), np.zeros(1, np.int64),
                   np.arange(tokens, dtype=np.int64)[None, :], np.ones((1, tokens), np.int64), None, None)


def test_a_step_of_many_tokens_is_given_time_for_them_and_a_decode_step_is_not(
        scripted_chain: Callable[[Reply], FleetPipeline], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_pipeline, "STEP_TIMEOUT_S_PER_TOKEN", 0.05, raising=False)

    async def slow_reply(link: Link, message: Forward) -> None:  # every step takes 1 s, whatever its size
        await asyncio.sleep(1.0)
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))

    chain = scripted_chain(slow_reply)
    chain.step_timeout_s = 0.3
    chain.submit(step_of(40))  # a prompt of 40 tokens: 0.3 + 40 x 0.05 = 2.3 s
    assert chain.collect().micro_batch_id == 0
    chain.submit(step_of(1, micro_batch_id=1))  # one token: 0.35 s
    with pytest.raises(ChainError, match="no result within 0 s"):
        chain.collect()


def test_the_results_range_a_driver_names_holds_every_id_it_sends_and_no_other_drivers(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    # The last stage's agent sends each driver the results of the range its ResultsHere names: with one results
    # link per agent, a second driver on the same deployment took the first one's results, and the first
    # waited out its step timeout ("an agent may be stuck") while nothing was stuck
    async def reply(link: Link, message: Forward) -> None:
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))

    first, second = scripted_chain(reply), scripted_chain(reply)
    for chain in (first, second, first):
        for _ in range(3):  # a chat's turns: each renumbers
            chain.submit(one_step(micro_batch_id=(1 << 24) - 1))  # the largest engine id
            chain.collect()
            chain.renumber()
    ranges = [message for message in SEEN if isinstance(message, ResultsHere)]
    assert len(ranges) == 2 and not ranges[0].holds(ranges[1].first_micro_batch_id)
    assert not ranges[1].holds(ranges[0].first_micro_batch_id)
    ids = [message.micro_batch_id for message in SEEN if isinstance(message, Forward)]
    assert len(set(ids)) == 9  # never an id twice
    assert all(ranges[0].holds(wire_id) for wire_id in ids[:3] + ids[6:])
    assert all(ranges[1].holds(wire_id) for wire_id in ids[3:6])


def test_the_last_range_and_its_largest_id_cross_the_wire(scripted_chain: Callable[[Reply], FleetPipeline],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # every wire id must stay an int64 (the codec's integers): the last range a driver can draw, its last base
    async def reply(link: Link, message: Forward) -> None:
        await link.send(ForwardResult(message.micro_batch_id, message.step_id, (1,), None, None))

    monkeypatch.setattr(fleet_pipeline.secrets, "randbelow", lambda bound: bound - 1)
    chain = scripted_chain(reply)
    chain.submit(one_step(micro_batch_id=(1 << 24) - 1))
    assert chain.collect().next_token_ids == (1,)
    (claimed,) = [message for message in SEEN if isinstance(message, ResultsHere)]
    (forward,) = [message for message in SEEN if isinstance(message, Forward)]
    assert claimed.holds(forward.micro_batch_id) and claimed.stop_micro_batch_id < 1 << 63
    assert forward.micro_batch_id == claimed.stop_micro_batch_id - 1  # the range's very last id


def test_a_pc_that_cannot_be_reached_is_named_by_its_hostname_too(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    agent_id = make_member(ca, tmp_path / "agent", "agent").own_identity().agent_id
    driver_files = make_member(ca, tmp_path / "driver", "driver", Role.CONTROLLER)
    address = free_address()  # nothing listens there
    with pytest.raises(ChainError) as caught:
        FleetPipeline([StagePlacement(agent_id, address, 0, 4)], driver_files, hostnames={agent_id: "alice-pc"})
    assert f"cannot reach agent {agent_id[:12]} on alice-pc (stage 0, layers [0:4])" in str(caught.value)
    assert caught.value.agent_id == agent_id


def test_a_link_that_closes_names_the_pc_by_its_hostname(scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    async def reply(link: Link, message: Forward) -> None:
        await link.close()

    chain = scripted_chain(reply)
    agent_id = chain.stages[0].agent_id
    chain.hostnames[agent_id] = "alice-pc"
    assert f"on agent {agent_id[:12]} on alice-pc at 127.0.0.1:" in chain.describe()
    chain.submit(one_step())
    with pytest.raises(ChainError) as caught:
        chain.collect()
    assert str(caught.value).startswith(f"agent {agent_id[:12]} on alice-pc (stage 0, layers [0:4]) at 127.0.0.1:")
    assert ": its link closed: " in str(caught.value) and "link to" not in str(caught.value)  # said once, not twice


def test_closing_a_chain_whose_network_thread_ends_meanwhile_raises_nothing(
        scripted_chain: Callable[[Reply], FleetPipeline], monkeypatch: pytest.MonkeyPatch) -> None:
    # the thread ended between close()'s check that it was alive and its post of the stop: the post raised the
    # chain's failure out of close() (a CI teardown, on a busy host)
    async def reply(link: Link, message: Forward) -> None:
        await link.close()

    chain = scripted_chain(reply)
    chain.submit(one_step())
    with pytest.raises(ChainError) as caught:
        chain.collect()

    def loop_gone(item: object) -> None:
        raise caught.value

    monkeypatch.setattr(chain, "_post", loop_gone)
    monkeypatch.setattr(chain._thread, "is_alive", lambda: True)
    chain.close()  # no error


def test_a_chain_whose_deployment_was_replaced_fails_at_its_next_step_blaming_no_one(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    # an admin's `fleet deploy` under an idle `serve --fleet`: before, the next request's step went to stages the
    # deploy had reshaped, its result was dropped by a last stage that never heard of this driver, and the request
    # waited out the step timeout
    async def silent(link: Link, message: Forward) -> None:
        pass

    chain = scripted_chain(silent)
    replaced = [True]
    chain.replaced = lambda: replaced[0]
    with pytest.raises(ChainError, match=r"^the deployment on record was replaced under the chain \(an admin's "
                                         r"`fleet deploy`, or another run's re-plan\)$") as raised:
        chain.submit(one_step())
    assert isinstance(raised.value, fleet_pipeline.DeploymentReplaced)  # no PC failed: the failover spends nothing
    assert raised.value.agent_id is None and raised.value.stages == chain.stages
    assert not any(isinstance(message, Forward) for message in SEEN)  # nothing sent to the stages it no longer has
    with pytest.raises(ChainError, match="replaced"):
        chain.collect()  # the chain stays failed


def test_a_step_in_flight_when_the_deployment_is_replaced_is_given_up_within_a_second(
        scripted_chain: Callable[[Reply], FleetPipeline]) -> None:
    async def silent(link: Link, message: Forward) -> None:  # its result went to a stage that dropped it
        pass

    chain = scripted_chain(silent)
    replaced = [False]
    chain.replaced = lambda: replaced[0]
    chain.submit(one_step())
    threading.Timer(0.3, lambda: replaced.__setitem__(0, True)).start()
    started = time.monotonic()
    with pytest.raises(ChainError, match="replaced under the chain"):
        chain.collect()  # the step timeout is 5 s
    assert time.monotonic() - started < fleet_pipeline.REPLACED_POLL_S + 2.0
