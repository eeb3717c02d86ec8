from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deskfleet.common import wire
from deskfleet.common.wire import (
    MAX_KNOWN_REMOVALS,
    MAX_LISTEN_ADDRESSES,
    MAX_OTHER_ADDRESSES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    AddressesChanged,
    AdmitRow,
    AgentState,
    AppendSlots,
    AssignStage,
    Compact,
    DraftInfo,
    Error,
    ErrorCode,
    Forward,
    ForwardResult,
    Hello,
    InvalidateSlots,
    JoinOffer,
    JoinRequest,
    JoinResponse,
    KnownRemovals,
    Limits,
    ManifestEntry,
    NextHop,
    Precision,
    ProtocolError,
    Register,
    ReleaseMicroBatch,
    ReleaseStage,
    ReorderRows,
    ResultsHere,
    RevocationUpdate,
    Role,
    SamplingInfo,
    ShardChunk,
    ShardComplete,
    ShardHave,
    ShardOffset,
    ShardQuery,
    StageReady,
    StageRef,
    StatusReport,
    StatusRequest,
    TensorSpec,
    check_tensor,
    decode,
    encode,
    ip_families,
    same_message,
)

AGENT = "a" * 40 + "bcdefg234567"
SIGNATURE = bytes(range(64))  # a removal's signature has 64 bytes (common/pki.py checks the rest)
SHA = "0123456789abcdef" * 4
STAGE = StageRef("llama-3.2-1b", 4, 9)
RNG = np.random.default_rng(1234)


def forward(rows: int = 2, tokens: int = 3, hidden: int | None = None, **changes: object) -> Forward:
    fields: dict[str, object] = dict(
        micro_batch_id=7, step_id=42, stream_ids=tuple(range(100, 100 + rows)),
        slot_deltas=(ReorderRows((1, 0)), InvalidateSlots(0, 5, 7),
                     Compact(3, (((0, 2), (4, 5)), ((1, 4),))), AdmitRow(6),
                     AppendSlots(tokens, (tokens,) * rows, (9,) * rows)),
        beam_idx=np.arange(rows, dtype=np.int64),
        position_ids=RNG.integers(0, 4096, (rows, tokens), dtype=np.int64),
        input_ids=None if hidden else RNG.integers(0, 32000, (rows, tokens), dtype=np.int64),
        hidden_states=(RNG.standard_normal((rows, tokens, hidden), dtype=np.float32) if hidden else None),
        draft=None,
    )
    fields.update(changes)
    if "admit_from" not in changes:
        deltas = fields["slot_deltas"]
        assert isinstance(deltas, tuple)
        fields["admit_from"] = tuple(3 for delta in deltas if isinstance(delta, AdmitRow))
    return Forward(**fields)


def all_messages() -> list[wire.Message]:
    return [
        Hello(1, AGENT, "0.1.0", Role.AGENT),
        Error(ErrorCode.SHARD_MISMATCH, "layer_003.bin: sha256 differs ✗"),
        StatusRequest(),
        StatusReport(AgentState.SERVING, 8 << 30, 0.25, 80.0, False, 61.5, None, (STAGE,), None),
        StatusReport(AgentState.PAUSED, 0, 1.0, None, None, None, 0.5, (), "compile failed"),
        StatusReport(AgentState.AVAILABLE, 1, 0.0, None, None, None, None, (), None, devices=("CPU", "GPU.0", "NPU")),
        StatusReport(AgentState.AVAILABLE, 1, 0.0, None, None, None, None, (), None, shard_room_bytes=50 << 30,
                     clock_s=1_800_000_000.25),
        StatusReport(AgentState.AVAILABLE, 1, 0.0, None, None, None, None, (), None, ip_families=(4, 6)),
        AssignStage(STAGE, False, True, "GPU", Precision.F32, NextHop("[fe80::1]:7443", AGENT),
                    (ManifestEntry("layer_004.xml", SHA, 1234), ManifestEntry("layer_004.bin", SHA, 0)),
                    previous_agent_id=AGENT),
        AssignStage(STAGE, True, False, "CPU", Precision.DEVICE_DEFAULT, None, ()),
        AssignStage(STAGE, False, False, "CPU", Precision.F32,
                    NextHop("10.0.0.9:7431", AGENT, ("[fd62::30]:7431", "desk-9.office.example:7431")), (),
                    previous_agent_id=AGENT),
        AssignStage(STAGE, True, True, "CPU", Precision.DEVICE_DEFAULT, None, (), "f32"),
        StageReady(STAGE),
        ReleaseStage(STAGE),
        ShardQuery((SHA, "f" * 64)),
        ShardHave((SHA,), (ShardOffset("e" * 64, 1 << 40),)),
        ShardChunk(SHA, 16, 1 << 33, bytes(range(256)) * 3),
        ShardChunk(SHA, 0, 0, b""),
        ShardComplete(SHA),
        forward(),
        forward(rows=3, tokens=1, hidden=16, layer_start=9),
        forward(hidden=8, hidden_states=np.ones((2, 3, 8), np.float16),
                draft=DraftInfo((2, 0), np.array([[5, 6, 0], [0, 0, 0]], np.int64), one_hot=True)),
        forward(rows=0, tokens=0, slot_deltas=()),
        ForwardResult(7, 42, (11, 12), None, None),
        ForwardResult(7, 43, (11, 12), (3, 0), RNG.standard_normal((2, 1, 50)).astype(np.float16)),
        ForwardResult(7, 44, (11, 12), (2, 0), None, token_logprobs=-RNG.random((2, 3)).astype(np.float32),
                      top_logprob_ids=np.arange(30).reshape(2, 3, 5), top_logprobs=-RNG.random((2, 3, 5), np.float32)),
        Error(ErrorCode.INTERNAL, "next hop unreachable", micro_batch_id=12, agent_id=AGENT),
        JoinOffer("-----BEGIN CERTIFICATE-----\n...", "0011223344556677"),
        JoinRequest("c2VjcmV0", "-----BEGIN CERTIFICATE REQUEST-----\n...", "desk-42.office"),
        JoinResponse("cert", "ca", "0011223344556677"),
        Register(AGENT, ("192.168.1.20:7443", "desk-42.local:7443")),
        Register(AGENT, ("192.168.1.20:7443",), SHA),
        AddressesChanged(("192.168.1.20:7443", "[fd62::30]:7443")),
        ReleaseMicroBatch(7),
        ResultsHere(0, 1 << 62),
        RevocationUpdate.of((AGENT,), (SIGNATURE,)),
        RevocationUpdate(b""),
        KnownRemovals.of((AGENT, "b" * 52), (SIGNATURE, bytes(64))),
        KnownRemovals.of((AGENT,) * MAX_KNOWN_REMOVALS, (SIGNATURE,) * MAX_KNOWN_REMOVALS),
        forward(return_logits=True),
        forward(logprobs=(-1, 20)),
        forward(logprobs=(2, -1), scored_ids=np.array([[5, 6, -1], [-1, -1, -1]], np.int64)),
        ForwardResult(7, 45, (11,), None, None, np.zeros((1, 1), np.float32), np.zeros((1, 1, 2), np.int64),
                      np.zeros((1, 1, 2), np.float32), scored_logprobs=-RNG.random((1, 3), np.float32),
                      scored_top_ids=np.arange(6).reshape(1, 3, 2),
                      scored_top_logprobs=np.zeros((1, 3, 2), np.float32)),
    ]


