"""The agent's discovery record: what its `_deskfleet._tcp.local.` TXT record says, and how to read it.

Pure code, shared by the agent's advertiser and the controller's browser. The mDNS instance name is the
agent id itself (52 characters, one DNS label), so a goodbye names the agent that left. TXT values are
short ASCII; `from_txt` treats a record as hostile input (anyone on the LAN can advertise) and raises
RecordError naming the bad key rather than guessing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from deskfleet.common.agent_state import AgentState
from deskfleet.common.wire_messages import PROTOCOL_VERSION, is_agent_id

SERVICE_TYPE = "_deskfleet._tcp.local."
MEMORY_STEP_BYTES = 256 << 20  # advertised free memory is rounded down to this, so TXT churns less

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

    @property
    def instance_name(self) -> str:
        return instance_name(self.agent_id)

    def coarse(self) -> AgentRecord:
        """This record with free memory rounded down to MEMORY_STEP_BYTES (what the advertiser sends)."""
        memory = self.free_memory_bytes - self.free_memory_bytes % MEMORY_STEP_BYTES
        return AgentRecord(self.agent_id, self.fleet_id, self.version, self.devices, memory, self.state,
                           self.protocol_version)

    def to_txt(self) -> dict[str, str]:
        return {
            "id": self.agent_id,
            "fleet": self.fleet_id,
            "ver": self.version,
            "proto": str(self.protocol_version),
            "dev": ",".join(self.devices),
            "mem": str(self.free_memory_bytes),
            "state": self.state.value,
        }

    @classmethod
    def from_txt(cls, properties: Mapping[bytes, bytes | None] | Mapping[str, str]) -> AgentRecord:
        """Parse TXT properties (zeroconf gives bytes -> bytes | None); RecordError when malformed."""
        text = {_decode(key, "key"): _decode(value, str(key)) for key, value in properties.items()}
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


def instance_name(agent_id: str) -> str:
    """The mDNS service instance name of an agent."""
    return f"{agent_id}.{SERVICE_TYPE}"


def agent_id_of_instance(name: str) -> str | None:
    """The agent id in an mDNS instance name, or None if the name is not an agent's."""
    label, separator, rest = name.partition(".")
    return label if separator and rest == SERVICE_TYPE and is_agent_id(label) else None


def _require(condition: bool, key: str, problem: str) -> None:
    if not condition:
        raise RecordError(f"TXT key {key!r} {problem}")


def _decode(value: bytes | str | None, key: str) -> str:
    if value is None:
        raise RecordError(f"TXT key {key!r} has no value")
    if isinstance(value, str):
        return value
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        raise RecordError(f"TXT key {key!r} is not ASCII") from None
