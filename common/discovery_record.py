"""The discovery records: what an agent's `_deskfleet._tcp.local.` TXT record says (AgentRecord), what the
controller's `_deskfleet-ctl._tcp.local.` one says (ControllerRecord), and how to read them.

Pure code, shared by the agent's advertiser and the controller's browser. The mDNS instance name is the
agent id itself (52 characters, one DNS label), so a goodbye names the agent that left. TXT values are
short ASCII; `from_txt` treats a record as hostile input (anyone on the LAN can advertise) and raises
RecordError naming the bad key rather than guessing.

Each TXT string ("key=value") holds at most 255 bytes (RFC 6763 §6.1), and zeroconf refuses a whole
registration with a longer one: an agent with many devices (or long device names) was not discoverable at
all. `to_txt` always fits: the device list keeps as many names as fit, in order, then the kinds of the
rest ("GPU" for GPU.7 and GPU.8; see `advertised_devices`), and free memory is capped at
MAX_ADVERTISED_MEMORY_BYTES; the whole record stays under TXT_RECORD_MAX_BYTES.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from deskfleet.common.agent_state import AgentState
from deskfleet.common.devices import device_kind
from deskfleet.common.wire_messages import PROTOCOL_VERSION, is_agent_id

SERVICE_TYPE = "_deskfleet._tcp.local."
# `fleet serve` announces itself so that an agent whose join-token address no longer answers (the controller got
# a new DHCP lease, or moved to another PC with its data dir) can find it again; the TLS link then checks that
# the peer holds the controller key the agent pinned at join, so an announcement proves nothing by itself.
CONTROLLER_SERVICE_TYPE = "_deskfleet-ctl._tcp.local."
MEMORY_STEP_BYTES = 256 << 20  # advertised free memory is rounded down to this, so TXT churns less
TXT_STRING_MAX_BYTES = 255  # one TXT string, "key=value": its length travels in one byte
TXT_RECORD_MAX_BYTES = 512  # the whole TXT record to_txt makes, length bytes included, at most
MAX_ADVERTISED_MEMORY_BYTES = (1 << 63) - 1  # free memory above this is advertised as this (19 digits)
MAX_PROTOCOL_VERSION = (1 << 31) - 1

_FLEET_ID = re.compile(r"[0-9a-f]{16}")
_DEVICE = re.compile(r"[A-Za-z0-9_.:-]{1,32}")
_VERSION = re.compile(r"[A-Za-z0-9_.+-]{1,40}")


class RecordError(ValueError):
    """A TXT record that is not a deskfleet agent's; the message names the key."""


@dataclass(frozen=True)
class AgentRecord:
    """One agent as discovery sees it. Addresses and port travel in the SRV/A records, not here."""

    agent_id: str
    fleet_id: str
    version: str
    devices: tuple[str, ...]  # OpenVINO device names: ("CPU", "GPU.1"); a virtual one's list as its targets
    free_memory_bytes: int
    state: AgentState
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _require(is_agent_id(self.agent_id), "id", "is not an agent id")
        _require(_FLEET_ID.fullmatch(self.fleet_id) is not None, "fleet", "is not 16 hex characters")
        _require(_VERSION.fullmatch(self.version) is not None, "ver", "is not a version string")
        _require(all(_DEVICE.fullmatch(device) for device in self.devices), "dev", "holds a bad device name")
        _require(self.free_memory_bytes >= 0, "mem", "is negative")
        _require(0 <= self.protocol_version <= MAX_PROTOCOL_VERSION, "proto", "is out of range")

    @property
    def instance_name(self) -> str:
        return instance_name(self.agent_id)

    @property
    def service_type(self) -> str:
        return SERVICE_TYPE

    @property
    def server_name(self) -> str:
        return f"df-{self.agent_id[:16]}.local."

    def coarse(self) -> AgentRecord:
        """This record with free memory rounded down to MEMORY_STEP_BYTES (what the advertiser sends)."""
        memory = self.free_memory_bytes - self.free_memory_bytes % MEMORY_STEP_BYTES
        return AgentRecord(self.agent_id, self.fleet_id, self.version, self.devices, memory, self.state,
                           self.protocol_version)

    def to_txt(self) -> dict[str, str]:
        """The TXT properties; each "key=value" fits one TXT string (devices summarized when they would not)."""
        return {
            "id": self.agent_id,
            "fleet": self.fleet_id,
            "ver": self.version,
            "proto": str(self.protocol_version),
            "dev": ",".join(advertised_devices(self.devices)),
            "mem": str(min(self.free_memory_bytes, MAX_ADVERTISED_MEMORY_BYTES)),
            "state": self.state.value,
        }

    @classmethod
    def from_txt(cls, properties: Mapping[bytes, bytes | None] | Mapping[str, str]) -> AgentRecord:
        """Parse TXT properties (zeroconf gives bytes -> bytes | None); RecordError when malformed."""
        text = _txt_text(properties)
        for key in ("id", "fleet", "ver", "proto", "dev", "mem", "state"):
            _require(key in text, key, "is missing")
        _require(text["mem"].isdigit(), "mem", "is not a byte count")
        _require(text["proto"].isdigit(), "proto", "is not a number")
        try:
            state = AgentState(text["state"])
        except ValueError:
            raise RecordError(f"TXT key 'state' is not an agent state: {text['state']!r}") from None
        devices = tuple(device for device in text["dev"].split(",") if device)
        return cls(text["id"], text["fleet"], text["ver"], devices, int(text["mem"]), state, int(text["proto"]))


