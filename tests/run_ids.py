"""Ids that differ from one test run to the next, for what the tests announce over mDNS.

mDNS on loopback is shared by every process of the machine: two test runs at once (two checkouts, or a CI clone
beside a developer's run) that announced the same service names collided, and zeroconf's probe raised
NonUniqueNameException in one of them (a CI run, December 2026). The ids stay fixed within a run.
"""

from __future__ import annotations

import base64
import hashlib
import random
import secrets

RUN = secrets.token_hex(8)


def run_random(seed: int) -> random.Random:
    """random.Random(seed), salted with this run's id: the same draws all through a run, others in the next."""
    return random.Random(f"{RUN}/{seed}")


def run_agent_id(label: str) -> str:
    """An agent or controller id (52 characters of lower-case base32) for `label`, this run's own."""
    digest = hashlib.sha512(f"{RUN}/{label}".encode()).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:52]


def run_fleet_id(label: str) -> str:
    """A fleet id (16 hex digits) for `label`, this run's own."""
    return hashlib.sha256(f"{RUN}/{label}".encode()).hexdigest()[:16]
