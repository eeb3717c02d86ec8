"""Review findings on the wire codec: each test failed before its fix."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deskfleet.common import wire
from deskfleet.common.wire import (
    AdmitRow,
    AgentState,
    AppendSlots,
    Compact,
    Error,
    ErrorCode,
    Forward,
    ForwardResult,
    InvalidateSlots,
    NextHop,
    ProtocolError,
    Register,
    ReorderRows,
    ShardChunk,
    StageRef,
    StatusReport,
    decode,
    encode,
    parse_address,
    same_message,
)
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


# Every valid message round-trips exactly; same_message says so, NaN payloads included.

_INT64 = st.integers(-2**63, 2**63 - 1)
_UINT63 = st.integers(0, 2**63 - 1)
_INT_TUPLES = st.lists(_INT64, max_size=3).map(tuple)
_DELTAS = st.one_of(
    st.builds(AppendSlots, _INT64, _INT_TUPLES, _INT_TUPLES),
    st.builds(InvalidateSlots, _INT64, _INT64, _INT64),
    st.builds(ReorderRows, _INT_TUPLES),
    st.builds(AdmitRow, _INT64),
    st.builds(Compact, _INT64, st.lists(st.lists(st.tuples(_INT64, _INT64), max_size=2).map(tuple),
                                         max_size=2).map(tuple)))


def _tensor(draw: st.DrawFn, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=dtype).reshape(shape)


@st.composite
def _forwards(draw: st.DrawFn) -> Forward:
    rows, tokens, hidden = draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 4))
    first_stage = draw(st.booleans())
    deltas = tuple(draw(st.lists(_DELTAS, max_size=4)))
    admits = sum(isinstance(delta, AdmitRow) for delta in deltas)
    return Forward(
        draw(_UINT63), draw(_UINT63), tuple(range(rows)), deltas,
        _tensor(draw, (rows,), draw(st.sampled_from(["<i8", "<i4", ">i8"]))), _tensor(draw, (rows, tokens), "<i8"),
        _tensor(draw, (rows, tokens), "<i8") if first_stage else None,
        None if first_stage else _tensor(draw, (rows, tokens, hidden), draw(st.sampled_from(["<f4", "<f2", ">f4"]))),
        None, tuple(draw(_UINT63) for _ in range(admits)), None, draw(st.booleans()), draw(_UINT63), draw(st.text()),
        keep_sources=tuple(draw(st.booleans()) for _ in range(admits)) if draw(st.booleans()) else ())


@st.composite
def _results(draw: st.DrawFn) -> ForwardResult:
    logits = _tensor(draw, (2, 1, 3), draw(st.sampled_from(["<f2", "<f4"]))) if draw(st.booleans()) else None
    return ForwardResult(draw(_UINT63), draw(_UINT63), (draw(_INT64), draw(_INT64)),
                         draw(st.none() | st.tuples(_UINT63, _UINT63)), logits)


_MESSAGES = st.one_of(
    _forwards(), _results(),
    st.builds(StatusReport, st.sampled_from(AgentState), _UINT63, st.floats(0, 1), st.none() | st.floats(0, 100),
              st.none() | st.booleans(), st.none() | st.floats(-50, 200), st.none() | st.floats(0, 1),
              st.lists(st.builds(StageRef, st.text(min_size=1), st.integers(0, 10), st.integers(11, 20)),
                       max_size=2).map(tuple),
              st.none() | st.text(), st.none() | st.floats(1e-300, 9e4), st.just(()), st.text(max_size=50)),
    st.builds(Error, st.sampled_from(ErrorCode), st.text(), st.none() | _UINT63, st.none() | st.just(AGENT)),
    st.builds(ShardChunk, st.just("0" * 64), st.integers(0, 10), st.integers(1000, 2**63 - 1), st.binary(max_size=64)))


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_MESSAGES)
def test_any_valid_message_round_trips_exactly(message: wire.Message) -> None:
    assert same_message(decode(encode(message)), message)


def test_a_tensor_holding_nan_is_the_same_message_after_a_round_trip() -> None:
    logits = np.array([[[0.5, np.nan, -np.inf]]], dtype=np.float16)
    result = ForwardResult(1, 2, (3,), None, logits)
    assert same_message(decode(encode(result)), result)
    assert not same_message(ForwardResult(1, 2, (3,), None, np.zeros((1, 1, 1), np.float32)),
                            ForwardResult(1, 2, (3,), None, np.full((1, 1, 1), np.nan, np.float32)))


def test_reported_text_with_a_lone_surrogate_travels_escaped_and_other_text_is_refused() -> None:
    # os.fsdecode of a file name that is not UTF-8 makes lone surrogates; such an Error used to be encoded,
    # and the receiver then refused the whole frame (and closed the link) instead of reading the error
    name = os.fsdecode(b"/var/cache/caf\xe9.bin")
    error = decode(encode(Error(ErrorCode.INTERNAL, f"cannot read {name}")))
    assert isinstance(error, Error) and error.message == "cannot read /var/cache/caf\\udce9.bin"
    status = decode(encode(StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), name)))
    assert isinstance(status, StatusReport) and status.last_error == "/var/cache/caf\\udce9.bin"
    status = decode(encode(StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, detail=name)))
    assert isinstance(status, StatusReport) and status.detail == "/var/cache/caf\\udce9.bin"
    assert same_message(decode(encode(Error(ErrorCode.INTERNAL, "café 𝄞"))), Error(ErrorCode.INTERNAL, "café 𝄞"))


def test_reported_text_reaches_the_controller_with_its_terminal_controls_escaped() -> None:
    # an enrolled PC's Error or status text is printed on the admin's terminal: an ESC there ran an escape, a
    # carriage return overwrote the line, a right-to-left override showed it backwards; newlines and tabs stay
    said = "stage failed\x1b[2J\r\u202eevil\x9b\nline two\tcolumn"
    shown = "stage failed\\x1b[2J\\r\\u202eevil\\x9b\nline two\tcolumn"
    header = {"type": "Error", "fields": {"code": "internal", "message": said, "micro_batch_id": None,
                                          "agent_id": None}, "tensors": []}
    error = decode(raw_frame(header))  # as a peer that skipped encode's escaping sends it
    assert isinstance(error, Error) and error.message == shown
    status = decode(encode(StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), said,
                                        detail="60 C\x1b[31m")))
    assert isinstance(status, StatusReport) and status.last_error == shown and status.detail == "60 C\\x1b[31m"
    # a detail cut to the limit before it was escaped grew past it, and every status request failed
    full = StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None,
                        detail=("cache /srv/c\x1bche: disk full; " + "x" * 500)[:500])
    assert full.detail.startswith("cache /srv/c\\x1bche") and len(full.detail) == 500




def test_a_register_of_more_addresses_than_a_pc_has_is_refused() -> None:
    # the controller dials every address a Register lists: thousands of them would be thousands of dials
    addresses = tuple(f"10.0.{index // 250}.{index % 250 + 1}:7431" for index in range(17))
    Register(AGENT, addresses[:16])
    with pytest.raises(ProtocolError, match="register lists 17 addresses, more than 16"):
        Register(AGENT, addresses)
