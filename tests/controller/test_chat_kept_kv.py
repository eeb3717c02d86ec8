"""`deskfleet chat` resumes the KV state each reply leaves on the stages: the replies equal those of a chat that
feeds the whole conversation every turn (--no-reuse-kv), the stages are fed only what follows the prefix the turns
share, a refused message keeps the state for the next, the chat releases it when it ends, a reply that failed over
leaves its state on the new chain for the next turn, and over the fleet a state older than half the agents' idle
limit is released instead of resumed."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.wire import MICRO_BATCH_IDLE_S, Forward
from deskfleet.controller import chat
from deskfleet.controller.chat import FLEET_KEPT_KV_S, ChatOptions, ReplyStats, _KeptReply, run_chat
from deskfleet.controller.engine import ChainBroken, KeptKV
from deskfleet.controller.pipeline import LocalPipeline
from tests.controller.test_chat import _chat_model
from tests.controller.test_engine_failover import BreakingChain

F32 = CompileSettings(precision=Precision.F32)
# Long first messages: a resumed turn must find at least half its prompt kept (the tiny model's replies re-encode
# to many more tokens than it generated, and what follows them is fed again)
LINES = ("hello there, " + "tell me about the quick brown fox " * 6 + "\nwrite it again\n/reset\n"
         + "and once more, " + "the lazy dog sleeps in the sun " * 6 + "\n" + "x" * 600 + "\nthanks\n")


class _Fed(LocalPipeline):
    """A local pipeline that counts the prompt tokens its steps carry (a row's widest, every step)."""

    fed = 0

    def submit(self, message: Forward) -> None:
        assert message.input_ids is not None
        type(self).fed += message.input_ids.shape[1]
        super().submit(message)


def _chat(model: Path, reuse: bool, monkeypatch: pytest.MonkeyPatch, stages: int = 1,
          prompt_lookup: bool = False) -> tuple[str, list[ReplyStats], int, _Fed]:
    opened: list[_Fed] = []

    @contextmanager
    def counting_chain(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[_Fed, None]]:
        with _Fed(model, options.stages, settings) as pipeline:
            opened.append(pipeline)
            yield pipeline, None

    monkeypatch.setattr(chat, "_open_chain", counting_chain)
    _Fed.fed = 0
    stats: list[ReplyStats] = []
    out = io.StringIO()
    options = ChatOptions(model=model, max_new_tokens=8, settings=F32, stages=stages, reuse_kv=reuse,
                          prompt_lookup=prompt_lookup)
    assert run_chat(options, io.StringIO(LINES), out, notes=io.StringIO(), on_reply=stats.append) == 4
    return out.getvalue(), stats, _Fed.fed, opened[0]


@pytest.mark.parametrize(("stages", "prompt_lookup"), [(1, False), (2, True)])
def test_a_chat_resumes_each_replys_kv_state_and_replies_as_if_fed_whole(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, stages: int, prompt_lookup: bool) -> None:
    model = _chat_model(tmp_path, tiny_export)
    whole, whole_stats, whole_fed, _ = _chat(model, False, monkeypatch, stages, prompt_lookup)
    resumed, stats, fed, pipeline = _chat(model, True, monkeypatch, stages, prompt_lookup)
    assert resumed == whole
    assert [s.prompt_tokens for s in stats] == [s.prompt_tokens for s in whole_stats]
    assert [s.reused_tokens for s in whole_stats] == [0, 0, 0, 0]
    # turn 1 has nothing kept; turn 2 repeats turn 1's prompt and reply; after /reset the prompts share only the
    # template's first tokens, too few to resume: fed whole; the turn after it, with the too-long message between
    # (not sent), resumes again
    assert stats[0].reused_tokens == 0
    assert stats[1].reused_tokens >= stats[0].prompt_tokens
    assert stats[2].reused_tokens == 0 and stats[3].reused_tokens >= stats[2].prompt_tokens
    # the stages were fed that much less; the replies' own tokens are fed alike either way
    assert whole_fed - fed == sum(s.reused_tokens for s in stats)
    assert pipeline.micro_batches == (0,) * stages  # the chat released the last reply's state when it ended


def test_a_kept_state_is_resumed_on_its_own_chain_only_and_over_the_fleet_only_while_fresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert FLEET_KEPT_KV_S == MICRO_BATCH_IDLE_S / 2
    released: list[str] = []

    class Kept(KeptKV):
        def __init__(self, chain: object, name: str) -> None:
            self.chain, self.name = chain, name  # type: ignore[assignment]

        def release(self) -> None:
            released.append(self.name)

    chain, other = object(), object()
    clock = [1000.0]
    monkeypatch.setattr(chat.time, "monotonic", lambda: clock[0])
    for fleet in (False, True):
        kept = _KeptReply(fleet)
        state = Kept(chain, f"fleet={fleet}")
        kept.hold(state)
        clock[0] += FLEET_KEPT_KV_S - 1
        assert kept.resumable(chain) is state  # fresh enough anywhere
        clock[0] += 2
        assert kept.resumable(chain) is (None if fleet else state)  # the agents may free it soon: not resumed
        assert released == (["fleet=True"] if fleet else [])
    kept = _KeptReply(False)
    kept.hold(Kept(chain, "a"))
    assert kept.resumable(other) is None and released[-1] == "a"  # a failover moved the chat to another chain
    kept.hold(Kept(chain, "b"))
    kept.hold(Kept(chain, "c"))  # a newer state replaces it
    assert released[-1] == "b"
    with kept:
        pass
    assert released[-1] == "c" and kept.resumable(chain) is None


def test_after_a_failover_mid_reply_the_next_turn_resumes_on_the_new_chain(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet's failover played by local pipelines: the first chain breaks in the first reply, which resumes on
    # the chain `recover` makes, fed whole there; the second turn resumes the state that reply left on that chain.
    model = _chat_model(tmp_path, tiny_export)
    lines = "hello there, " + "tell me about the quick brown fox " * 6 + "\nwrite it again\n"
    plain = io.StringIO()
    run_chat(ChatOptions(model=model, max_new_tokens=8, settings=F32, reuse_kv=False), io.StringIO(lines), plain)
    chains: list[BreakingChain] = []

    @contextmanager
    def breaking_chain(options: ChatOptions, settings: CompileSettings) -> Iterator[tuple[BreakingChain, object]]:
        with LocalPipeline(model, 2, settings) as first, LocalPipeline(model, 1, settings) as second:
            chains.append(BreakingChain(first, 4))

            class Failover:
                def __call__(self, error: ChainBroken) -> BreakingChain:
                    chains.append(BreakingChain(second, None))
                    return chains[-1]

                def start_run(self) -> None:
                    pass

            yield chains[0], Failover()

    monkeypatch.setattr(chat, "_open_chain", breaking_chain)
    stats: list[ReplyStats] = []
    out = io.StringIO()
    assert run_chat(ChatOptions(model=model, max_new_tokens=8, settings=F32), io.StringIO(lines), out,
                    on_reply=stats.append) == 2
    assert out.getvalue() == plain.getvalue() and len(chains) == 2
    assert stats[0].reused_tokens == 0 and stats[1].reused_tokens >= stats[0].prompt_tokens
