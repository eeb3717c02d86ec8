"""A `--top-k` at or above the vocabulary means no top-k, and the step that carries it must cross the wire.

The engine sent the number as given: one past int64 (`--top-k 9223372036854775808`, "as large as it gets")
ran locally but every agent of a fleet refused the first step ("Forward.sampling.top_ks[0] is outside the
int64 range"), so `generate --fleet` failed mid-run.
"""

from __future__ import annotations

import pytest

from deskfleet.common.model_spec import ModelSpec
from deskfleet.common.speculative import SamplingParams
from deskfleet.common.wire import Forward, ForwardResult, decode, encode
from deskfleet.controller.engine import Engine, StreamRequest

SPEC = ModelSpec(architecture="llama", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4,
                 intermediate_size=16, vocab_size=50, max_context=32, bos_token_id=1, eos_token_ids=(2,),
                 rope_type="default", tie_word_embeddings=False)


class _StopAfterTheFirstStep(Exception):
    pass


class CapturingChain:
    """Keeps what the engine submits and ends the run at its first collect."""

    def __init__(self) -> None:
        self.sent: list[Forward] = []

    def submit(self, message: Forward) -> None:
        self.sent.append(message)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        raise _StopAfterTheFirstStep

    def release(self, batch_id: int) -> None:
        pass


@pytest.mark.parametrize("top_k", [2**63, 2**64 + 5, SPEC.vocab_size])
def test_a_top_k_past_the_vocabulary_crosses_the_wire_as_no_top_k(top_k: int) -> None:
    chain = CapturingChain()
    engine = Engine(chain, SPEC)
    engine.add(StreamRequest([1, 5, 6], max_new_tokens=3, sampling=SamplingParams(temperature=1.0, top_k=top_k),
                             seed=4))
    with pytest.raises(_StopAfterTheFirstStep):
        engine.run()
    received = decode(encode(chain.sent[0]))
    assert isinstance(received, Forward) and received.sampling is not None
    assert received.sampling.top_ks == (0,)


def test_a_top_k_inside_the_vocabulary_travels_as_given() -> None:
    chain = CapturingChain()
    engine = Engine(chain, SPEC)
    engine.add(StreamRequest([1, 5, 6], max_new_tokens=3, sampling=SamplingParams(temperature=1.0, top_k=49),
                             seed=4))
    with pytest.raises(_StopAfterTheFirstStep):
        engine.run()
    sampling = chain.sent[0].sampling
    assert sampling is not None and sampling.top_ks == (49,)