def raw_frame(header: object, payload: bytes = b"", version: int = PROTOCOL_VERSION, magic: bytes = b"DSKF") -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    body += b" " * (-(10 + len(body)) % 8)
    return struct.pack("<4sHI", magic, version, len(body)) + body + payload


def header_of(frame: bytes) -> dict[str, object]:
    (length,) = struct.unpack_from("<I", frame, 6)
    result: dict[str, object] = json.loads(frame[10:10 + length])
    return result


# Round trips

@pytest.mark.parametrize("message", all_messages(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: wire.Message) -> None:
    frame = encode(message)
    decoded = decode(frame)
    assert same_message(decoded, message)
    assert encode(decoded) == frame  # the encoding is canonical


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in all_messages()} == set(MESSAGE_TYPES)


def test_tensors_decode_read_only_little_endian_and_aligned() -> None:
    message = forward(hidden=4, hidden_states=np.ones((2, 3, 4), dtype=">f4"))
    frame = encode(message)
    decoded = decode(frame)
    assert isinstance(decoded, Forward) and decoded.hidden_states is not None
    assert decoded.hidden_states.dtype == np.dtype("<f4")
    assert not decoded.hidden_states.flags.writeable
    assert np.array_equal(decoded.hidden_states, np.ones((2, 3, 4)))
    assert decoded.hidden_states.ctypes.data % 8 == np.frombuffer(frame, np.uint8).ctypes.data % 8
    assert decode(bytearray(frame)) is not None and decode(memoryview(frame)) is not None


def test_same_message_tells_tensors_apart() -> None:
    first = forward()
    assert same_message(first, first)
    other = forward(position_ids=first.position_ids + 1, input_ids=first.input_ids)
    assert not same_message(first, other)
    assert not same_message(first, StatusRequest())


# Message construction checks

