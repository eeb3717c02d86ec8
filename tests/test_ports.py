"""The test ports' helper: below the kernel's ephemeral range, never handed out twice, free when given."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def test_ports_come_from_below_the_ephemeral_range_once_each_and_bind() -> None:
    given = [ports.free_port() for _ in range(50)]
    assert len(set(given)) == len(given)
    assert all(ports._LOWEST <= port < ports._first_ephemeral_port() for port in given)
    with socket.socket() as server:
        server.bind((ports.LOOPBACK, given[0]))
        server.listen()


def test_a_port_someone_holds_is_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind((ports.LOOPBACK, 0))
        held = holder.getsockname()[1]
        real_randint, picks = ports._choice.randint, []

        def held_first(low: int, high: int) -> int:
            picks.append(held if not picks else real_randint(low, high))
            return picks[-1]

        monkeypatch.setattr(ports._choice, "randint", held_first)
        monkeypatch.setattr(ports, "_first_ephemeral_port", lambda: 65536)
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.free_port() != held
        assert picks[0] == held