@dataclass(frozen=True)
class ControllerRecord:
    """A controller as discovery sees it: which fleet it serves and the identity in its certificate (the
    agent-id form of its public key). Addresses and port travel in the SRV/A records."""

    controller_id: str
    fleet_id: str
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _require(is_agent_id(self.controller_id), "id", "is not a controller id")
        _require(_FLEET_ID.fullmatch(self.fleet_id) is not None, "fleet", "is not 16 hex characters")
        _require(0 <= self.protocol_version <= MAX_PROTOCOL_VERSION, "proto", "is out of range")

    @property
    def instance_name(self) -> str:
        return f"{self.controller_id}.{CONTROLLER_SERVICE_TYPE}"

    @property
    def service_type(self) -> str:
        return CONTROLLER_SERVICE_TYPE

    @property
    def server_name(self) -> str:
        return f"dfc-{self.controller_id[:16]}.local."

    def coarse(self) -> ControllerRecord:
        return self  # nothing in it changes while `fleet serve` runs

    def to_txt(self) -> dict[str, str]:
        return {"id": self.controller_id, "fleet": self.fleet_id, "proto": str(self.protocol_version)}

    @classmethod
    def from_txt(cls, properties: Mapping[bytes, bytes | None] | Mapping[str, str]) -> ControllerRecord:
        """Parse TXT properties (hostile input: anyone on the LAN can announce); RecordError when malformed."""
        text = _txt_text(properties)
        for key in ("id", "fleet", "proto"):
            _require(key in text, key, "is missing")
        _require(text["proto"].isdigit(), "proto", "is not a number")
        return cls(text["id"], text["fleet"], int(text["proto"]))


def advertised_devices(devices: tuple[str, ...]) -> tuple[str, ...]:
    """`devices` as the TXT record lists them: all of them when "dev=" and their comma-separated names fit
    one TXT string (TXT_STRING_MAX_BYTES). Otherwise the first names, in order, as many as fit together
    with the kinds of all the others ("GPU.7", "GPU.8" -> "GPU"; a kind already listed by that very name is
    not repeated), so the controller still learns every kind of device the agent has, and that it has more
    of a kind than the names listed; if even the kinds alone do not fit, the first kinds that do."""
    if _fits_dev(devices):
        return devices
    most = 0  # the longest prefix whose names alone fit; the names kept are at most those
    while _fits_dev(devices[:most + 1]):
        most += 1
    for kept in range(most, -1, -1):
        listed = devices[:kept]
        others = tuple(kind for kind in _kinds(devices[kept:]) if kind not in listed)
        if _fits_dev(listed + others):
            return listed + others
    fitting: tuple[str, ...] = ()
    for kind in _kinds(devices):
        if _fits_dev((*fitting, kind)):
            fitting += (kind,)
    return fitting


def instance_name(agent_id: str) -> str:
    """The mDNS service instance name of an agent."""
    return f"{agent_id}.{SERVICE_TYPE}"


def agent_id_of_instance(name: str) -> str | None:
    """The agent id in an mDNS instance name, or None if the name is not an agent's."""
    label, separator, rest = name.partition(".")
    return label if separator and rest == SERVICE_TYPE and is_agent_id(label) else None


def _fits_dev(devices: tuple[str, ...]) -> bool:
    return len("dev=") + len(",".join(devices)) <= TXT_STRING_MAX_BYTES  # device names are ASCII


def _kinds(devices: tuple[str, ...]) -> list[str]:
    """The device kinds, each once, in order of first appearance (none for a name without one, ".1")."""
    return [kind for kind in dict.fromkeys(device_kind(device) for device in devices) if kind]


def _require(condition: bool, key: str, problem: str) -> None:
    if not condition:
        raise RecordError(f"TXT key {key!r} {problem}")


def _txt_text(properties: Mapping[bytes, bytes | None] | Mapping[str, str]) -> dict[str, str]:
    """TXT properties as text; a key with no value (a flag, which RFC 6763 6.4 allows, e.g. one a later version
    adds) is left out, so a required one is "missing"; a key or value that is not ASCII is a RecordError naming
    the key (as text: it said "b'mem'")."""
    text = {}
    for raw_key, value in properties.items():
        key = _decode(raw_key, "key")
        if value is not None:
            text[key] = _decode(value, key)
    return text


def _decode(value: bytes | str, key: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        raise RecordError(f"TXT key {key!r} is not ASCII") from None