@pytest.mark.parametrize("build, field", [
    (lambda: forward(beam_idx=np.arange(3)), "beam_idx"),
    (lambda: forward(position_ids=np.zeros((2, 3), np.int32)), "position_ids"),
    (lambda: forward(input_ids=np.zeros((2, 4), np.int64)), "input_ids"),
    (lambda: forward(hidden=4, hidden_states=np.zeros((2, 3, 4), np.float64)), "float64"),
    (lambda: forward(hidden=4, input_ids=np.zeros((2, 3), np.int64)), "exactly one"),
    (lambda: forward(input_ids=None), "exactly one"),
    (lambda: forward(stream_ids=(1, 1)), "stream_ids"),
    (lambda: forward(draft=DraftInfo((4, 0), np.zeros((2, 3), np.int64))), "draft count"),
    (lambda: forward(draft=DraftInfo((1,), np.zeros((1, 3), np.int64))), "draft rows"),
    (lambda: ForwardResult(1, 1, (1, 2), (1,), None), "accepted_counts"),
    (lambda: ForwardResult(1, 1, (1,), None, np.zeros((2, 1, 4), np.float32)), "logits"),
    (lambda: forward(logprobs=(0,)), "logprobs rows"),
    (lambda: forward(logprobs=(0, 21)), "logprobs must be -1 to 20, not 21"),
    (lambda: forward(logprobs=(-2, 0)), "logprobs must be -1 to 20, not -2"),
    (lambda: forward(logprobs=(-1, 0), scored_ids=np.array([[5, -1, -1], [-1, -1, -1]])), "need logprobs of 0"),
    (lambda: forward(scored_ids=np.array([[5, -1, -1], [-1, -1, -1]])), "need logprobs of 0"),
    (lambda: forward(logprobs=(0, 0), scored_ids=np.array([[5, -2, -1], [-1, -1, -1]])), "token ids or -1"),
    (lambda: forward(logprobs=(0, 0), scored_ids=np.zeros((2, 4), np.int64)), "scored_ids dim 1"),
    (lambda: ForwardResult(1, 1, (1,), None, None, scored_logprobs=np.zeros((1, 1), np.float32)), "scored_logprobs, "),
    (lambda: ForwardResult(1, 1, (1,), None, None, token_logprobs=np.zeros((1, 1), np.float32)), "come together"),
    (lambda: ForwardResult(1, 1, (1,), (2,), None, np.zeros((1, 2), np.float32), np.zeros((1, 2, 1), np.int64),
                           np.zeros((1, 2, 1), np.float32)), "token_logprobs has 2 columns for the 3 tokens"),
    (lambda: ForwardResult(1, 1, (1,), None, None, np.zeros((2, 1), np.float32), np.zeros((2, 1, 2), np.int64),
                           np.zeros((2, 1, 2), np.float32)), "token_logprobs dim 0"),
    (lambda: ForwardResult(1, 1, (1,), None, None, np.zeros((1, 2), np.float32), np.zeros((1, 1, 2), np.int64),
                           np.zeros((1, 1, 2), np.float32)), "top_logprob_ids dim 1"),
    (lambda: ForwardResult(1, 1, (1,), None, None, np.zeros((1, 1), np.float32), np.zeros((1, 1, 2), np.int64),
                           np.zeros((1, 1, 3), np.float32)), "top_logprobs dim 2"),
    (lambda: ForwardResult(1, 1, (1,), None, None, np.zeros((1, 1), np.float32), np.zeros((1, 1, 21), np.int64),
                           np.zeros((1, 1, 21), np.float32)), "21 alternatives, at most 20"),
    (lambda: StageRef("m", 3, 3), "layer_end"),
    (lambda: ReleaseMicroBatch(-1), "micro_batch_id"),
    (lambda: Register(AGENT, (), "ab" * 31), "register token_sha256"),
    (lambda: AddressesChanged(()), "addresses changed must list at least one address"),
    (lambda: AddressesChanged(("192.168.1.20:7443",) * (MAX_LISTEN_ADDRESSES + 1)),
     f"lists {MAX_LISTEN_ADDRESSES + 1} addresses, more than {MAX_LISTEN_ADDRESSES}"),
    (lambda: AddressesChanged(("[..]:1",)), r"address .\[\.\.\]:1. names no host"),
    (lambda: RevocationUpdate.of(("not-an-id",), (SIGNATURE,)), "removed agent id 'not-an-id' is not an agent id"),
    (lambda: RevocationUpdate.of((AGENT,), ()), "1 removed agents but 0 signatures"),
    (lambda: RevocationUpdate(RevocationUpdate.of((AGENT,), (SIGNATURE,)).records[:-1]), "116-byte records, not 115"),
    (lambda: RevocationUpdate(b"1" * 52 + SIGNATURE), "removed agent id '1111"),
    (lambda: RevocationUpdate(AGENT[:-1].encode() + b"\xff" + SIGNATURE), "is not an agent id"),
    (lambda: KnownRemovals(b""), "at least one agent"),
    (lambda: KnownRemovals.of((AGENT,) * (MAX_KNOWN_REMOVALS + 1), (SIGNATURE,) * (MAX_KNOWN_REMOVALS + 1)),
     f"at most {MAX_KNOWN_REMOVALS} removals, not {MAX_KNOWN_REMOVALS + 1}"),
    (lambda: ManifestEntry("../etc/passwd", SHA, 1), "file_name"),
    (lambda: ManifestEntry("a.bin", SHA.upper(), 1), "sha256"),
    (lambda: AssignStage(STAGE, True, True, "CPU", Precision.F16, None,
                         (ManifestEntry("a", SHA, 1), ManifestEntry("a", SHA, 2))), "twice"),
    (lambda: AssignStage(STAGE, True, True, "CPU", Precision.F16, None, (), "i4"), "kv_cache"),
    (lambda: AssignStage(STAGE, False, True, "CPU", Precision.F16, None, ()), "previous_agent_id"),
    (lambda: AssignStage(STAGE, True, True, "CPU", Precision.F16, None, (), previous_agent_id=AGENT),
     "previous_agent_id"),
    (lambda: AssignStage(STAGE, False, True, "CPU", Precision.F16, None, (), previous_agent_id="short"),
     "previous_agent_id is not an agent id"),
    (lambda: NextHop("host", AGENT), "host:port"),
    (lambda: NextHop("host:0", AGENT), "port"),
    (lambda: NextHop("host:1", "X" * 52), "agent_id"),
    (lambda: NextHop("host:1", AGENT, ("[fd62::30]",)), "host:port"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, ip_families=(4, 4)),
     "ip_families"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, ip_families=(5,)),
     "ip_families"),
    (lambda: NextHop("host:1", AGENT, tuple(f"10.0.0.{n}:7431" for n in range(MAX_OTHER_ADDRESSES + 1))),
     "16 other addresses, more than 15"),
    (lambda: Hello(1, "short", "0.1", Role.AGENT), "agent_id"),
    (lambda: ShardChunk(SHA, 10, 12, b"abc"), "total_size"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 1.5, None, None, None, None, (), None), "cpu_load"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, 101.0, None, None, None, (), None), "battery"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, devices=("cpu",)),
     "devices"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, shard_room_bytes=-1),
     "shard_room_bytes must be >= 0"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, clock_s=-1.0), "clock_s"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, clock_s=1e12), "clock_s"),
    (lambda: StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, None, None, (), None, devices=("CPU",) * 33),
     "devices"),
])
def test_inconsistent_messages_are_refused_by_name(build: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        build()  # type: ignore[operator]


def test_check_tensor_binds_named_dims() -> None:
    spec = TensorSpec(("float32", "float16"), ("B", "T", 64))
    sizes = check_tensor("hidden_states", np.zeros((2, 5, 64), np.float16), spec)
    assert sizes == {"B": 2, "T": 5}
    with pytest.raises(ProtocolError, match=r"hidden_states dim 1 \(T\) is 4, expected 5"):
        check_tensor("hidden_states", np.zeros((2, 4, 64), np.float32), spec, sizes)
    with pytest.raises(ProtocolError, match="dim 2"):
        check_tensor("hidden_states", np.zeros((2, 5, 32), np.float32), spec)
    with pytest.raises(ProtocolError, match="rank 3"):
        check_tensor("hidden_states", np.zeros((2, 5), np.float32), spec)
    with pytest.raises(ProtocolError, match="dtype int64"):
        check_tensor("hidden_states", np.zeros((2, 5, 64), np.int64), spec)
    with pytest.raises(ProtocolError, match="must be a tensor"):
        check_tensor("hidden_states", [1, 2], spec)
    with pytest.raises(ValueError):
        TensorSpec(("float64",), ("B",))


# Limits

def test_limits_are_enforced_on_both_sides() -> None:
    big = forward(hidden=1024)  # 2 * 3 * 1024 * 4 = 24 KiB of hidden states
    frame = encode(big)
    for limits, message in [
        (Limits(max_tensor_bytes=16 * 1024), "tensor 0 has 24576 bytes|tensor . has 24576 bytes"),
        (Limits(max_frame_bytes=20 * 1024), "exceeds limit"),
        (Limits(max_tensors=2), "3 tensors exceed limit 2"),
        (Limits(max_header_bytes=64), "header of .* bytes exceeds limit 64"),
        (Limits(max_rank=2), "at most 2 dims"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            encode(big, limits)
        with pytest.raises(ProtocolError, match=message):
            decode(frame, limits)


def test_shape_product_is_checked_before_any_allocation() -> None:
    huge = raw_frame({"type": "ShardChunk", "tensors": [{"dtype": "float32", "shape": [1 << 28] * 4}],
                      "fields": {"sha256": SHA, "offset": 0, "total_size": 0, "data": 0}})
    with pytest.raises(ProtocolError, match="limit"):
        decode(huge)


# Malformed frames

def test_every_truncation_is_a_protocol_error() -> None:
    frame = encode(forward(hidden=4))
    for end in range(len(frame)):
        with pytest.raises(ProtocolError):
            decode(frame[:end])
    with pytest.raises(ProtocolError, match="after its last part"):
        decode(frame + b"\0")


def test_bad_prefixes() -> None:
    frame = encode(StatusRequest())
    with pytest.raises(ProtocolError, match="magic"):
        decode(b"XXXX" + frame[4:])
    with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION + 1} is not supported"):
        decode(frame[:4] + struct.pack("<H", PROTOCOL_VERSION + 1) + frame[6:])
    with pytest.raises(ProtocolError, match="runs past the frame end"):
        decode(frame[:6] + struct.pack("<I", 4096) + frame[10:])


def chunk_header(**changes: object) -> dict[str, object]:
    header: dict[str, object] = {
        "type": "ShardChunk", "tensors": [{"dtype": "uint8", "shape": [3]}],
        "fields": {"sha256": SHA, "offset": 0, "total_size": 3, "data": 0}}
    header.update(changes)
    return header


def chunk_fields(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = {"sha256": SHA, "offset": 0, "total_size": 3, "data": 0}
    fields.update(changes)
    return chunk_header(fields=fields)


PAYLOAD = b"abc"


@pytest.mark.parametrize("frame, message", [
    (raw_frame(chunk_header(), PAYLOAD), None),
    (raw_frame(b"{not json", PAYLOAD), "not valid JSON"),
    (raw_frame(b"\xff\xfe", PAYLOAD), "not valid JSON"),
    (raw_frame(b"[" * 100_000, PAYLOAD), "not valid JSON"),
    (raw_frame(b'{"type": 1e999999999}', PAYLOAD), "type"),
    (raw_frame(json.dumps(chunk_fields()).replace('"offset": 0', '"offset": ' + "9" * 5000).encode(),
               PAYLOAD), "not valid JSON"),
    (raw_frame(b'{"type": "ShardChunk", "type": "Error", "fields": {}, "tensors": []}'), "repeats a key"),
    (raw_frame(chunk_header(extra=1), PAYLOAD), "exactly type, fields and tensors"),
    (raw_frame(chunk_header(type="Pickle"), PAYLOAD), "not a known message type"),
    (raw_frame(chunk_header(type="MessageTypes"), PAYLOAD), "not a known message type"),
    (raw_frame(chunk_header(tensors={}), PAYLOAD), "tensors must be a list"),
    (raw_frame(chunk_header(tensors=[{"dtype": "object", "shape": [3]}]), PAYLOAD), "dtype 'object'"),
    (raw_frame(chunk_header(tensors=[{"dtype": "float64", "shape": [3]}]), PAYLOAD), "dtype 'float64'"),
    (raw_frame(chunk_header(tensors=[{"dtype": "uint8", "shape": [-3]}]), PAYLOAD), "bad dim"),
    (raw_frame(chunk_header(tensors=[{"dtype": "uint8", "shape": [True]}]), PAYLOAD), "bad dim"),
    (raw_frame(chunk_header(tensors=[{"dtype": "uint8", "shape": "3"}]), PAYLOAD), "shape must be a list"),
    (raw_frame(chunk_header(tensors=[{"dtype": "uint8"}]), PAYLOAD), "exactly dtype and shape"),
    (raw_frame(chunk_header(tensors=[{"dtype": "uint8", "shape": [1, 3]}]), PAYLOAD), "1-D uint8"),
    (raw_frame(chunk_header(tensors=[{"dtype": "bool", "shape": [3]}]), b"\0\1\2"), "bool"),
    (raw_frame(chunk_header(tensors=[]), b""), "tensor index below 0"),
    (raw_frame(chunk_header(tensors=[{"dtype": "uint8", "shape": [3]}] * 2), PAYLOAD + bytes(5) + PAYLOAD),
     r"tensors \[1\] are not referenced"),
    (raw_frame(chunk_fields(offset=True), PAYLOAD), "offset must be int"),
    (raw_frame(chunk_fields(offset=1.0), PAYLOAD), "offset must be int"),
    (raw_frame(chunk_fields(offset=1 << 64), PAYLOAD), "int64 range"),
    (raw_frame(chunk_fields(offset=-1), PAYLOAD), "offset must be >= 0"),
    (raw_frame(chunk_fields(sha256=None), PAYLOAD), "sha256 must be str"),
    (raw_frame(chunk_fields(sha256="\ud800"), PAYLOAD), "surrogate"),
    (raw_frame(chunk_fields(data="YWJj"), PAYLOAD), "tensor index"),
    (raw_frame(chunk_header(fields={"sha256": SHA, "offset": 0, "data": 0}), PAYLOAD),
     r"missing fields \['total_size'\]"),
    (raw_frame(chunk_header(fields=[]), PAYLOAD), "must be an object"),
    (raw_frame(chunk_fields(__class__=0), PAYLOAD), r"unknown fields \['__class__'\]"),
])
def test_malformed_headers_are_named(frame: bytes, message: str | None) -> None:
    if message is None:
        assert decode(frame) == ShardChunk(SHA, 0, 3, PAYLOAD)
        return
    with pytest.raises(ProtocolError, match=message):
        decode(frame)


def split(frame: bytes) -> tuple[dict[str, object], bytes]:
    """A frame's header and the bytes after the header (padding and tensors)."""
    (length,) = struct.unpack_from("<I", frame, 6)
    return header_of(frame), frame[10 + length:]


def test_json_constants_are_refused() -> None:
    status = header_of(encode(all_messages()[3]))
    for value, message in [("NaN", "NaN"), ("Infinity", "Infinity"), ("1e999", "finite")]:
        text = json.dumps(status, separators=(",", ":")).replace('"cpu_load":0.25', f'"cpu_load":{value}')
        with pytest.raises(ProtocolError, match=message):
            decode(raw_frame(text.encode()))


@pytest.mark.parametrize("delta, error", [
    ({"kind": "Exec", "fields": {}}, "kind 'Exec'"),
    ({"kind": "Forward", "fields": {}}, "kind 'Forward'"),
    ({"kind": "AdmitRow"}, "exactly kind and fields"),
    ({"kind": "AdmitRow", "fields": {"live_slots": "1"}}, "live_slots must be int"),
    ({"kind": "Compact", "fields": {"new_slots": 1, "keep": [[[0, 1, 2]]]}}, "exactly 2 items"),
])
def test_slot_deltas_are_a_closed_set(delta: dict[str, object], error: str) -> None:
    header, payload = split(encode(forward(rows=1, tokens=1, slot_deltas=(AdmitRow(1),), admit_from=(2,))))
    fields = header["fields"]
    assert isinstance(fields, dict)
    fields["slot_deltas"] = [delta]
    with pytest.raises(ProtocolError, match=error):
        decode(raw_frame(header, payload))


def test_nonzero_padding_is_refused() -> None:
    two = chunk_header(tensors=[{"dtype": "uint8", "shape": [3]}] * 2,
                       fields={"sha256": SHA, "offset": 0, "total_size": 3, "data": 1})
    with pytest.raises(ProtocolError, match="tensors \\[0\\] are not referenced"):
        decode(raw_frame(two, PAYLOAD + bytes(5) + PAYLOAD))
    with pytest.raises(ProtocolError, match="padding before tensor 1"):
        decode(raw_frame(two, PAYLOAD + b"\0\0\1\0\0" + PAYLOAD))


def test_encode_refuses_what_the_receiver_would_refuse() -> None:
    with pytest.raises(ProtocolError, match="not a wire message"):
        encode(STAGE)
    with pytest.raises(ProtocolError, match="temperature_c nan"):
        StatusReport(AgentState.AVAILABLE, 1, 0.5, None, None, float("nan"), None, (), None)
    with pytest.raises(ProtocolError, match="data does not hold"):
        encode(ShardChunk(SHA, 0, 3, bytearray(b"abc")))


# Fuzzing: any bytes give a message or ProtocolError

VALID_FRAMES = [encode(m) for m in all_messages()]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID_FRAMES), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)),
                                               min_size=1, max_size=6), st.integers(0, 1 << 16))
