"""The closed set of messages that travel between the controller and the agents.

Every message is a frozen dataclass. Constructing one checks what the fields must satisfy together
(row counts agree, ranges are ordered, hashes look like sha256) and raises ProtocolError naming the
field, so a message that exists is a message the receiver can act on. Encoding and decoding live in
`wire_codec`; this module knows nothing about bytes on the wire.

Tensors are numpy arrays; decoded ones are read-only views over the received frame, so a receiver
that wants to write into one must copy it first.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Self, TypeGuard

import numpy as np

from deskfleet.common.agent_state import AgentState, UnavailableReason
from deskfleet.common.kv_ledger import AdmitRow, CopyRow, SlotDelta
from deskfleet.common.logits_adjust import MAX_BIAS, MAX_BIASED_TOKENS, MAX_PENALTY, RowAdjust
from deskfleet.common.logprobs import MAX_TOP_LOGPROBS
from deskfleet.common.wire_tensors import ProtocolError, Tensor, TensorSpec, check_tensor

# 2: DraftInfo.one_hot; 3: Forward.layer_start, Error.micro_batch_id and agent_id; 4: Forward.model_id,
# StatusReport.reasons and detail; 5: AssignStage.previous_agent_id; 6: RevocationUpdate as records signed by
# the CA, KnownRemovals, Register.token_sha256; 7: StatusReport.devices; 8: ResultsHere's micro-batch id range,
# ErrorCode.DISK_FULL; 9: Forward.logprobs, ForwardResult.token_logprobs, top_logprob_ids and top_logprobs;
# 10: Forward.scored_ids, ForwardResult.scored_logprobs, scored_top_ids and scored_top_logprobs; 11:
# Forward.keep_sources (an admitted row's source micro-batch kept: a prefix cache's entry); 12: Forward.adjust
# (presence and frequency penalties, logit bias), CopyRow and Forward.copy_into (a finished row's state kept); 13:
# Forward.copies_dropped and ForwardResult.copies_dropped (a stage short of memory for a step's copies makes none);
# 14: StatusReport.shard_room_bytes (a plan leaves out a PC whose shard cache has no room for a stage) and
# StatusReport.clock_s (`fleet ls` warns of a PC whose clock is off the controller's); 15: NextHop.other_addresses (a
# stage dials the next PC at an address of a family its own PC has) and StatusReport.ip_families; 16:
# AddressesChanged (an agent's addresses changed while its registration link stayed up)
PROTOCOL_VERSION = 16
MAX_STATUS_DETAIL = 500
MAX_DEVICES = 32  # a StatusReport's devices
_DEVICE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,15}(\.[0-9]{1,3})?")  # as OpenVINO lists them: "CPU", "GPU.1"

_SHA256 = re.compile(r"[0-9a-f]{64}")
# what wire_text escapes: C0 controls but the newline and the tab, DEL, C1 controls, and the bidirectional
# overrides and isolates (which make a terminal show text in another order than it reads)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# A removal on the wire: the removed agent's id (52 ASCII characters), then the CA's signature of its removal
# (common/pki.py's sign_removal, 64 bytes). Bytes, not JSON: the codec's 256 KB header held ~1,400 of them as hex.
AGENT_ID_CHARS = 52
REMOVAL_SIGNATURE_BYTES = 64
REMOVAL_RECORD_BYTES = AGENT_ID_CHARS + REMOVAL_SIGNATURE_BYTES
# A KnownRemovals' records, 46 KB at most: under the 64 KB frames the controller's port reads from agents.
MAX_KNOWN_REMOVALS = 400
# A RevocationUpdate's, 11.6 MB: any member may send one (refused after decoding, as not the controller's), and
# one of the 320 MB a frame may hold took seconds to check. Checked by one regex, in C: a regex and a slice per
# record in Python took 0.7 s for 64 MB.
MAX_REMOVALS = 100_000
_REMOVAL_RECORDS = re.compile(rb"(?:[a-z2-7]{52}[\x00-\xff]{64})*")
# An agent id is the unpadded lowercase base32 of sha256(SubjectPublicKeyInfo DER): 52 characters,
# short enough to be one DNS label, so it can sit in a certificate's subjectAltName.
_AGENT_ID = re.compile(r"[a-z2-7]{52}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


# Public helpers shared by the message checks and by pki

def is_agent_id(text: str) -> bool:
    """True when `text` has the agent id form (52 lowercase base32 characters)."""
    return _AGENT_ID.fullmatch(text) is not None


def is_sha256_hex(value: object) -> TypeGuard[str]:
    """True when `value` is a sha256 as the protocol and the data files write it (64 lowercase hex characters)."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def parse_address(text: str, any_port: bool = False, default_port: int | None = None) -> tuple[str, int]:
    """Split "host:port" (IPv6 hosts in brackets) into (host, port); ProtocolError if malformed.

    `any_port`: an address to listen on, where port 0 asks for any free port. `default_port`: a host alone takes it
    (with_default_port); an error names the text as given, not with the port added."""
    address = text if default_port is None else with_default_port(text, default_port)
    host, separator, port_text = address.rpartition(":")
    if not separator or _HOST.fullmatch(host) is None:
        raise ProtocolError(f"address {text[:300]!r} is not host:port{_bracket_hint(address) or _zone_hint(host)}")
    if not _dialable(host):
        raise ProtocolError(f"address {text[:300]!r} names no host that can be dialled (an IPv4 address, an IPv6 "
                            "address in brackets, or a name of dot-separated labels of 1 to 63 characters)")
    lowest = 0 if any_port else 1
    port = _port_number(port_text)
    if port is None or not lowest <= port < 65536:
        raise ProtocolError(f"address {text[:300]!r} has no port between {lowest} and 65535")
    return host.strip("[]"), port


def is_loopback_address(address: str) -> bool:
    """Whether host:port `address` names this host's loopback ("localhost", 127.0.0.0/8, ::1); False for a host
    name (it may resolve anywhere) and for text that is no address."""
    try:
        host, _ = parse_address(address)
    except ProtocolError:
        return False
    return is_loopback_host(host)


def listens_everywhere(host: str) -> bool:
    """Whether a listen host means every interface ("0.0.0.0", "::"): of both IP families where the PC has IPv6."""
    return host in ("0.0.0.0", "::", "")


