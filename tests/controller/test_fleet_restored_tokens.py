"""A controller data dir restored from a backup older than a join spends that join's token use again.

tokens.json restored from such a backup counts the token as unused: whoever else held it could join one more
PC with it. An agent keeps the sha256 of the secret it joined with and says it at every registration.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from deskfleet.agent.enroll import EnrollmentError, Membership, join
from deskfleet.agent.paths import AgentPaths
from deskfleet.common import join_tokens
from deskfleet.controller.fleet_store import FleetStore
from tests.controller.test_fleet_ca import token_for
from tests.controller.test_fleet_restored_removals import (
    registering,
    serving,
    stopped,
    wait_until,
)
from tests.log_records import records_of
from tests.ports import free_address


def uses_left(store: FleetStore) -> list[int]:
    return [record["uses_left"] for record in json.loads((store.data_dir / "tokens.json").read_text())["body"]]


@pytest.mark.usefixtures("no_controller_search")
def test_a_restored_controller_spends_again_the_token_use_of_an_agent_that_joined_since_the_backup(
        store: FleetStore, tmp_path: Path) -> None:
    address = free_address()
    agent_dir = tmp_path / "agent"

    async def scenario() -> None:
        server, running = await serving(store, address)
        token = token_for(store, address)  # one use
        backup = (store.data_dir / "tokens.json").read_bytes()
        membership: Membership = await join(token, AgentPaths.resolve(agent_dir).state_dir, "pc-1")
        decoded = join_tokens.decode_join_token(token)
        assert membership.token_sha256 == join_tokens.secret_sha256(decoded.secret)
        assert Membership.load(AgentPaths.resolve(agent_dir).state_dir) == membership
        await stopped(server, running)
        (store.data_dir / "tokens.json").write_bytes(backup)  # the restore: the token counts as unused again
        assert uses_left(store) == [1]

        server, running = await serving(store, address)
        try:
            async with registering(agent_dir) as agent:
                await wait_until("the agent registered", lambda: agent.core.agent_id in server.live)
                await wait_until("the use spent again", lambda: uses_left(store) == [0])
                with pytest.raises(EnrollmentError, match="unknown, expired or used up"):  # its holder is refused
                    await join(token, tmp_path / "another PC", "pc-2")
        finally:
            await stopped(server, running)

    with records_of("deskfleet.controller") as logged:
        asyncio.run(scenario())
    assert sum("that use is spent again" in message for message in logged.messages()) == 1


def test_an_agent_that_registers_again_spends_nothing_more(store: FleetStore, tmp_path: Path) -> None:
    from deskfleet.agent.link import utc_now
    from deskfleet.controller.fleet_ca import spend_token_again

    address = "127.0.0.1:1"
    token = join_tokens.decode_join_token(token_for(store, address, uses=3))
    digest = join_tokens.secret_sha256(token.secret)
    agent, other = "a" * 52, "b" * 52
    assert spend_token_again(store, digest, agent, utc_now()) and uses_left(store) == [2]
    assert not spend_token_again(store, digest, agent, utc_now()) and uses_left(store) == [2]
    assert spend_token_again(store, digest, other, utc_now()) and uses_left(store) == [1]
    assert not spend_token_again(store, "0" * 64, agent, utc_now())  # a token this data dir never issued


@pytest.mark.usefixtures("no_controller_search")
def test_a_join_then_its_registrations_spend_one_use(store: FleetStore, tmp_path: Path) -> None:
    # Nothing restored: the join counted the use with the agent's id, so its registration spends nothing.
    address = free_address()
    agent_dir = tmp_path / "agent"

    async def scenario() -> None:
        server, running = await serving(store, address)
        token = token_for(store, address, uses=2)
        await join(token, AgentPaths.resolve(agent_dir).state_dir, "pc-1")
        try:
            async with registering(agent_dir) as agent:
                counted = (agent.core.agent_id, agent.membership.token_sha256)
                await wait_until("the join checked against tokens.json", lambda: counted in server._joins_counted)
        finally:
            await stopped(server, running)

    with records_of("deskfleet.controller") as logged:
        asyncio.run(scenario())
    assert uses_left(store) == [1]
    assert not any("spent again" in message for message in logged.messages())