def test_fuzz_mutated_frames(frame: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    mutated = bytearray(frame)
    for position, value in flips:
        mutated[position % len(mutated)] = value
    try:
        decode(bytes(mutated[:max(cut, len(mutated) // 2)]))
    except ProtocolError:
        pass


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4),
                    max_leaves=12)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.sampled_from(VALID_FRAMES), st.sampled_from(["fields", "tensors", "type"]), JSON,
       st.binary(max_size=64))
def test_fuzz_structured_headers(frame: bytes, key: str, value: object, payload: bytes) -> None:
    header = header_of(frame)
    fields = header["fields"]
    if key == "fields" and isinstance(fields, dict) and fields and isinstance(value, dict | list):
        fields[sorted(fields)[0]] = value
    else:
        header[key] = value
    try:
        decode(raw_frame(header, payload))
    except ProtocolError:
        pass


def test_forward_with_sampled_draft_round_trips() -> None:
    draft = DraftInfo((2, 0), np.array([[5, 6], [0, 0]], dtype=np.int64),
                      RNG.random((2, 2, 11), dtype=np.float32))
    sampling = SamplingInfo((0.7, 0.0), (0, 5), (0.9, 1.0), (12345, 7))
    message = forward(draft=draft, sampling=sampling)
    assert same_message(decode(encode(message)), message)


def test_admit_rows_need_one_source_each() -> None:
    with pytest.raises(ProtocolError, match="AdmitRow deltas but 0 sources"):
        forward(admit_from=())


def test_kept_sources_round_trip_one_flag_per_admitted_source() -> None:
    message = forward(keep_sources=(True,))
    decoded = decode(encode(message))
    assert decoded.keep_sources == (True,) and same_message(decoded, message)
    assert decode(encode(forward())).keep_sources == ()
    with pytest.raises(ProtocolError, match="2 keep_sources for 1 admitted sources"):
        forward(keep_sources=(True, False))


def test_logits_adjustments_round_trip_and_are_checked_by_name() -> None:
    from deskfleet.common.logits_adjust import RowAdjust
    from deskfleet.common.wire import LogitsAdjust
    row = RowAdjust(0.5, -1.0, np.array([3, 9]), np.array([1, 4]), np.array([7]), np.array([2.5], dtype=np.float32))
    adjust = LogitsAdjust.of([row, None])
    assert adjust is not None and adjust.row(1) is None
    message = forward(adjust=adjust)
    decoded = decode(encode(message))
    assert same_message(decoded, message) and decoded.adjust is not None
    again = decoded.adjust.row(0)
    assert again is not None and again.counted_ids.tolist() == [3, 9] and again.counts.tolist() == [1, 4]
    assert again.bias_ids.tolist() == [7] and again.biases.tolist() == [2.5] and again.frequency == -1.0
    assert LogitsAdjust.of([None, None]) is None
    with pytest.raises(ProtocolError, match="logits adjustment rows differ"):
        forward(adjust=LogitsAdjust.of([row]))
    with pytest.raises(ProtocolError, match=r"a penalty must be from -2\.0 to 2\.0"):
        LogitsAdjust.of([RowAdjust(3.0, 0.0, row.counted_ids, row.counts, row.bias_ids, row.biases)])
    with pytest.raises(ProtocolError, match="counted tokens repeat a token"):
        LogitsAdjust.of([RowAdjust(0.5, 0.0, np.array([3, 3]), row.counts, row.bias_ids, row.biases)])
    with pytest.raises(ProtocolError, match="a logit bias must be from"):
        LogitsAdjust.of([RowAdjust(0.5, 0.0, row.counted_ids, row.counts, row.bias_ids,
                                   np.array([150.0], dtype=np.float32))])
    with pytest.raises(ProtocolError, match="adjusted token ids must be from 0 to"):
        LogitsAdjust.of([RowAdjust(0.5, 0.0, np.array([3, 2**62]), row.counts, row.bias_ids, row.biases)])
    with pytest.raises(ProtocolError, match="biased tokens repeat a token"):
        LogitsAdjust.of([row, RowAdjust(0.0, 0.0, row.counted_ids, row.counts, np.array([4, 4]),
                                        np.array([1.0, 2.0], dtype=np.float32))])
    assert LogitsAdjust.of([row, row]) is not None  # the same tokens in two rows are no repeat
    with pytest.raises(ProtocolError, match="count must be from 1 to"):
        LogitsAdjust.of([RowAdjust(0.5, 0.0, row.counted_ids, np.array([0, 1]), row.bias_ids, row.biases)])


def test_the_largest_step_a_driver_sends_fits_the_codecs_tensor_limit() -> None:
    """A sampled step drafted by a draft model (its q travels) with penalties and a bias, between two stages: the
    adjustment's three tensors on top of the step's five stay within DEFAULT_LIMITS (8 tensors: with the counts and
    their ids apart it took 9, and the fleet's network thread failed on it)."""
    from deskfleet.common.logits_adjust import RowAdjust
    from deskfleet.common.wire import LogitsAdjust
    row = RowAdjust(0.5, 1.0, np.array([3, 9]), np.array([1, 4]), np.array([7]), np.array([2.5], dtype=np.float32))
    draft = DraftInfo((2, 0), np.array([[5, 6], [0, 0]], dtype=np.int64), RNG.random((2, 2, 11), dtype=np.float32))
    message = forward(hidden=16, draft=draft, sampling=SamplingInfo((0.7, 1.0), (0, 5), (0.9, 1.0), (1, 2)),
                      adjust=LogitsAdjust.of([row, row]))  # (scored_ids ride on prefill steps, which never draft)
    assert same_message(decode(encode(message)), message)


def test_copied_rows_round_trip_with_their_new_micro_batches() -> None:
    from deskfleet.common.wire import CopyRow
    deltas = (CopyRow(1), ReorderRows((0,)), AppendSlots(3, (3,), (9,)))
    message = forward(rows=1, slot_deltas=deltas, copy_into=(12,))
    decoded = decode(encode(message))
    assert same_message(decoded, message) and decoded.copy_into == (12,)
    assert isinstance(decoded.slot_deltas[0], CopyRow) and decoded.slot_deltas[0].row == 1
    with pytest.raises(ProtocolError, match="1 CopyRow deltas but 0 new micro-batches"):
        forward(rows=1, slot_deltas=deltas)
    with pytest.raises(ProtocolError, match="copy_into repeats a micro-batch, or names the step's own"):
        forward(rows=1, slot_deltas=deltas, copy_into=(7,))
    # a stage short of memory for the copies made none: so do the stages after it, and the result says so
    dropped = forward(rows=1, slot_deltas=deltas, copy_into=(12,), copies_dropped=True)
    assert decode(encode(dropped)).copies_dropped and not decoded.copies_dropped
    with pytest.raises(ProtocolError, match="copies_dropped on a step that copies no row"):
        forward(rows=1, copies_dropped=True)
    result = ForwardResult(7, 3, (5,), None, None, copies_dropped=True)
    assert decode(encode(result)).copies_dropped  # type: ignore[union-attr]
    assert not decode(encode(ForwardResult(7, 3, (5,), None, None))).copies_dropped  # type: ignore[union-attr]


def test_sampling_rows_must_match_the_stream_count() -> None:
    with pytest.raises(ProtocolError, match="sampling rows differ"):
        forward(sampling=SamplingInfo((0.7,), (0,), (1.0,), (1,)))


def test_tensor_fields_are_recognised_however_numpy_spells_ndarray() -> None:
    # numpy 2.5 made npt.NDArray a `type` alias (TypeAliasType): get_origin(NDArray[X]) is then the alias,
    # not np.ndarray, and a codec that compared origins refused every tensor field on the wire.
    from typing import Any, TypeVar

    import numpy.typing as npt
    from typing_extensions import TypeAliasType

    from deskfleet.common.wire_codec import _is_tensor

    scalar = TypeVar("scalar", bound=np.generic)
    alias = TypeAliasType("NDArrayLike", np.ndarray[Any, np.dtype[scalar]], type_params=(scalar,))
    assert _is_tensor(npt.NDArray[np.generic])
    assert _is_tensor(np.ndarray[Any, np.dtype[np.int64]])
    assert _is_tensor(alias[np.generic])
    assert not _is_tensor(tuple[int, ...]) and not _is_tensor(int) and not _is_tensor(bytes)


@pytest.mark.parametrize("address", ["[..]:19399", "a..b:1", "[::::::]:1", "[.1]:1", "x" * 64 + ".corp:1", ".:1"])
def test_an_address_whose_host_cannot_be_dialled_is_refused(address: str) -> None:
    # an enrolled agent registered "[..]:19399": every survey (fleet ls, plan, deploy, a re-plan) then failed on the
    # resolver's UnicodeError or ValueError, for as long as the roster kept it
    with pytest.raises(ProtocolError, match="names no host that can be dialled"):
        wire.parse_address(address)
    assert wire.parse_address("pc-7.corp.:7431") == ("pc-7.corp.", 7431)  # a fully qualified name's dot is taken
    assert wire.parse_address("[10.0.0.5]:7341") == ("10.0.0.5", 7341)  # an IPv4 address in brackets, as before


def test_addresses_need_a_port_and_port_zero_only_to_listen() -> None:
    assert wire.parse_address("10.0.0.5:8765") == ("10.0.0.5", 8765)
    assert wire.parse_address("[::1]:0", any_port=True) == ("::1", 0)
    for text, message in (("10.0.0.5:0", "between 1 and 65535"), ("10.0.0.5", "not host:port"),
                          ("host:70000", "between 1 and 65535")):
        with pytest.raises(ProtocolError, match=message):
            wire.parse_address(text)
    with pytest.raises(ProtocolError, match="between 0 and 65535"):
        wire.parse_address("host:x", any_port=True)
    # an IPv6 address without its brackets: said how to write it
    for text, hint in (("::1:7341", " (an IPv6 host goes in brackets: [::1]:7341 or [::1:7341]:PORT)"),
                       ("fe80::1", " (an IPv6 host goes in brackets: [fe80::1]:PORT)"),  # no port given
                       ("2001:db8::5:8765", " (an IPv6 host goes in brackets: [2001:db8::5]:8765 or "
                                            "[2001:db8::5:8765]:PORT)"),
                       ("::", " (an IPv6 host goes in brackets: [::]:PORT)"), ("host:name:80", ""), ("a b:1", ""),
                       # a zone names one PC's interface: said why it is refused
                       ("[fe80::1%eth0]:80", " (an IPv6 address with a zone, '%eth0', names an interface of one PC: "
                                             "give a global or unique-local IPv6 address, an IPv4 address or a host "
                                             "name, which every PC can dial)"),
                       ("[fe80::1%]:80", ""), ("[pc%eth0]:80", "")):
        with pytest.raises(ProtocolError, match=f"^{re.escape(f'address {text!r} is not host:port{hint}')}$"):
            wire.parse_address(text)


def test_a_host_alone_takes_the_default_port_and_an_error_names_the_text_as_given() -> None:
    assert wire.parse_address("pc-7", default_port=7431) == ("pc-7", 7431)
    assert wire.parse_address("[::1]", default_port=7431) == ("::1", 7431)
    assert wire.parse_address("pc-7:80", default_port=7431) == ("pc-7", 80)
    # the error quoted 'bad host:7431', a port the user never wrote
    with pytest.raises(ProtocolError, match=r"^address 'bad host' is not host:port$"):
        wire.parse_address("bad host", default_port=7431)
    with pytest.raises(ProtocolError, match=r"^address 'pc-7:99999' has no port between 1 and 65535$"):
        wire.parse_address("pc-7:99999", default_port=7431)


def test_the_most_known_removals_a_message_carries_fit_the_frames_the_controllers_port_reads() -> None:
    from deskfleet.agent.link import ENROLLMENT_MAX_FRAME_BYTES

    most = KnownRemovals.of(("z" * 52,) * MAX_KNOWN_REMOVALS, (b"\xff" * 64,) * MAX_KNOWN_REMOVALS)
    assert len(encode(most)) <= ENROLLMENT_MAX_FRAME_BYTES


@pytest.mark.parametrize(("given", "taken"), [
    ("10.0.0.5", "10.0.0.5:7431"),  # `--listen 10.0.0.5` was "not host:port"
    ("pc-7.office.lan", "pc-7.office.lan:7431"),
    ("[fe80::1]", "[fe80::1]:7431"),
    ("10.0.0.5:9000", "10.0.0.5:9000"),  # a port given stays
    ("[::1]:9000", "[::1]:9000"),
    ("::1", "::1"),  # an IPv6 address without its brackets: left for parse_address to refuse, with its hint
    ("", ""),  # an unset variable's: refused as before, never taken for every interface
])
def test_a_host_without_its_port_takes_the_default_one(given: str, taken: str) -> None:
    from deskfleet.common.wire import with_default_port

    assert with_default_port(given, 7431) == taken


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:7341", True), ("127.8.9.10:1", True), ("[::1]:7341", True), ("localhost:7341", True),
    ("10.0.0.5:7341", False), ("[fe80::1]:7341", False), ("controller-pc:7341", False),  # a name may resolve anywhere
    ("127.0.0.1", False), ("not an address", False),  # no port: no address
])
def test_loopback_addresses_are_told_apart(address: str, loopback: bool) -> None:
    assert wire.is_loopback_address(address) is loopback


