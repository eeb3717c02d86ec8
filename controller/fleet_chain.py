"""Driving a deployed chain over the network: controller -> stage 0 -> ... -> stage n-1 -> controller.

`RemoteChain` holds two links: to the first stage's agent (Forward goes in there) and to the last
stage's agent (ForwardResult comes back there; n+1 hops per step). The driver keeps the KV-slot
Ledger and sends only its deltas; beam_idx and position_ids come from replaying the same deltas on a
driver-side Mirror, which is exactly the stages' desync check.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from deskfleet.agent.link import Link, LinkError, open_link
from deskfleet.agent.stage_executor import replay_deltas
from deskfleet.common.kv_ledger import Ledger, Mirror, SlotDelta
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import Error, Forward, ForwardResult, Message, ReleaseMicroBatch, ResultsHere
from deskfleet.controller.fleet_ca import Revocations
from deskfleet.controller.fleet_deploy import DeployError, load_deployment
from deskfleet.controller.fleet_store import FleetStore

STEP_TIMEOUT_S = 60.0
_M = TypeVar("_M", bound=Message)


class ChainError(RuntimeError):
    """A step failed: an agent is unreachable or reported an error (named)."""


@dataclass
class RemoteChain:
    first: Link
    last: Link

    @classmethod
    async def open(cls, store: FleetStore, model_dir: Path) -> RemoteChain:
        try:
            stages = load_deployment(store, model_dir)
        except DeployError as error:
            raise ChainError(str(error)) from None
        revocations = Revocations(store)
        links: list[Link] = []
        try:
            for stage in (stages[0], stages[-1]) if len(stages) > 1 else (stages[0],):
                link = await open_link(stage.address, store.tls_files, stage.agent_id, revocations)
                links.append(link)
            chain = cls(links[0], links[-1])
            await chain.last.send(ResultsHere())  # the last stage answers on this link
        except LinkError as error:
            for link in links:
                await link.close()
            raise ChainError(f"cannot reach the chain: {error}") from None
        return chain

    async def close(self) -> None:
        await self.first.close()
        if self.last is not self.first:
            await self.last.close()

    async def step(self, forward: Forward) -> ForwardResult:
        await self.first.send(forward)
        result = await self._receive(ForwardResult)
        if result.micro_batch_id != forward.micro_batch_id or result.step_id != forward.step_id:
            raise ChainError(f"result for micro-batch {result.micro_batch_id} step {result.step_id}, expected "
                             f"{forward.micro_batch_id} step {forward.step_id}")
        return result

    async def _receive(self, kind: type[_M]) -> _M:
        """The next `kind` from the last stage; an Error from either end becomes ChainError."""
        links = [self.last] if self.last is self.first else [self.last, self.first]
        while True:
            tasks: list[asyncio.Task[Message]] = []
            try:
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    await self._receive_any(links, tasks)
            except TimeoutError:
                raise ChainError(f"no {kind.__name__} within {STEP_TIMEOUT_S:.0f} s: a stage may be down") from None
            found: _M | None = None
            for task in tasks:
                if task.cancelled():
                    continue
                message = task.result()
                if isinstance(message, Error):
                    raise ChainError(f"{message.code.value}: {message.message}")
                if isinstance(message, kind):
                    found = message
            if found is not None:
                return found

    @staticmethod
    async def _receive_any(links: list[Link], tasks: list[asyncio.Task[Message]]) -> None:
        """Wait until one of `links` delivers; `tasks` holds every receive, the rest cancelled."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks += [group.create_task(link.receive()) for link in links]
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in tasks:
                    if not task.done():
                        task.cancel()
        except* LinkError as errors:
            raise ChainError(str(errors.exceptions[0])) from None


async def generate_greedy_remote(chain: RemoteChain, prompt_ids: list[int], max_new_tokens: int,
                                 eos_token_ids: tuple[int, ...] = (), micro_batch_id: int | None = None) -> list[int]:
    """Greedy tokens for one prompt through the chain (one row); stops at EOS when ids are given.

    Each call uses a fresh micro-batch id (random unless given): a stage keeps a micro-batch's KV state.
    """
    if micro_batch_id is None:
        micro_batch_id = secrets.randbelow(1 << 31)
    ledger, mirror = Ledger(), Mirror()
    deltas: list[SlotDelta] = [ledger.add_rows(1), ledger.append([len(prompt_ids)])]
    payload = np.array([prompt_ids], dtype=np.int64)  # input_ids: [1, T]
    tokens: list[int] = []
    for step in range(max_new_tokens):
        inputs = replay_deltas(mirror, tuple(deltas))
        result = await chain.step(Forward(micro_batch_id, step, (0,), tuple(deltas), inputs.beam_idx,
                                          inputs.position_ids, payload, None, None))
        token = result.next_token_ids[0]
        tokens.append(token)
        if token in eos_token_ids:
            break
        deltas = [ledger.append([1])]
        payload = np.array([[token]], dtype=np.int64)
    await chain.first.send(ReleaseMicroBatch(micro_batch_id))  # frees its KV state on every stage
    return tokens


async def generate_on_fleet(store: FleetStore, model_dir: Path, prompt_ids: list[int], max_new_tokens: int,
                            ignore_eos: bool = False) -> list[int]:
    spec = load_manifest(model_dir).spec
    chain = await RemoteChain.open(store, model_dir)
    try:
        return await generate_greedy_remote(chain, prompt_ids, max_new_tokens,
                                            () if ignore_eos else spec.eos_token_ids)
    finally:
        await chain.close()