def is_loopback_host(host: str) -> bool:
    """Whether `host` ("localhost", an IP address without brackets) is this host's loopback; False for another
    host name (it may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ip_families(addresses: Sequence[str]) -> frozenset[int] | None:
    """The IP versions (4, 6) of host:port `addresses`; None where one is a host name or a loopback address, which
    may be dialled over either family, or none is given."""
    families = set()
    for address in addresses:
        try:
            ip = ipaddress.ip_address(parse_address(address)[0])
        except (ProtocolError, ValueError):  # a host name, or no address at all
            return None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # [::ffff:10.0.0.1] is IPv4
            ip = ip.ipv4_mapped
        if ip.is_loopback:
            return None
        families.add(ip.version)
    return frozenset(families) or None


def host_port(host: str, port: int) -> str:
    """"host:port" as parse_address reads it: an IPv6 host in brackets ("[fd61::1]:7431")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def with_default_port(text: str, port: int) -> str:
    """`text` with `port` added where it names a host alone ("10.0.0.5", "pc-7", "[fe80::1]"): `--listen 10.0.0.5`
    was refused as "not host:port", the port being the one the command would pick anyway. Anything else is returned
    as it is, for parse_address to take or refuse."""
    bracketed = text.startswith("[") and text.endswith("]")
    return f"{text}:{port}" if text.strip() and (bracketed or ":" not in text) else text


def _bracket_hint(text: str) -> str:
    """How to write an IPv6 address that was given without its brackets ("::1:7341"), or "": the last group may
    be its port ([::1]:7341), or the whole text the address itself, with no port yet ([fe80::1]:PORT)."""
    host, _, port = text.rpartition(":")
    forms = []
    if _is_ipv6(host) and _port_number(port) is not None:
        forms.append(f"[{host}]:{port}")
    if _is_ipv6(text):
        forms.append(f"[{text}]:PORT")
    return f" (an IPv6 host goes in brackets: {' or '.join(forms)})"[:300] if forms else ""


def _zone_hint(host: str) -> str:
    """Why an IPv6 address with a zone ("[fe80::1%eth0]") is refused, or "": its zone names an interface of one PC,
    which another PC's differs from, so it is no address to hand around."""
    address, percent, zone = host.strip("[]").partition("%")
    if not percent or not zone or not _is_ipv6(address):
        return ""
    return (f" (an IPv6 address with a zone, {'%' + zone[:40]!r}, names an interface of one PC: give a global or "
            "unique-local IPv6 address, an IPv4 address or a host name, which every PC can dial)")


def _dialable(host: str) -> bool:
    """Whether `host` (as _HOST matched it) can be dialled: a bracketed IPv6 address, an IPv4 address, or a DNS name
    whose labels are 1-63 characters. An enrolled agent that registered "[..]" or "a..b" made every survey (`fleet
    ls`, `plan`, `deploy`, a run's re-plan) fail on the resolver's error, for as long as the roster kept it."""
    if host.startswith("["):  # an IPv6 address, or an IPv4 one in brackets, as the pattern always took
        try:
            ipaddress.ip_address(host[1:-1])
        except ValueError:
            return False
        return True
    name = host[:-1] if host.endswith(".") else host  # a fully qualified name's trailing dot
    return all(0 < len(label) <= 63 for label in name.split("."))


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def _port_number(text: str) -> int | None:
    """The number `text` spells in ASCII digits, or None; more than 5 significant digits is no port (and
    int() refuses strings past 4300 digits with a plain ValueError)."""
    if not text.isascii() or not text.isdigit():
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= 5 else None


