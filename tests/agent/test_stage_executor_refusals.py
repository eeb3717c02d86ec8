"""A step the executor refuses changes nothing: its micro-batch, the KV state, and the micro-batches it
would have admitted stay as they were, so the driver's correct step still runs and computes what it
would have computed without the bad one."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from deskfleet.agent.kv_memory_guard import KvMemoryRefused
from deskfleet.agent.stage import CompileSettings, LayerRange, Precision, Stage
from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.kv_ledger import AppendSlots, LedgerError
from deskfleet.common.model_spec import load_manifest
from deskfleet.common.wire import DraftInfo, Forward, ForwardResult, SamplingInfo
from deskfleet.controller.batch_track import BatchTrack

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def whole(tiny_export: Path) -> Stage:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    return Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))


@pytest.fixture(scope="module")
def first_half(tiny_export: Path) -> Stage:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    return Stage(tiny_export, manifest, LayerRange(0, layers // 2, layers), CompileSettings(precision=Precision.F32))


@pytest.fixture(scope="module")
def second_half(tiny_export: Path) -> Stage:
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    return Stage(tiny_export, manifest, LayerRange(layers // 2, layers, layers),
                 CompileSettings(precision=Precision.F32))


def result(executor: StageExecutor, message: Forward) -> ForwardResult:
    output = executor.run(message, return_logits=True)
    assert isinstance(output, ForwardResult)
    return output


def reference_logits(stage: Stage, steps: list[list[int]]) -> np.ndarray:
    """The logits of the last step when the steps run on a fresh executor with nothing refused."""
    executor = StageExecutor(stage, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    for tokens in steps:
        output = result(executor, track.step([tokens]))
    assert output.logits is not None
    return output.logits


def test_a_duplicated_step_is_refused_and_the_next_step_computes_as_if_it_never_came(whole: Stage) -> None:
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    first = track.step([PROMPT])
    result(executor, first)
    with pytest.raises(LedgerError, match="a duplicate or out of order"):
        executor.run(first)
    second = result(executor, track.step([[9]]))
    assert second.logits is not None
    np.testing.assert_array_equal(second.logits, reference_logits(whole, [PROMPT, [9]]))


def test_a_refused_admission_keeps_the_micro_batch_it_would_have_admitted(whole: Stage) -> None:
    executor = StageExecutor(whole, 256)
    host = BatchTrack(1, 256)
    host.add_row(0)
    result(executor, host.step([PROMPT]))
    newcomer = BatchTrack(2, 256)
    newcomer.add_row(1)
    result(executor, newcomer.step([[3, 4]]))
    host.admit(1, 2, newcomer.next_position(1))
    good = host.step([[9], [10]])
    append = good.slot_deltas[-1]
    assert isinstance(append, AppendSlots)
    off_by_one = AppendSlots(append.count, append.live_counts, tuple(p + 1 for p in append.first_positions))
    with pytest.raises(LedgerError, match="desync"):
        executor.run(replace(good, slot_deltas=(*good.slot_deltas[:-1], off_by_one)))
    assert executor.micro_batches == 2  # the newcomer's prefilled micro-batch is still held
    merged = result(executor, good)
    assert executor.micro_batches == 1
    assert merged.logits is not None
    np.testing.assert_array_equal(merged.logits[0], reference_logits(whole, [PROMPT, [9]])[0])


def _host_and_newcomer(stage: Stage) -> tuple[StageExecutor, BatchTrack, BatchTrack]:
    """An executor running micro-batch 1 (one row, PROMPT fed) and micro-batch 2 (one row prefilled with 3, 4, 5)."""
    executor = StageExecutor(stage, 256)
    host = BatchTrack(1, 256)
    host.add_row(0)
    result(executor, host.step([PROMPT]))
    newcomer = BatchTrack(2, 256)
    newcomer.add_row(1)
    result(executor, newcomer.step([[3, 4, 5]]))
    return executor, host, newcomer


def test_a_kept_source_stays_as_it_was_after_its_row_is_copied_and_serves_a_later_prompt(whole: Stage) -> None:
    """Forward.keep_sources: the admitted row's source micro-batch stays (a prefix cache's entry), and a later step on
    it computes what a fresh prefill of its tokens plus the new ones computes."""
    executor, host, newcomer = _host_and_newcomer(whole)
    host.admit(1, 2, newcomer.next_position(1), keep_source=True)
    merged = result(executor, host.step([[9], [10]]))
    assert executor.micro_batches == 2  # the source is kept
    assert merged.logits is not None
    # the copied row beside the host's (its padding sums in another order): within f32 rounding
    np.testing.assert_allclose(merged.logits[1], reference_logits(whole, [[3, 4, 5], [10]])[0], rtol=1e-4, atol=1e-5)
    resumed = result(executor, newcomer.step([[11]]))  # the kept source goes on as it was
    assert resumed.logits is not None
    np.testing.assert_array_equal(resumed.logits, reference_logits(whole, [[3, 4, 5], [11]]))


def test_a_source_whose_row_is_not_its_first_slots_alone_is_refused_by_name(whole: Stage) -> None:
    """An admitted row is copied as its source's first live_slots: a source with a dead slot among them (a rolled back
    draft not compacted) would merge wrong, so the step is refused and nothing changes."""
    executor, host, newcomer = _host_and_newcomer(whole)
    newcomer.reject(1, 1)
    result(executor, newcomer.step([[6]]))  # slots 0, 1 and 3 live, 2 dead
    host.admit(1, 2, newcomer.next_position(1))
    with pytest.raises(LedgerError, match="admission of 3 slots from micro-batch 2, whose row holds 3 live slots of 4"):
        executor.run(host.step([[9], [10]]))
    assert executor.micro_batches == 2


def test_a_row_copied_out_holds_its_live_slots_alone_and_goes_on_as_a_micro_batch_of_its_own(whole: Stage) -> None:
    """CopyRow (Forward.copy_into): row 1 of a two-row micro-batch, a rejected token dead in its middle, is copied
    into micro-batch 5 as its live slots alone; a step there computes what a fresh run of its tokens computes."""
    executor, host, newcomer = _host_and_newcomer(whole)
    host.admit(1, 2, newcomer.next_position(1))
    result(executor, host.step([[9], [10, 11]]))  # row 1: 3, 4, 5, 10, 11
    host.reject(1, 1)  # 11 dies
    result(executor, host.step([[12], [13]]))  # row 1: 3, 4, 5, 10, 13 with a dead slot before 13
    host.copy_row(1, 5)
    host.drop({1})
    result(executor, host.step([[14]]))
    assert sorted(executor.micro_batch_ids()) == [1, 5]
    copied = BatchTrack.copied(5, 256, 1, 5)
    resumed = result(executor, copied.step([[15]]))
    assert resumed.logits is not None
    np.testing.assert_allclose(resumed.logits, reference_logits(whole, [[3, 4, 5, 10, 13], [15]]),
                               rtol=1e-4, atol=1e-5)
    host.copy_row(0, 5)  # into a micro-batch the stage holds: refused, nothing changes
    with pytest.raises(LedgerError, match="a row copied into micro-batch 5, which this stage holds already"):
        executor.run(host.step([[16]]))
    assert sorted(executor.micro_batch_ids()) == [1, 5]


class CopyRefusingGuard:
    """A KV memory guard with room for a step but not for its row copies (or, `room` False, not even the step)."""

    def __init__(self, room: bool = True) -> None:
        self.room = room
        self.asked: list[str] = []

    def admit(self, growth_bytes: int, what: Callable[[], str]) -> None:
        self.asked.append(what())
        if "copied" in what() or not self.room:
            raise KvMemoryRefused(f"{what()}: no memory")


def test_a_step_whose_row_copy_the_memory_guard_refuses_runs_without_it(whole: Stage) -> None:
    """The copy is the driver's option (its prefix cache): the step runs, its tokens those of the step with nothing
    copied, the copy is not made, and the result says so; where even the step has no room, it is refused whole."""
    executor, host, newcomer = _host_and_newcomer(whole)
    host.admit(1, 2, newcomer.next_position(1))
    result(executor, host.step([[9], [10]]))
    plain = copy.deepcopy(host)
    expected = reference_logits(whole, [PROMPT, [9], [11]])
    host.copy_row(1, 5)
    host.drop({1})
    executor.memory_guard, executor.kv_bytes_per_slot = CopyRefusingGuard(room=False), 1  # type: ignore[assignment]
    with pytest.raises(KvMemoryRefused, match="no memory"):
        executor.run(host.step([[11]]))
    assert sorted(executor.micro_batch_ids()) == [1]  # nothing changed
    guard = executor.memory_guard = CopyRefusingGuard()  # type: ignore[assignment]
    host = copy.deepcopy(plain)
    host.copy_row(1, 5)
    host.drop({1})
    output = result(executor, host.step([[11]]))
    assert output.copies_dropped and sorted(executor.micro_batch_ids()) == [1]
    assert guard.asked[0].endswith("copied)") and "copied" not in guard.asked[1]
    assert output.logits is not None
    np.testing.assert_allclose(output.logits, expected, rtol=1e-4, atol=1e-5)


def test_the_real_guard_lets_the_step_without_its_copies_through_by_their_bytes(whole: Stage) -> None:
    """The KV memory guard itself, counting bytes: 5 MiB above its floor, a step that grows nothing but copies a row of
    a few slots at 1 MiB a slot (2 MiB counted each: the plugin doubles a full cache) is let through without it."""
    from deskfleet.agent.kv_memory_guard import KvMemoryGuard

    mib = 1 << 20
    executor, host, newcomer = _host_and_newcomer(whole)
    host.admit(1, 2, newcomer.next_position(1))
    result(executor, host.step([[9], [10]]))
    host.copy_row(1, 5)
    host.drop({1})
    executor.memory_guard = KvMemoryGuard(lambda: (69 * mib, 1024 * mib), floor_bytes=64 * mib)
    executor.kv_bytes_per_slot = mib
    output = result(executor, host.step([[11]]))
    assert output.copies_dropped and sorted(executor.micro_batch_ids()) == [1]


def test_a_step_whose_copies_an_earlier_stage_dropped_makes_none(first_half: Stage, second_half: Stage) -> None:
    first, second = StageExecutor(first_half, 256), StageExecutor(second_half, 256)
    host = BatchTrack(1, 256)
    host.add_row(0)
    host.add_row(1)
    second.run(first.run(host.step([PROMPT, PROMPT])))  # type: ignore[arg-type]
    host.copy_row(1, 5)
    host.drop({1})
    first.memory_guard, first.kv_bytes_per_slot = CopyRefusingGuard(), 1  # type: ignore[assignment]
    relayed = first.run(host.step([[9]]))
    assert isinstance(relayed, Forward) and relayed.copies_dropped and relayed.copy_into == (5,)
    output = second.run(relayed)
    assert isinstance(output, ForwardResult) and output.copies_dropped
    assert first.micro_batch_ids() == second.micro_batch_ids() == [1]


def test_a_refused_first_step_leaves_no_micro_batch_behind(whole: Stage) -> None:
    executor = StageExecutor(whole, 256)
    for batch_id in range(1, 50):
        track = BatchTrack(batch_id, 256)
        track.add_row(0)
        bad = replace(track.step([PROMPT]), input_ids=np.array([[5, 6, 7, 10**9]], dtype=np.int64))
        with pytest.raises(LedgerError, match="outside the vocabulary"):
            executor.run(bad)
    assert executor.micro_batches == 0


def test_inputs_that_do_not_fit_the_call_are_refused_by_name(whole: Stage, second_half: Stage) -> None:
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    step = track.step([PROMPT])
    with pytest.raises(LedgerError, match="input_ids outside the vocabulary"):
        executor.run(replace(step, input_ids=np.array([[5, 6, 7, -5]], dtype=np.int64)))
    later = StageExecutor(second_half, 256)
    hidden = np.zeros((1, len(PROMPT), second_half.hidden_size), dtype=np.float32)
    as_hidden = replace(step, input_ids=None, hidden_states=hidden, layer_start=second_half.layers.start)
    with pytest.raises(LedgerError, match="hidden_states of shape"):
        later.run(replace(as_hidden, hidden_states=hidden[..., :7]))
    hidden[0, 1, 3] = np.nan
    with pytest.raises(LedgerError, match="NaN or infinite"):
        later.run(as_hidden)
    assert later.micro_batches == 0


def test_a_sampled_draft_outside_the_vocabulary_is_refused_before_the_call(whole: Stage) -> None:
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    result(executor, track.step([PROMPT]))
    sampling = SamplingInfo((0.8,), (0,), (1.0,), (7,))
    draft = DraftInfo((2,), np.array([[3, whole.vocab_size + 5]], dtype=np.int64), one_hot=True)
    bad = replace(copy.deepcopy(track).step([[9, 3, 4]], draft=draft), sampling=sampling)
    with pytest.raises(LedgerError, match="draft tokens outside the vocabulary"):
        executor.run(bad)
    again = result(executor, track.step([[9]]))
    assert again.logits is not None
    np.testing.assert_array_equal(again.logits, reference_logits(whole, [PROMPT, [9]]))


def test_a_row_with_no_live_slot_is_no_fault(whole: Stage, first_half: Stage, second_half: Stage) -> None:
    """A row that feeds nothing and holds no slot yet attends to nothing: in `fast` precision its positions
    can come out NaN (seen with a 1.1B model) and its argmax past the vocabulary. That is not a bad input:
    the next stage takes the hidden states and the last stage's result ignores the row."""
    first, last = StageExecutor(first_half, 256), StageExecutor(second_half, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    track.add_row(1)
    step = track.step([PROMPT, []])
    hidden = first.run(step)
    assert isinstance(hidden, Forward) and hidden.hidden_states is not None
    states = np.array(hidden.hidden_states)
    states[1] = np.nan  # what the plugin may make of a row that attends to nothing
    output = result(last, replace(hidden, hidden_states=states))
    assert output.logits is not None
    np.testing.assert_array_equal(output.logits[0], reference_logits(whole, [PROMPT])[0])


def test_a_step_for_another_stage_is_refused(tiny_export: Path, whole: Stage, second_half: Stage) -> None:
    # A chain whose PCs disagree with the plan (a re-deploy that failed midway left stage 0 running [0, 2)
    # and relaying to a PC that runs [3, 4)): the step names the layer it is for, and a stage of another
    # range refuses it instead of computing wrong tokens.
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    f32 = CompileSettings(precision=Precision.F32)
    first_half = Stage(tiny_export, manifest, LayerRange(0, layers // 2, layers), f32)
    last_quarter = Stage(tiny_export, manifest, LayerRange(layers - 1, layers, layers), f32)
    track = BatchTrack(1, 256)
    track.add_row(0)
    hidden = StageExecutor(first_half, 256).run(track.step([PROMPT]))
    assert isinstance(hidden, Forward) and hidden.layer_start == layers // 2
    misplaced = StageExecutor(last_quarter, 256)
    with pytest.raises(LedgerError, match=rf"is for the stage from layer {layers // 2}, this stage runs layers "
                                          rf"\[{layers - 1}:{layers}\]"):
        misplaced.run(hidden)
    assert misplaced.micro_batches == 0
    assert isinstance(StageExecutor(second_half, 256).run(hidden), ForwardResult)


def test_a_step_whose_tensors_are_smaller_than_its_append_is_refused_before_any_delta(whole: Stage) -> None:
    # A peer's small Forward claiming a wide call: refused on its tensors' shape, the mirror untouched.
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    good = track.step([PROMPT])
    wide = replace(good, slot_deltas=(AppendSlots(count=200, live_counts=(0,), first_positions=(0,)),))
    with pytest.raises(LedgerError, match=r"position_ids of shape \[1, 4\] for an append of 1 rows x 200 slots"):
        executor.run(wide)
    assert result(executor, good).logits is not None


@pytest.mark.parametrize("drafted", [False, True])
def test_a_token_outside_the_vocabulary_from_the_call_is_named_and_an_idle_rows_is_ignored(
        whole: Stage, monkeypatch: pytest.MonkeyPatch, drafted: bool) -> None:
    """Logits that are not finite make the in-graph argmax return any index: a live row's is refused by name
    (plain greedy steps check it in plain Python, drafted ones with numpy), an idle row's is nobody's token."""
    from deskfleet.agent import stage as stage_module

    real_forward = stage_module.StageSession.forward
    corrupt: dict[tuple[int, int], int] = {}

    def forward(self: stage_module.StageSession, *args: object, **kwargs: object) -> stage_module.StageOutput:
        output = real_forward(self, *args, **kwargs)  # type: ignore[arg-type]
        assert output.next_tokens is not None
        for (row, position), token in corrupt.items():
            output.next_tokens[row, position] = token
        return output

    monkeypatch.setattr(stage_module.StageSession, "forward", forward)
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    track.add_row(1)
    corrupt.update({(1, 0): -7})  # row 1 feeds nothing: its argmax is garbage and no fault
    first = result(executor, track.step([PROMPT, []]))
    assert first.next_token_ids[1] == 0
    vocab = whole.vocab_size
    draft = DraftInfo((2, 0), np.array([[3, 4], [0, 0]], dtype=np.int64), None) if drafted else None
    feed = [[first.next_token_ids[0], 3, 4], [9]] if drafted else [[first.next_token_ids[0]], [9]]
    corrupt.clear()
    corrupt.update({(1, 0): vocab + 5})  # row 1 is live now
    with pytest.raises(RuntimeError, match=rf"step 1: the stage chose tokens \[{vocab + 5}\] outside the vocabulary "
                                           rf"of {vocab} at \(row, position\) \[\[1, 0\]\]"):
        executor.run(track.step(feed, draft=draft))


class RecordingGuard:
    """A KV memory guard that lets everything grow, keeping what each step asked."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def admit(self, growth_bytes: int, what: object) -> None:
        self.asked.append(growth_bytes)


def test_the_memory_guard_is_asked_for_the_padding_an_admitted_row_brings(whole: Stage) -> None:
    # rows x (slots + new ones) said 3 slots for a step that padded two rows of 4 slots to a newcomer's 40
    from deskfleet.agent.kv_memory_guard import SLOT_GROWTH

    guard = RecordingGuard()
    executor = StageExecutor(whole, 256, guard, kv_bytes_per_slot=1)  # type: ignore[arg-type]
    host = BatchTrack(1, 256)
    host.add_row(0)
    host.add_row(1)
    result(executor, host.step([PROMPT, PROMPT]))  # 2 rows x 4 slots
    newcomer = BatchTrack(2, 256)
    newcomer.add_row(2)
    result(executor, newcomer.step([list(range(3, 43))]))  # 1 row x 40 slots
    host.admit(2, 2, newcomer.next_position(2))
    result(executor, host.step([[9], [10], [11]]))  # 3 rows x 41 slots
    assert guard.asked == [8 * SLOT_GROWTH, 40 * SLOT_GROWTH, (3 * 41 - 2 * 4) * SLOT_GROWTH]


def test_the_memory_guard_is_asked_for_the_buffers_of_a_call_larger_than_its_request_ran(tiny_export: Path) -> None:
    # the CPU plugin keeps the buffers of a request's largest call: 16 prompts of 1,000 tokens in one call grew the
    # demo target's stage by 722 MiB where its u8 KV cache alone was counted (70 MiB)
    manifest = load_manifest(tiny_export)
    layers = manifest.spec.num_layers
    stage = Stage(tiny_export, manifest, LayerRange(0, layers, layers), CompileSettings(precision=Precision.F32))
    guard = RecordingGuard()
    executor = StageExecutor(stage, 256, guard, scratch_bytes_per_token=1000)  # type: ignore[arg-type]
    host = BatchTrack(1, 256)
    host.add_row(0)
    host.add_row(1)
    result(executor, host.step([PROMPT, PROMPT]))  # 2 rows x 4 tokens, on the request the warm-up call's 1 left
    result(executor, host.step([[9], [10]]))  # smaller: its buffers are there
    result(executor, host.step([list(range(20, 30)), list(range(30, 40))]))  # 20 tokens: 12 more than before
    executor.release(1)  # its request goes back to the stage, buffers and all
    again = BatchTrack(2, 256)
    again.add_row(0)
    result(executor, again.step([list(range(3, 18))]))  # 15 tokens on that request: within its largest call
    result(executor, again.step([[4]]))
    other = BatchTrack(3, 256)  # a second micro-batch at once: a request of its own, new
    other.add_row(0)
    result(executor, other.step([list(range(3, 9))]))
    assert guard.asked == [7000, 0, 12000, 0, 0, 6000]


@pytest.mark.parametrize(("scored", "says"), [
    ([[6, 7, 8, -1], [4, -1, -1, 9]], "scored tokens at positions the call does not feed"),  # row 1 feeds 2
    ([[6, 7, 8, 10**6], [-1, -1, -1, -1]], "scored tokens outside the vocabulary"),
])
def test_a_scored_step_of_positions_it_does_not_feed_or_tokens_outside_the_vocabulary_is_refused(
        whole: Stage, scored: list[list[int]], says: str) -> None:
    """Scoring a pad position would return the log-probability of nothing; both refused before the call, so the
    micro-batch's next good step computes as if the bad one never came."""
    executor = StageExecutor(whole, 256)
    track = BatchTrack(1, 256)
    track.add_row(0)
    track.add_row(1)
    bad = track.step([PROMPT, [3, 4]], logprobs=(0, 0), scored_ids=np.array(scored, dtype=np.int64))
    with pytest.raises(LedgerError, match=says):
        executor.run(bad)
    good = replace(bad, scored_ids=np.array([[6, 7, 8, -1], [-1, -1, -1, -1]], dtype=np.int64))
    output = result(executor, good)
    assert output.scored_logprobs is not None and (output.scored_logprobs[0, :3] < 0).all()
    assert (output.scored_logprobs[0, 3:] == 0).all() and (output.scored_logprobs[1] == 0).all()
