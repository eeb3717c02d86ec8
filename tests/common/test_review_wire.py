"""Review findings on the wire codec: each test failed before its fix."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import pytest

from deskfleet.common.wire import NextHop, ProtocolError, Register, decode, encode, parse_address
from tests.common.test_wire import AGENT, VALID_FRAMES, header_of, raw_frame

Path = tuple[str | int, ...]


def test_a_port_of_thousands_of_digits_is_a_protocol_error() -> None:
    # int() refuses strings past 4300 digits with a plain ValueError, which escaped decode()
    with pytest.raises(ProtocolError, match="has no port between 1 and 65535"):
        parse_address("host:" + "9" * 5000)
    header = header_of(encode(Register(AGENT, ("192.168.1.20:7443",))))
    header["fields"]["listen_addresses"] = ["192.168.1.20:" + "9" * 5000]  # type: ignore[index]
    with pytest.raises(ProtocolError, match="has no port"):
        decode(raw_frame(header))


def test_ports_keep_their_meaning() -> None:
    assert parse_address("[fe80::1]:00080") == ("fe80::1", 80)
    assert parse_address("h:" + "0" * 40 + "65535") == ("h", 65535)
    assert parse_address("h:0", any_port=True) == ("h", 0)
    for bad in ("h:65536", "h:100000", "h:0", "h:", "h:-1", "h:٣"):
        with pytest.raises(ProtocolError):
            parse_address(bad)
    assert NextHop("desk-7.local:7443", AGENT).address == "desk-7.local:7443"


# Every leaf of every valid frame's header, replaced by each of these, decodes or raises ProtocolError.

NASTY_LEAVES: tuple[object, ...] = (
    None, True, 0, -1, 3, 2**63, -2**63 - 1, 10**30, 1.5, -0.0, 1e308, float("inf"), float("nan"),
    "", "\ud800", "9" * 5000, "a:" + "9" * 5000, "x:0", "a" * 52, "0" * 64, "int64", "bool",
    [], [-1], [2**63], [[0, 2**62]], {}, {"kind": "AppendSlots", "fields": {}}, [0] * 5,
)


def _paths(node: object, prefix: Path = ()) -> Iterator[Path]:
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


def _replaced(node: object, path: Path, value: object) -> object:
    if not path:
        return value
    copied = copy.copy(node)
    copied[path[0]] = _replaced(node[path[0]], path[1:], value)  # type: ignore[index]
    return copied


@pytest.mark.parametrize("frame", VALID_FRAMES, ids=lambda frame: str(header_of(frame)["type"]))
def test_every_header_leaf_replaced_by_a_nasty_value_gives_a_message_or_protocol_error(frame: bytes) -> None:
    length = int.from_bytes(frame[6:10], "little")
    payload = frame[10 + length:]
    header = header_of(frame)
    for path in _paths(header):
        for value in NASTY_LEAVES:
            text = json.dumps(_replaced(header, path, value)).encode("utf-8", "surrogatepass")
            try:
                decode(raw_frame(text, payload))
            except ProtocolError:
                pass