def check_devices(devices: tuple[str, ...]) -> None:
    """ProtocolError unless `devices` are at most MAX_DEVICES device names as OpenVINO lists them."""
    _require(len(devices) <= MAX_DEVICES and all(_DEVICE_NAME.fullmatch(name) for name in devices),
             f"devices must be at most {MAX_DEVICES} OpenVINO device names, got {list(devices)[:8]!r}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ProtocolError(message)


def _non_negative(name: str, value: int) -> None:
    _require(value >= 0, f"{name} must be >= 0, got {value}")


def wire_text(text: str) -> str:
    """`text` as UTF-8 can carry it and a terminal shows it: a lone surrogate (os.fsdecode of a file name that is
    not UTF-8, which an exception's message may quote) becomes its backslash escape, and so does a control
    character other than a newline or a tab (an ESC that would run a terminal escape where the controller prints
    the text, a carriage return that would overwrite its line). Free text that a peer reports (an Error's message,
    a status's last error and detail) passes through here, on encode and on decode, so a frame is never refused
    for it and no enrolled PC sends the admin's terminal an escape."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(lambda match: match[0].encode("unicode_escape").decode("ascii"), text)


def _sha256(name: str, value: str) -> None:
    _require(_SHA256.fullmatch(value) is not None, f"{name} must be 64 lowercase hex characters")


def _fraction(name: str, value: float | None) -> None:
    _require(value is None or 0.0 <= value <= 1.0, f"{name} must be within [0, 1], got {value}")


# Enums

class Role(str, Enum):
    CONTROLLER = "controller"
    AGENT = "agent"


class ErrorCode(str, Enum):
    BAD_MESSAGE = "bad_message"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNAUTHORIZED = "unauthorized"
    NOT_ASSIGNED = "not_assigned"
    BUSY = "busy"
    OUT_OF_MEMORY = "out_of_memory"
    # the disk under the agent's shard cache has no room left, or the cache's cache_limit_bytes (protocol 8)
    DISK_FULL = "disk_full"
    SHARD_MISMATCH = "shard_mismatch"
    JOIN_REFUSED = "join_refused"
    INTERNAL = "internal"


class Precision(str, Enum):
    DEVICE_DEFAULT = "device_default"  # --precision fast: the agent compiles with its Precision.FAST (agent/stage.py)
    F16 = "f16"
    F32 = "f32"  # INFERENCE_PRECISION_HINT=f32 and KV_CACHE_PRECISION=f32


MAX_LISTEN_ADDRESSES = 16  # a Register's addresses
MAX_OTHER_ADDRESSES = MAX_LISTEN_ADDRESSES - 1  # a NextHop's other_addresses: with its address, a Register's worth
# An agent frees a micro-batch no step has used for this long (its driver is gone); a driver that keeps one between
# runs (a chat's KV state between turns) resumes it only well within this.
MICRO_BATCH_IDLE_S = 600.0
KV_CACHE_PRECISIONS = ("u8", "f16", "bf16", "f32")  # what OpenVINO's KV_CACHE_PRECISION takes


# What each tensor field must look like (made once: these are checked for every message)
_DRAFT_TOKEN_IDS = TensorSpec(("int64",), ("B", "K"))
_DRAFT_PROBS = TensorSpec(("float32",), ("B", "K", "V"))
_BEAM_IDX = TensorSpec(("int64", "int32"), ("B",))
_TOKENS_BY_ROW = TensorSpec(("int64",), ("B", "T"))  # position_ids, input_ids
_HIDDEN_STATES = TensorSpec(("float32", "float16"), ("B", "T", "H"))
_LOGITS = TensorSpec(("float32", "float16"), ("B", "T", "V"))
_TOKEN_LOGPROBS = TensorSpec(("float32",), ("B", "T"))
_TOP_LOGPROB_IDS = TensorSpec(("int64",), ("B", "T", "N"))
_TOP_LOGPROBS = TensorSpec(("float32",), ("B", "T", "N"))
_IDS = TensorSpec(("int64",), ("N",))
_COUNTED = TensorSpec(("int64",), (2, "N"))
MAX_COUNT = 1 << 32  # a token generated more often than any context holds is a forged count
MAX_TOKEN_ID = 1 << 32  # past any vocabulary (the stage checks its own); keeps (row, id) keys within int64
_BIASES = TensorSpec(("float32",), ("N",))


# Shared parts

@dataclass(frozen=True)
class StageRef:
    """A contiguous layer range [layer_start, layer_end) of one model."""

    model_id: str
    layer_start: int
    layer_end: int

    def __post_init__(self) -> None:
        _require(bool(self.model_id), "stage model_id must not be empty")
        _non_negative("stage layer_start", self.layer_start)
        _require(self.layer_end > self.layer_start,
                 f"stage layer_end ({self.layer_end}) must exceed layer_start ({self.layer_start})")


@dataclass(frozen=True)
class ManifestEntry:
    """One file a stage needs: a plain name (no folders), its sha256 and its size in bytes."""

    file_name: str
    sha256: str
    size: int

    def __post_init__(self) -> None:
        _require(_FILE_NAME.fullmatch(self.file_name) is not None,
                 f"manifest file_name {self.file_name!r} must be a plain file name")
        _sha256("manifest sha256", self.sha256)
        _non_negative("manifest size", self.size)


@dataclass(frozen=True)
class NextHop:
    """Where a stage sends its output: the address the controller reached the next PC at, the agent id its certificate
    must carry, and the next PC's other addresses (protocol 15). A stage dials those of an IP family its own PC has,
    `address` first: a dual-stack PC reached over IPv6 was given to an IPv4-only PC before it at that address alone,
    which it could never dial (from an exploratory test of a mixed IPv4/IPv6 office)."""

    address: str
    agent_id: str
    other_addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_address(self.address)
        _require(is_agent_id(self.agent_id), "next hop agent_id is not an agent id")
        _require(len(self.other_addresses) <= MAX_OTHER_ADDRESSES,
                 f"next hop lists {len(self.other_addresses)} other addresses, more than {MAX_OTHER_ADDRESSES}")
        for other in self.other_addresses:
            parse_address(other)

    @property
    def addresses(self) -> tuple[str, ...]:
        """`address`, then the other addresses, each once."""
        return tuple(dict.fromkeys((self.address, *self.other_addresses)))


@dataclass(frozen=True)
class ShardOffset:
    """A partially received shard and how many of its bytes the agent already holds."""

    sha256: str
    offset: int

    def __post_init__(self) -> None:
        _sha256("partial shard sha256", self.sha256)
        _non_negative("partial shard offset", self.offset)


@dataclass(frozen=True, eq=False)
class DraftInfo:
    """Draft tokens the last stage verifies: row r proposes draft_token_ids[r, :counts[r]]."""

    counts: tuple[int, ...]
    draft_token_ids: Tensor  # [B, K] int64
    # q: [B, K, V] the draft's (transformed) distributions, needed only by sampled rows' verification
    draft_probs: Tensor | None = None
    # Drafts chosen deterministically (prompt lookup): q is 1 at each draft token, so no q travels.
    one_hot: bool = False

    def __post_init__(self) -> None:
        check_tensor("draft_token_ids", self.draft_token_ids, _DRAFT_TOKEN_IDS)
        rows, width = self.draft_token_ids.shape
        _require(len(self.counts) == rows, f"draft counts has {len(self.counts)} rows, ids {rows}")
        for count in self.counts:
            _require(0 <= count <= width, f"draft count {count} outside [0, {width}]")
        _require(not (self.one_hot and self.draft_probs is not None),
                 "one-hot drafts carry no draft probabilities")
        if self.draft_probs is not None:
            check_tensor("draft_probs", self.draft_probs, _DRAFT_PROBS,
                         {"B": rows, "K": width})


@dataclass(frozen=True)
class SamplingInfo:
    """Per-row sampling done at the last stage; a temperature of 0 means greedy for that row.

    seeds[r] seeds row r's random draws of this step only: the driver derives it from the stream's seed
    and the row's position, so a stream's draws do not depend on which rows share its micro-batch.
    """

    temperatures: tuple[float, ...]
    top_ks: tuple[int, ...]  # 0 = no top-k
    top_ps: tuple[float, ...]  # 1.0 = no top-p
    seeds: tuple[int, ...]

    def __post_init__(self) -> None:
        rows = len(self.temperatures)
        _require(len(self.top_ks) == len(self.top_ps) == len(self.seeds) == rows,
                 "sampling fields have different row counts")
        for value in self.temperatures:
            _require(0.0 <= value <= 100.0, f"temperature {value} outside [0, 100]")
        for value in self.top_ps:
            _require(0.0 < value <= 1.0, f"top_p {value} outside (0, 1]")
        for count in self.top_ks:
            _non_negative("top_k", count)
        for seed in self.seeds:
            _non_negative("seed", seed)


@dataclass(frozen=True, eq=False)
class LogitsAdjust:
    """Per row, what the last stage does to the logits before it picks or samples (common/logits_adjust.py): the
    presence and frequency penalties over the tokens the row generated, and a logit bias. Row r's counted tokens are
    counted[0, count_ends[r-1]:count_ends[r]], each counted[1] times at the same index, its biased ones
    bias_ids[bias_ends[r-1]:bias_ends[r]] (by `biases`); a row with neither penalty nor bias changes nothing. Three
    tensors: a Forward carries at most 8 (wire_codec's Limits), and a sampled step drafted by a draft model carries 5
    of its own."""

    presence: tuple[float, ...]
    frequency: tuple[float, ...]
    count_ends: tuple[int, ...]
    counted: Tensor  # [2, N] int64: token ids, then how many times each was generated
    bias_ends: tuple[int, ...]
    bias_ids: Tensor  # [M] int64
    biases: Tensor  # [M] float32

    def __post_init__(self) -> None:
        rows = len(self.presence)
        _require(len(self.frequency) == len(self.count_ends) == len(self.bias_ends) == rows,
                 "logits adjustment fields have different row counts")
        for value in (*self.presence, *self.frequency):
            _require(math.isfinite(value) and abs(value) <= MAX_PENALTY,
                     f"a penalty must be from {-MAX_PENALTY} to {MAX_PENALTY}, not {value}")
        counted = check_tensor("counted", self.counted, _COUNTED)["N"]
        biased = check_tensor("bias_ids", self.bias_ids, _IDS)["N"]
        check_tensor("biases", self.biases, _BIASES, {"N": biased})
        _check_ends("count_ends", self.count_ends, counted)
        _check_ends("bias_ends", self.bias_ends, biased)
        counted_ids, counts = np.asarray(self.counted, dtype=np.int64)
        bias_ids = np.asarray(self.bias_ids, dtype=np.int64)
        _require(all(bool(((ids >= 0) & (ids < MAX_TOKEN_ID)).all()) for ids in (counted_ids, bias_ids)),
                 f"adjusted token ids must be from 0 to {MAX_TOKEN_ID - 1}")
        _require(bool((counts >= 1).all()) and bool((counts <= MAX_COUNT).all()),
                 f"a counted token's count must be from 1 to {MAX_COUNT}")
        biases = np.asarray(self.biases)
        _require(bool(np.isfinite(biases).all()) and bool((np.abs(biases) <= MAX_BIAS).all()),
                 f"a logit bias must be from {-MAX_BIAS} to {MAX_BIAS}")
        for ids, ends, what in ((counted_ids, self.count_ends, "counted"), (bias_ids, self.bias_ends, "biased")):
            if ids.size:  # one check for every row: (row, id) pairs are distinct
                rows_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff((0, *ends)))
                keyed = rows_of * (int(ids.max()) + 1) + ids
                _require(np.unique(keyed).size == ids.size, f"a row's {what} tokens repeat a token")
        starts = (0, *self.bias_ends[:-1])
        _require(all(end - start <= MAX_BIASED_TOKENS for start, end in zip(starts, self.bias_ends, strict=True)),
                 f"a row biases at most {MAX_BIASED_TOKENS} tokens")

    def row(self, row: int) -> RowAdjust | None:
        """Row `row`'s adjustment; None where it changes nothing."""
        count_start = self.count_ends[row - 1] if row else 0
        bias_start = self.bias_ends[row - 1] if row else 0
        adjust = RowAdjust(self.presence[row], self.frequency[row],
                           np.asarray(self.counted[0, count_start:self.count_ends[row]], dtype=np.int64),
                           np.asarray(self.counted[1, count_start:self.count_ends[row]], dtype=np.int64),
                           np.asarray(self.bias_ids[bias_start:self.bias_ends[row]], dtype=np.int64),
                           np.asarray(self.biases[bias_start:self.bias_ends[row]], dtype=np.float32))
        return adjust if adjust.penalizes or adjust.bias_ids.size else None

    @staticmethod
    def of(rows: list[RowAdjust | None]) -> LogitsAdjust | None:
        """The wire form of each row's adjustment (None: none); None where no row has one."""
        if all(row is None for row in rows):
            return None
        kept = [row or _NO_ADJUST for row in rows]
        return LogitsAdjust(
            presence=tuple(row.presence for row in kept), frequency=tuple(row.frequency for row in kept),
            count_ends=tuple(int(end) for end in np.cumsum([row.counted_ids.size for row in kept])),
            counted=np.stack([np.concatenate([row.counted_ids for row in kept]),
                              np.concatenate([row.counts for row in kept])]).astype(np.int64),
            bias_ends=tuple(int(end) for end in np.cumsum([row.bias_ids.size for row in kept])),
            bias_ids=np.concatenate([row.bias_ids for row in kept]).astype(np.int64),
            biases=np.concatenate([row.biases for row in kept]).astype(np.float32))


_NO_ADJUST = RowAdjust(0.0, 0.0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                       np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))


def _check_ends(name: str, ends: tuple[int, ...], size: int) -> None:
    """Row ends of a flat array of `size` items: non-decreasing, from 0, the last at its end."""
    previous = 0
    for end in ends:
        _require(previous <= end, f"{name} must not decrease")
        previous = end
    _require(previous == size, f"{name} end at {previous}, the array has {size} items")


# Messages

@dataclass(frozen=True)
class Hello:
    """First message on every connection, both directions."""

    protocol_version: int
    agent_id: str
    software_version: str
    role: Role

    def __post_init__(self) -> None:
        _require(is_agent_id(self.agent_id), "hello agent_id is not an agent id")


@dataclass(frozen=True)
class Error:
    """A refusal or failure. micro_batch_id: the micro-batch of the Forward it answers (a driver drops an
    error about a micro-batch it has no step in flight for: another run's); agent_id: the agent at fault,
    which the driver's re-plan leaves out (a next hop found unreachable, or the sender itself when it gave
    its stages up on battery or too hot)."""

    code: ErrorCode
    message: str
    micro_batch_id: int | None = None
    agent_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", wire_text(self.message))
        if self.micro_batch_id is not None:
            _non_negative("micro_batch_id", self.micro_batch_id)
        _require(self.agent_id is None or is_agent_id(self.agent_id), "error agent_id is not an agent id")


@dataclass(frozen=True)
class StatusRequest:
    """Asks the agent for a StatusReport."""


@dataclass(frozen=True)
class StatusReport:
    """An agent's typed status snapshot; None means the sensor is unknown, never a guess."""

    state: AgentState
    free_memory_bytes: int
    cpu_load: float  # fraction of all cores, [0, 1]
    battery_percent: float | None
    on_ac_power: bool | None
    temperature_c: float | None
    igpu_busy: float | None  # fraction, [0, 1]
    stages: tuple[StageRef, ...]
    last_error: str | None
    weight_gb_per_s: float | None = None  # measured decode speed (agent/speed_probe.py); None: not yet
    reasons: tuple[UnavailableReason, ...] = ()  # every limit crossed (also listed while paused)
    detail: str = ""  # the numbers behind `reasons`, for the plan's "left out" lines
    # the devices OpenVINO finds on the PC ("CPU", "GPU.0", "NPU"): a plan for a device leaves out a PC without it
    # (it was refused only once every shard had been sent); (): not known yet
    devices: tuple[str, ...] = ()
    # the bytes of new shards its shard cache could take now (agent/shard_cache.py room_for_new_bytes: its limit or
    # its disk's free space less the disk's floor, less what its hosted stages pin); None: not known
    shard_room_bytes: int | None = None
    # the PC's wall clock as it made the report (seconds since the epoch): every PC judges certificates by its own, and
    # one off the others' by minutes refuses their newest ones; None: not known
    clock_s: float | None = None
    # the IP versions (4, 6) the PC has an address of that routes past it: the families it dials a next hop over (a plan
    # never puts it directly before a PC known at addresses of none of them); (): not known
    ip_families: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_devices(self.devices)
        _require(len(set(self.ip_families)) == len(self.ip_families) and set(self.ip_families) <= {4, 6},
                 f"ip_families {self.ip_families[:4]} are not distinct IP versions (4, 6)")
        if self.last_error is not None:
            object.__setattr__(self, "last_error", wire_text(self.last_error))
        _require(len(self.detail) <= MAX_STATUS_DETAIL, f"detail longer than {MAX_STATUS_DETAIL} characters")
        # escaped, then cut: an escape grows a character to 4, and a detail cut to the limit before it was refused
        object.__setattr__(self, "detail", wire_text(self.detail)[:MAX_STATUS_DETAIL])
        _non_negative("free_memory_bytes", self.free_memory_bytes)
        if self.shard_room_bytes is not None:
            _non_negative("shard_room_bytes", self.shard_room_bytes)
        _require(self.clock_s is None or 0.0 <= self.clock_s < 253402300800.0,  # before the year 10000
                 f"clock_s {self.clock_s} is not a time since the epoch")
        _require(self.weight_gb_per_s is None or 0.0 < self.weight_gb_per_s < 1e5,
                 f"weight_gb_per_s {self.weight_gb_per_s} is not a plausible speed")
        _fraction("cpu_load", self.cpu_load)
        _fraction("igpu_busy", self.igpu_busy)
        _require(self.battery_percent is None or 0.0 <= self.battery_percent <= 100.0,
                 f"battery_percent must be within [0, 100], got {self.battery_percent}")
        _require(self.temperature_c is None or -50.0 <= self.temperature_c <= 200.0,
                 f"temperature_c {self.temperature_c} is not a plausible temperature")


@dataclass(frozen=True)
class AssignStage:
    """Host `stage`: fetch what `manifest` lists, fuse and compile, then answer StageReady."""

    stage: StageRef
    is_first: bool
    is_last: bool
    device: str
    precision: Precision
    next_hop: NextHop | None  # None: send results back to the controller
    manifest: tuple[ManifestEntry, ...]
    kv_cache: str | None = None  # KV cache precision; None: the precision's own (agent/stage.py)
    # The agent hosting the stage before this one: the only peer whose steps (Forward, ReleaseMicroBatch) and
    # relayed Errors the stage takes. None for a first stage, which takes them from the controller only.
    previous_agent_id: str | None = None

    def __post_init__(self) -> None:
        _require(bool(self.device), "device must not be empty")
        _require(self.previous_agent_id is None or is_agent_id(self.previous_agent_id),
                 "previous_agent_id is not an agent id")
        _require(self.is_first == (self.previous_agent_id is None),
                 "previous_agent_id names the agent of the stage before, so it is set on every stage but the "
                 "first (which takes its steps from the controller)")
        _require(self.kv_cache is None or self.kv_cache in KV_CACHE_PRECISIONS,
                 f"kv_cache must be one of {', '.join(KV_CACHE_PRECISIONS)}, got {self.kv_cache!r}")
        names = [entry.file_name for entry in self.manifest]
        _require(len(set(names)) == len(names), "manifest lists a file name twice")


@dataclass(frozen=True)
class StageReady:
    stage: StageRef


@dataclass(frozen=True)
class ReleaseStage:
    stage: StageRef


@dataclass(frozen=True)
class ShardQuery:
    """Which of these shards do you hold? The agent answers ShardHave.

    With `sizes` (one per shard: a deploy's whole stage), the agent also keeps them all from eviction until
    the stage is assigned or the link closes, and refuses (cache_full) at once when they cannot all fit.
    """

    sha256s: tuple[str, ...]
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for digest in self.sha256s:
            _sha256("shard query sha256", digest)
        _require(not self.sizes or len(self.sizes) == len(self.sha256s), "shard query sizes do not match its shards")
        for size in self.sizes:
            _non_negative("shard size", size)


@dataclass(frozen=True)
class ShardHave:
    """Shards held whole, and shards held in part; any other queried shard is absent."""

    complete: tuple[str, ...]
    partial: tuple[ShardOffset, ...]

    def __post_init__(self) -> None:
        for digest in self.complete:
            _sha256("complete shard sha256", digest)


@dataclass(frozen=True)
class ShardChunk:
    """Bytes [offset, offset + len(data)) of the shard `sha256`, whose full size is total_size."""

    sha256: str
    offset: int
    total_size: int
    data: bytes

    def __post_init__(self) -> None:
        _sha256("chunk sha256", self.sha256)
        _non_negative("chunk offset", self.offset)
        _require(self.offset + len(self.data) <= self.total_size,
                 f"chunk ends at {self.offset + len(self.data)}, past total_size {self.total_size}")


@dataclass(frozen=True)
class ShardComplete:
    """The sender has sent every byte; the receiver verifies the sha256 before using the shard."""

    sha256: str

    def __post_init__(self) -> None:
        _sha256("complete sha256", self.sha256)


@dataclass(frozen=True, eq=False)
class Forward:
    """One pipeline step of one micro-batch; exactly one of input_ids and hidden_states is set.

    Rows are streams: stream_ids[r] names row r, after the deltas apply. The receiver applies
    slot_deltas, in order, to its kv_ledger.Mirror (which raises LedgerError on a desync), checks
    that beam_idx and position_ids agree with it, then runs its stage.
    Compare decoded instances with `wire_codec.same_message`.
    """

    micro_batch_id: int
    step_id: int
    stream_ids: tuple[int, ...]
    slot_deltas: tuple[SlotDelta, ...]  # since the previous Forward of this micro-batch
    beam_idx: Tensor  # [B] int64 or int32
    position_ids: Tensor  # [B, T] int64
    input_ids: Tensor | None  # [B, T] int64, first stage
    hidden_states: Tensor | None  # [B, T, H] float32 or float16
    draft: DraftInfo | None
    # micro-batch ids whose one-row state becomes the new last row, one per AdmitRow delta, in order
    admit_from: tuple[int, ...] = ()
    sampling: SamplingInfo | None = None
    # the last stage also returns the logits [B, T, V]: only to measure what top-1 compression saves
    return_logits: bool = False
    # the first layer of the stage this step is for: the driver sends 0, each stage relays its end; a stage
    # of another range refuses it (PCs that disagree with the plan, e.g. after a re-deploy that failed midway)
    layer_start: int = 0
    # the deployed model the step is for (StageRef.model_id): an agent hosting stages of several models runs
    # it on that model's stage; "" (a chain that does not know it) only where the agent's choice is unique
    model_id: str = ""
    # per row, the log-probabilities the last stage returns with the row's tokens (common/logprobs.py): -1 none,
    # n >= 0 the chosen token's and the n most likely tokens' (at most MAX_TOP_LOGPROBS); None: no row asks
    logprobs: tuple[int, ...] | None = None
    # [B, T] int64: the token whose log-probability the last stage returns at each fed position (a prompt's next
    # token, for an echo of the prompt's log-probabilities), -1 none; rows with any need logprobs >= 0
    scored_ids: Tensor | None = None
    # per admit_from entry, whether its source micro-batch stays on the stage after its row is copied (the driver
    # keeps the prompt's KV state for later requests that share it: a prefix cache); () or False: it is freed
    keep_sources: tuple[bool, ...] = ()
    # per row, the penalties and logit bias the last stage applies before it picks or samples; None: no row has any
    adjust: LogitsAdjust | None = None
    # the new micro-batch ids the CopyRow deltas copy their rows into, one per CopyRow, in order
    copy_into: tuple[int, ...] = ()
    # a stage had no memory for the copies (they are the driver's option, for its prefix cache): it made none, and
    # the stages after it make none either; the last stage says so in its result
    copies_dropped: bool = False

    def __post_init__(self) -> None:
        _non_negative("micro_batch_id", self.micro_batch_id)
        _non_negative("step_id", self.step_id)
        _non_negative("layer_start", self.layer_start)
        rows = len(self.stream_ids)
        _require(len(set(self.stream_ids)) == rows, "stream_ids repeats a stream")
        check_tensor("beam_idx", self.beam_idx, _BEAM_IDX, {"B": rows})
        sizes = check_tensor("position_ids", self.position_ids, _TOKENS_BY_ROW,
                             {"B": rows})
        if (self.input_ids is None) == (self.hidden_states is None):
            raise ProtocolError("forward needs exactly one of input_ids and hidden_states")
        if self.input_ids is not None:
            check_tensor("input_ids", self.input_ids, _TOKENS_BY_ROW, sizes)
        if self.hidden_states is not None:
            check_tensor("hidden_states", self.hidden_states,
                         _HIDDEN_STATES, sizes)
        if self.draft is not None:
            _require(len(self.draft.counts) == rows, "draft rows differ from stream_ids")
        if self.sampling is not None:
            _require(len(self.sampling.seeds) == rows, "sampling rows differ from stream_ids")
        admits = sum(isinstance(delta, AdmitRow) for delta in self.slot_deltas)
        _require(len(self.admit_from) == admits, f"{admits} AdmitRow deltas but {len(self.admit_from)} sources")
        for source in self.admit_from:
            _non_negative("admit_from", source)
        if self.adjust is not None:
            _require(len(self.adjust.presence) == rows, "logits adjustment rows differ from stream_ids")
        copies = sum(isinstance(delta, CopyRow) for delta in self.slot_deltas)
        _require(len(self.copy_into) == copies, f"{copies} CopyRow deltas but {len(self.copy_into)} new micro-batches")
        for target in self.copy_into:
            _non_negative("copy_into", target)
        _require(len(set(self.copy_into)) == copies and self.micro_batch_id not in self.copy_into,
                 "copy_into repeats a micro-batch, or names the step's own")
        _require(not self.copies_dropped or copies > 0, "copies_dropped on a step that copies no row")
        _require(not self.keep_sources or len(self.keep_sources) == len(self.admit_from),
                 f"{len(self.keep_sources)} keep_sources for {len(self.admit_from)} admitted sources")
        if self.logprobs is not None:
            _require(len(self.logprobs) == rows, "logprobs rows differ from stream_ids")
            for top in self.logprobs:
                _require(-1 <= top <= MAX_TOP_LOGPROBS, f"a row's logprobs must be -1 to {MAX_TOP_LOGPROBS}, not {top}")
        if self.scored_ids is not None:
            check_tensor("scored_ids", self.scored_ids, _TOKENS_BY_ROW, sizes)
            scored = np.asarray(self.scored_ids, dtype=np.int64)
            _require(self.logprobs is not None and all(
                top >= 0 for top, row in zip(self.logprobs, scored, strict=True) if (row >= 0).any()),
                "scored_ids rows need logprobs of 0 or more")
            _require(bool((scored >= -1).all()), "scored_ids must be token ids or -1")


@dataclass(frozen=True, eq=False)
class ForwardResult:
    """What the last stage returns to the controller for one step of one micro-batch."""

    micro_batch_id: int
    step_id: int
    next_token_ids: tuple[int, ...]  # one per row
    accepted_counts: tuple[int, ...] | None  # draft tokens accepted per row, when verifying
    logits: Tensor | None  # [B, T, V] float32 or float16, only when asked for
    # where the step's Forward.logprobs asked (common/logprobs.chosen_and_top): [B, T] the log-probability of each
    # token a row returns (its accepted draft tokens, then its next token, from column 0), and [B, T, N] the N most
    # likely tokens at each and theirs (N: the most any row asked); columns past a row's tokens are 0
    token_logprobs: Tensor | None = None
    top_logprob_ids: Tensor | None = None
    top_logprobs: Tensor | None = None
    # where the step's Forward.scored_ids named tokens: [B, T] their log-probabilities at the fed positions, and
    # [B, T, N] the N most likely tokens at each and theirs; 0 where a position named none
    scored_logprobs: Tensor | None = None
    scored_top_ids: Tensor | None = None
    scored_top_logprobs: Tensor | None = None
    # the step's Forward.copy_into were not made on every stage (Forward.copies_dropped): the driver frees them
    copies_dropped: bool = False

    def __post_init__(self) -> None:
        _non_negative("micro_batch_id", self.micro_batch_id)
        _non_negative("step_id", self.step_id)
        rows = len(self.next_token_ids)
        if self.accepted_counts is not None:
            _require(len(self.accepted_counts) == rows, "accepted_counts rows differ from next_token_ids")
            for count in self.accepted_counts:
                _non_negative("accepted count", count)
        if self.logits is not None:
            check_tensor("logits", self.logits, _LOGITS,
                         {"B": rows})
        asked = (self.token_logprobs, self.top_logprob_ids, self.top_logprobs)
        _require(all(part is None for part in asked) or all(part is not None for part in asked),
                 "token_logprobs, top_logprob_ids and top_logprobs come together")
        if self.token_logprobs is not None:
            sizes = check_tensor("token_logprobs", self.token_logprobs, _TOKEN_LOGPROBS, {"B": rows})
            returned = 1 + max(self.accepted_counts or (0,))
            _require(sizes["T"] >= returned, f"token_logprobs has {sizes['T']} columns for the {returned} tokens a "
                                             "row returns")
            sizes = check_tensor("top_logprob_ids", self.top_logprob_ids, _TOP_LOGPROB_IDS, sizes)
            check_tensor("top_logprobs", self.top_logprobs, _TOP_LOGPROBS, sizes)
            _require(sizes["N"] <= MAX_TOP_LOGPROBS, f"top_logprobs has {sizes['N']} alternatives, at most "
                                                     f"{MAX_TOP_LOGPROBS}")
        scored = (self.scored_logprobs, self.scored_top_ids, self.scored_top_logprobs)
        _require(all(part is None for part in scored) or all(part is not None for part in scored),
                 "scored_logprobs, scored_top_ids and scored_top_logprobs come together")
        if self.scored_logprobs is not None:
            sizes = check_tensor("scored_logprobs", self.scored_logprobs, _TOKEN_LOGPROBS, {"B": rows})
            sizes = check_tensor("scored_top_ids", self.scored_top_ids, _TOP_LOGPROB_IDS, sizes)
            check_tensor("scored_top_logprobs", self.scored_top_logprobs, _TOP_LOGPROBS, sizes)
            _require(sizes["N"] <= MAX_TOP_LOGPROBS, f"scored_top_logprobs has {sizes['N']} alternatives, at most "
                                                     f"{MAX_TOP_LOGPROBS}")


@dataclass(frozen=True)
class ReleaseMicroBatch:
    """Free one micro-batch's KV state. The driver sends it to the first stage after the micro-batch's
    last Forward; every stage frees it and relays it to its next hop, so it follows that Forward."""

    micro_batch_id: int

    def __post_init__(self) -> None:
        _non_negative("micro_batch_id", self.micro_batch_id)


@dataclass(frozen=True)
class ResultsHere:
    """A driver tells each stage's agent: send the ForwardResults, and the Errors relayed down the chain,
    of the wire micro-batch ids [first_micro_batch_id, stop_micro_batch_id) on this link, until it closes.

    Each driver of a deployment numbers its micro-batches in a range of its own (controller/fleet_pipeline.py),
    and several drivers may run on one deployment at once (two users, a chat beside a script): with one results
    link per agent, the last driver to say ResultsHere got every driver's results, and the others waited out
    their step timeout."""

    first_micro_batch_id: int
    stop_micro_batch_id: int

    def __post_init__(self) -> None:
        _non_negative("first_micro_batch_id", self.first_micro_batch_id)
        _require(self.stop_micro_batch_id > self.first_micro_batch_id,
                 f"ResultsHere's range [{self.first_micro_batch_id}, {self.stop_micro_batch_id}) is empty")

    def holds(self, micro_batch_id: int) -> bool:
        return self.first_micro_batch_id <= micro_batch_id < self.stop_micro_batch_id


@dataclass(frozen=True)
class _Removals:
    """A list of removals as REMOVAL_RECORD_BYTES records (see there): `agent_ids[i]` was removed, and
    `signatures[i]` is the fleet CA's signature of it."""

    records: bytes

    @classmethod
    def of(cls, agent_ids: Sequence[str], signatures: Sequence[bytes]) -> Self:
        _require(len(signatures) == len(agent_ids), f"{len(agent_ids)} removed agents but {len(signatures)} signatures")
        for agent_id, signature in zip(agent_ids, signatures, strict=True):
            _require(is_agent_id(agent_id), f"removed agent id {agent_id[:60]!r} is not an agent id")
            _require(isinstance(signature, bytes) and len(signature) == REMOVAL_SIGNATURE_BYTES,
                     f"the signature of removed agent {agent_id[:12]} is not {REMOVAL_SIGNATURE_BYTES} bytes")
        return cls(b"".join(agent_id.encode("ascii") + signature
                            for agent_id, signature in zip(agent_ids, signatures, strict=True)))

    def _check_records(self, most: int) -> None:
        _require(isinstance(self.records, bytes), "removals must be bytes")
        count, rest = divmod(len(self.records), REMOVAL_RECORD_BYTES)
        _require(rest == 0, f"removals must be {REMOVAL_RECORD_BYTES}-byte records, not {len(self.records)} bytes")
        _require(count <= most, f"a message lists at most {most} removals, not {count}")
        if _REMOVAL_RECORDS.fullmatch(self.records) is None:
            bad = next(agent_id for agent_id in self.agent_ids if not is_agent_id(agent_id))
            raise ProtocolError(f"removed agent id {bad[:60]!r} is not an agent id")

    @property
    def agent_ids(self) -> tuple[str, ...]:
        return tuple(self.records[start:start + AGENT_ID_CHARS].decode("ascii", "replace")
                     for start in range(0, len(self.records), REMOVAL_RECORD_BYTES))

    @property
    def signatures(self) -> tuple[bytes, ...]:
        return tuple(self.records[start + AGENT_ID_CHARS:start + REMOVAL_RECORD_BYTES]
                     for start in range(0, len(self.records), REMOVAL_RECORD_BYTES))


@dataclass(frozen=True)
class RevocationUpdate(_Removals):
    """The controller's full list of removed agents, each with the fleet CA's signature of its removal: an agent
    refuses and drops links from them, and keeps them for good."""

    def __post_init__(self) -> None:
        self._check_records(MAX_REMOVALS)


@dataclass(frozen=True)
class KnownRemovals(_Removals):
    """An agent's answer to a RevocationUpdate that lacks removals it keeps (a controller data dir restored
    from a backup older than them): those, with the CA's signatures, at most MAX_KNOWN_REMOVALS a message."""

    def __post_init__(self) -> None:
        _require(len(self.records) > 0, "known removals must list at least one agent")
        self._check_records(MAX_KNOWN_REMOVALS)


@dataclass(frozen=True)
class JoinOffer:
    """First message the controller sends on its enrollment port, before the agent says anything.

    The agent checks the CA against the fingerprint in its join token and checks that the TLS peer's
    certificate chains to it (`pki.verify_enrollment_peer`); only then does it send JoinRequest.
    """

    ca_certificate_pem: str
    fleet_id: str


@dataclass(frozen=True)
class JoinRequest:
    """Sent by an agent that is not enrolled yet, only after it has pinned the controller's CA."""

    secret: str  # the token's one-time secret, as join_tokens.secret_to_text gives it
    csr_pem: str
    hostname: str


@dataclass(frozen=True)
class JoinResponse:
    certificate_pem: str
    ca_certificate_pem: str
    fleet_id: str


@dataclass(frozen=True)
class Register:
    """An enrolled agent tells the controller where it listens (multicast may be blocked), and the sha256 of
    the join token's secret it joined with (None: it joined before agents kept it), so that a controller data
    dir restored from a backup older than the join spends that use again."""

    agent_id: str
    listen_addresses: tuple[str, ...]
    token_sha256: str | None = None

    def __post_init__(self) -> None:
        _require(is_agent_id(self.agent_id), "register agent_id is not an agent id")
        if self.token_sha256 is not None:
            _sha256("register token_sha256", self.token_sha256)
        # the controller dials every one: a PC has a few interfaces, not thousands
        _require(len(self.listen_addresses) <= MAX_LISTEN_ADDRESSES,
                 f"register lists {len(self.listen_addresses)} addresses, more than {MAX_LISTEN_ADDRESSES}")
        for address in self.listen_addresses:
            parse_address(address)


@dataclass(frozen=True)
class AddressesChanged:
    """A registered agent tells the controller, on its registration link, that the addresses its Register listed
    changed (a rotated IPv6 address, a new one of its other family): the roster's, which surveys dial and deploys
    give the stage before it, are replaced. Unlike a Register on that link (a call-in: the PC can take stages
    again), it says nothing of the PC's availability."""

    listen_addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        _require(len(self.listen_addresses) > 0, "addresses changed must list at least one address")
        _require(len(self.listen_addresses) <= MAX_LISTEN_ADDRESSES,
                 f"addresses changed lists {len(self.listen_addresses)} addresses, more than {MAX_LISTEN_ADDRESSES}")
        for address in self.listen_addresses:
            parse_address(address)


Message = (Hello | Error | StatusRequest | StatusReport | AssignStage | StageReady | ReleaseStage
           | ShardQuery | ShardHave | ShardChunk | ShardComplete | Forward | ForwardResult
           | JoinOffer | JoinRequest | JoinResponse | Register | ReleaseMicroBatch | ResultsHere
           | RevocationUpdate | KnownRemovals | AddressesChanged)

MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello, Error, StatusRequest, StatusReport, AssignStage, StageReady, ReleaseStage, ShardQuery,
    ShardHave, ShardChunk, ShardComplete, Forward, ForwardResult, JoinOffer, JoinRequest, JoinResponse,
    Register, ReleaseMicroBatch, ResultsHere, RevocationUpdate, KnownRemovals, AddressesChanged,
)

__all__ = [
    "MAX_KNOWN_REMOVALS",
    "MAX_REMOVALS",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "REMOVAL_SIGNATURE_BYTES",
    "AddressesChanged",
    "AgentState",
    "AssignStage",
    "DraftInfo",
    "Error",
    "ErrorCode",
    "Forward",
    "ForwardResult",
    "Hello",
    "JoinOffer",
    "JoinRequest",
    "JoinResponse",
    "KnownRemovals",
    "ManifestEntry",
    "Message",
    "NextHop",
    "Precision",
    "ProtocolError",
    "Register",
    "ReleaseMicroBatch",
    "ReleaseStage",
    "ResultsHere",
    "RevocationUpdate",
    "Role",
    "SamplingInfo",
    "ShardChunk",
    "ShardComplete",
    "ShardHave",
    "ShardOffset",
    "ShardQuery",
    "StageReady",
    "StageRef",
    "StatusReport",
    "StatusRequest",
    "is_agent_id",
    "is_sha256_hex",
    "parse_address",
]
