"""EngineOptions.rows_when_waiting: a stream prefilled ahead joins a full micro-batch past max_rows rather than stall
after its first token until a running stream ends (serve's 9th to 12th request on 8 rows: nothing for 5 s)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline

from .test_engine import F32, PROMPTS, run_streams

NEW_TOKENS = 24


def _timeline(model: Path, options: EngineOptions, prompts: list[list[int]]) -> tuple[list[int], dict[int, list[int]]]:
    """The stream of each token in the order they came, and each stream's tokens."""
    manifest = load_manifest(model)
    order: list[int] = []
    with LocalPipeline(model, 1, F32, manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, None, options)
        for prompt in prompts:
            engine.add(StreamRequest(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True))
        results = engine.run(on_token=lambda stream_id, token: order.append(stream_id))
    return order, {stream_id: result.tokens for stream_id, result in results.items()}


def _longest_silence(order: list[int], stream_id: int) -> int:
    """The most tokens of other streams that came between two of this one's, after its first."""
    seen = [at for at, which in enumerate(order) if which == stream_id]
    return max(later - earlier - 1 for earlier, later in itertools.pairwise(seen))


@pytest.mark.parametrize("rows_when_waiting", [0, 4])
def test_streams_prefilled_ahead_run_at_once_past_max_rows_and_give_their_solo_tokens(target: Path,
                                                                                     rows_when_waiting: int) -> None:
    prompts = PROMPTS[:4]
    options = EngineOptions(max_rows=2, micro_batches=1, rows_when_waiting=rows_when_waiting)
    order, tokens = _timeline(target, options, prompts)
    for index, prompt in enumerate(prompts):
        assert tokens[index] == run_streams(target, [StreamRequest(prompt, max_new_tokens=NEW_TOKENS,
                                                                   ignore_eos=True)])[0]
    waited = max(_longest_silence(order, stream_id) for stream_id in range(len(prompts)))
    if rows_when_waiting:  # every stream goes on at every step once it has its first token
        assert waited <= 2 * len(prompts), order  # one step more while a newcomer is admitted
    else:  # two of them waited, prefilled, for the first two's whole replies
        assert waited >= NEW_TOKENS, order


@pytest.mark.parametrize("rows_when_waiting", [3, 9])
def test_rows_when_waiting_outside_max_rows_to_twice_it_is_refused(rows_when_waiting: int) -> None:
    # above twice max_rows it was taken and never reached: no more streams than that are prefilled ahead
    with pytest.raises(ValueError, match=r"rows_when_waiting must be 0 \(max_rows\) or from max_rows \(4\) to "
                                         r"twice it"):
        EngineOptions(max_rows=4, rows_when_waiting=rows_when_waiting)
