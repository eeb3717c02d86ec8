"""Review: a Ctrl-C between the moment the chat's next turn hands the kept KV state to its engine (Engine.add) and
the moment the engine's run() takes it.

- Ctrl-C as run() starts, before it took the kept micro-batch: the message is cancelled and the chat goes on (an
  earlier build took the state in add(), so a Ctrl-C there left the chat holding a state it no longer owned, and
  the next message died on "resumed or released already"); the state is freed, not left on the stages.
- Ctrl-C after add() (here in the fleet failover's start_run(), inside the reply's try) but before run(): the chat
  notes "interrupted" and goes on, and the kept micro-batch is freed (it stayed on every stage until the chat ended,
  over the fleet until the agents' idle limit).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller import chat, engine
from deskfleet.controller.chat import ChatOptions, ReplyStats, run_chat
from deskfleet.controller.engine import ChainBroken
from deskfleet.controller.pipeline import LocalPipeline
from tests.controller.test_chat import _chat_model

F32 = CompileSettings(precision=Precision.F32)
# a long first message, so that the second turn shares more than half its prompt with the kept state (resumed)
LINES = "hello there, " + "tell me about the quick brown fox " * 6 + "\nwrite it again\nand once more\n"


def test_ctrl_c_as_the_run_starts_before_it_took_the_kept_state_does_not_end_the_chat(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chat_model(tmp_path, tiny_export)
    pipelines: list[LocalPipeline] = []

    @contextmanager
    def local(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[LocalPipeline, None]]:
        with LocalPipeline(model, 1, settings) as pipeline:
            pipelines.append(pipeline)
            yield pipeline, None

    take_resumed = engine.Engine._take_resumed
    held: list[tuple[int, ...]] = []

    def interrupted(self: engine.Engine) -> None:
        if any(stream.resume is not None for stream in self._streams.values()) and not held:
            held.append(pipelines[0].micro_batches)  # the kept state is on the stage, not taken yet
            raise KeyboardInterrupt
        take_resumed(self)

    monkeypatch.setattr(chat, "_open_chain", local)
    monkeypatch.setattr(engine.Engine, "_take_resumed", interrupted)
    stats: list[ReplyStats] = []
    notes = io.StringIO()
    options = ChatOptions(model=model, max_new_tokens=8, settings=F32)
    # the second reply is interrupted before its first token, so that message is cancelled (not sent, no reply);
    # the third message is answered
    replies = run_chat(options, io.StringIO(LINES), io.StringIO(), notes=notes, on_reply=stats.append)
    assert "[interrupted before the reply began: not sent" in notes.getvalue() and replies == 2
    assert held == [(1,)]
    assert stats[1].reused_tokens == 0  # the state was freed with the interrupted turn, not resumed
    assert pipelines[0].micro_batches == (0,)


def test_ctrl_c_after_add_before_the_run_leaves_no_kv_state_on_the_stages(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chat_model(tmp_path, tiny_export)
    pipelines: list[LocalPipeline] = []

    class Failover:  # the fleet's FleetFailover, as the chat uses it: start_run() before each reply
        def __init__(self) -> None:
            self.runs = 0

        def __call__(self, error: ChainBroken) -> object:
            raise error

        def start_run(self) -> None:
            self.runs += 1
            if self.runs == 2:  # Ctrl-C as the second reply is about to start (its kept state already taken)
                raise KeyboardInterrupt

    @contextmanager
    def with_failover(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[LocalPipeline, Failover]]:
        with LocalPipeline(model, 1, settings) as pipeline:
            pipelines.append(pipeline)
            yield pipeline, Failover()

    monkeypatch.setattr(chat, "_open_chain", with_failover)
    stats: list[ReplyStats] = []
    notes = io.StringIO()
    options = ChatOptions(model=model, max_new_tokens=8, settings=F32)
    # interrupted before its first token: that message is cancelled (not sent, no reply)
    assert run_chat(options, io.StringIO(LINES), io.StringIO(), notes=notes, on_reply=stats.append) == 2
    assert "[interrupted before the reply began: not sent" in notes.getvalue()
    # the chat released the last reply's state when it ended: the stages hold nothing (the interrupted turn's too)
    assert pipelines[0].micro_batches == (0,)