def test_a_protocol_error_quotes_what_the_peer_sent_500_characters_at_most() -> None:
    # a stranger's JoinRequest with a field name of 60,000 characters wrote that much to the controller's log a try
    from deskfleet.common.wire_codec import _ALIGN, _PREFIX, MAGIC

    header = json.dumps({"type": "JoinRequest", "fields": {"x" * 60_000: 1}, "tensors": []}).encode()
    header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)
    frame = _PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(header)) + header
    with pytest.raises(ProtocolError) as refused:
        wire.decode(frame)
    assert "unknown fields ['xxx" in str(refused.value) and len(str(refused.value)) <= 500


def test_host_port_brackets_an_ipv6_host_as_parse_address_reads_it() -> None:
    for host in ("10.0.0.5", "fd61::1", "pc-7.office.example", "::1"):
        assert wire.parse_address(wire.host_port(host, 7431)) == (host, 7431)
    assert wire.host_port("fd61::1", 7431) == "[fd61::1]:7431" and wire.host_port("10.0.0.5", 80) == "10.0.0.5:80"


def test_a_next_hops_addresses_start_with_the_one_the_controller_reached_each_once() -> None:
    hop = NextHop("10.0.0.9:7431", AGENT, ("[fd62::30]:7431", "10.0.0.9:7431", "[fd62::31]:7431"))
    assert hop.addresses == ("10.0.0.9:7431", "[fd62::30]:7431", "[fd62::31]:7431")
    assert NextHop("10.0.0.9:7431", AGENT).addresses == ("10.0.0.9:7431",)


def test_ip_families_of_addresses_and_none_where_one_may_be_either() -> None:
    assert ip_families(["10.0.0.9:7431", "[fd62::30]:7431"]) == {4, 6}
    assert ip_families(["[fd62::30]:7431", "[fd62::31]:7431"]) == {6}
    assert ip_families(["10.0.0.9:7431", "desk-9.office.example:7431"]) is None  # a name resolves to either
    assert ip_families(["127.0.0.1:7431"]) is None and ip_families(["[::1]:7431"]) is None
    assert ip_families([]) is None and ip_families(["not an address"]) is None
    assert ip_families(["[::ffff:10.0.0.9]:7431"]) == {4} and ip_families(["[::ffff:127.0.0.1]:7431"]) is None
