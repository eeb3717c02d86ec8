"""open_first: a link at the first of a PC's addresses to answer, the next one dialled a stagger after the one before
it (a next hop of both IP families; the controller's mDNS announcement), with fake dials timed on the event loop."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from deskfleet.agent.link import Link, LinkError, LinkRefused, open_first

STAGGER_S = 0.2


class FakeLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class Dials:
    """open_one for open_first: each address answers after its delay, fails after it, or never answers."""

    def __init__(self, answers: dict[str, float], fails: dict[str, float] | None = None) -> None:
        self.answers = answers
        self.fails = fails or {}
        self.started: dict[str, float] = {}
        self.cancelled: list[str] = []
        self.opened: list[FakeLink] = []

    async def open_one(self, address: str) -> Link:
        loop = asyncio.get_running_loop()
        self.started[address] = loop.time()
        try:
            if address in self.fails:
                await asyncio.sleep(self.fails[address])
                raise LinkRefused(f"{address} refused the link: HTTP 403", 403) if address.startswith("403") \
                    else LinkError(f"cannot reach {address}: [Errno 111] Connection refused")
            await asyncio.sleep(self.answers.get(address, 3600.0))  # not listed: black-holed
        except asyncio.CancelledError:
            self.cancelled.append(address)
            raise
        link = FakeLink(address)
        self.opened.append(link)
        return cast(Link, link)


def _race(dials: Dials, addresses: list[str], stagger_s: float = STAGGER_S) -> tuple[Link, float]:
    async def run() -> tuple[Link, float]:
        start = asyncio.get_running_loop().time()
        link = await open_first(addresses, dials.open_one, stagger_s)
        return link, asyncio.get_running_loop().time() - start

    return asyncio.run(run())


def test_an_address_that_answers_within_the_stagger_costs_the_others_no_dial() -> None:
    dials = Dials({"10.0.0.9:7431": 0.05, "[fd62::30]:7431": 0.0})
    link, _ = _race(dials, ["10.0.0.9:7431", "[fd62::30]:7431"])
    assert link.address == "10.0.0.9:7431" and list(dials.started) == ["10.0.0.9:7431"]


def test_a_black_holed_address_costs_the_stagger_not_its_open_timeout() -> None:
    dials = Dials({"[fd62::30]:7431": 0.05})
    link, took = _race(dials, ["10.0.0.9:7431", "[fd62::30]:7431"])
    assert link.address == "[fd62::30]:7431"
    started = dials.started["[fd62::30]:7431"] - dials.started["10.0.0.9:7431"]
    assert STAGGER_S * 0.9 <= started < STAGGER_S + 0.15 and took < 1.0
    assert dials.cancelled == ["10.0.0.9:7431"]  # the silent dial is not left running


def test_an_address_that_fails_has_the_next_dialled_at_once() -> None:
    dials = Dials({"[fd62::30]:7431": 0.0}, fails={"10.0.0.9:7431": 0.01})
    link, took = _race(dials, ["10.0.0.9:7431", "[fd62::30]:7431"])
    assert link.address == "[fd62::30]:7431" and took < STAGGER_S * 0.75


def test_a_slow_first_address_loses_to_a_quicker_second() -> None:
    dials = Dials({"10.0.0.9:7431": STAGGER_S + 0.3, "[fd62::30]:7431": 0.05})
    link, _ = _race(dials, ["10.0.0.9:7431", "[fd62::30]:7431"])
    assert link.address == "[fd62::30]:7431" and dials.cancelled == ["10.0.0.9:7431"]


def _race_ending_in_one_turn(raising: str | None = None) -> tuple[asyncio.Task[Link], list[FakeLink]]:
    """open_first over a:1 and b:1, all dialled at once, both dials ending in the same turn of the loop: each opens a
    link, but `raising`, which raises OSError. (the finished race, the links opened)"""
    opened: list[FakeLink] = []

    async def run() -> asyncio.Task[Link]:
        gate = asyncio.Event()

        async def open_one(address: str) -> Link:
            await gate.wait()
            if address == raising:
                raise OSError("damaged credentials")
            link = FakeLink(address)
            opened.append(link)
            return cast(Link, link)

        race = asyncio.create_task(open_first(["a:1", "b:1"], open_one, 0.0))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.wait([race])
        return race

    return asyncio.run(run()), opened


def test_a_second_link_opened_in_the_same_instant_is_closed() -> None:
    race, opened = _race_ending_in_one_turn()
    link = race.result()
    assert len(opened) == 2 and [each.closed for each in opened if each is not link] == [True]
    assert not cast(FakeLink, link).closed


def test_no_stagger_dials_every_address_at_once() -> None:
    dials = Dials({"c:1": 0.05})
    link, _ = _race(dials, ["a:1", "b:1", "c:1"], stagger_s=0.0)
    assert link.address == "c:1" and sorted(dials.started) == ["a:1", "b:1", "c:1"]
    assert max(dials.started.values()) - min(dials.started.values()) < 0.02
    assert sorted(dials.cancelled) == ["a:1", "b:1"]


def test_none_answering_names_every_address_and_one_keeps_its_own_error() -> None:
    failures: list[str] = []
    dials = Dials({}, fails={"10.0.0.9:7431": 0.01, "[fd62::30]:7431": 0.01})

    async def both() -> None:
        await open_first(["10.0.0.9:7431", "[fd62::30]:7431"], dials.open_one, STAGGER_S,
                         lambda address, _: failures.append(address))

    with pytest.raises(LinkError) as raised:
        asyncio.run(both())
    assert "cannot reach 10.0.0.9:7431" in str(raised.value) and "cannot reach [fd62::30]:7431" in str(raised.value)
    assert failures == ["10.0.0.9:7431", "[fd62::30]:7431"]

    refused = Dials({}, fails={"403.example:7431": 0.0})
    with pytest.raises(LinkRefused) as one:  # a refusal stays one, for callers that read its status
        asyncio.run(open_first(["403.example:7431"], refused.open_one, STAGGER_S))
    assert one.value.status == 403
    with pytest.raises(ValueError, match="no address"):
        asyncio.run(open_first([], refused.open_one, STAGGER_S))


def test_a_race_cancelled_cancels_its_dials_and_closes_what_they_opened() -> None:
    dials = Dials({})

    async def run() -> None:
        race = asyncio.create_task(open_first(["a:1", "b:1"], dials.open_one, 0.0))
        await asyncio.sleep(0.05)
        race.cancel()
        with pytest.raises(asyncio.CancelledError):
            await race

    asyncio.run(run())
    assert sorted(dials.cancelled) == ["a:1", "b:1"]


def test_a_dial_that_raises_what_no_dial_should_closes_the_link_that_won() -> None:
    race, opened = _race_ending_in_one_turn(raising="b:1")
    with pytest.raises(OSError, match="damaged credentials"):
        race.result()
    assert [link.closed for link in opened] == [True]
