"""Prompt-lookup drafting: what it proposes, and its micro-batch bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.common.model_spec import ManifestError, load_manifest
from deskfleet.common.speculative import DEFAULT_PRIOR_ACCEPTANCE, SamplingParams
from deskfleet.controller.draft import DraftRow, Proposal, open_drafter
from deskfleet.controller.engine import Engine, EngineOptions, StreamRequest
from deskfleet.controller.pipeline import LocalPipeline
from deskfleet.controller.prompt_lookup import LOOKUP_PRIOR_ACCEPTANCE, PromptLookupDraft, lookup_continuation


def test_the_longest_suffix_picks_the_continuation() -> None:
    # "7 8" occurred before followed by 9 10; "8" alone occurred later followed by 5: the longer match wins.
    context = [7, 8, 9, 10, 8, 5, 6, 7, 8]
    assert lookup_continuation(context, 2) == [9, 10]
    assert lookup_continuation(context, 2, max_ngram=1, min_ngram=1) == [5, 6]


def test_the_most_recent_occurrence_wins() -> None:
    assert lookup_continuation([3, 1, 3, 2, 3], 1, min_ngram=1) == [2]
    assert lookup_continuation([3, 1, 3, 2, 3, 1, 3, 2, 3], 1) == [1]


def test_a_copy_that_reaches_the_end_repeats_the_period() -> None:
    assert lookup_continuation([1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert lookup_continuation([4, 4], 3, min_ngram=1) == [4, 4, 4]


@pytest.mark.parametrize("context", [[], [5], [1, 2, 3, 4]])
def test_no_earlier_occurrence_no_proposal(context: list[int]) -> None:
    assert lookup_continuation(context, 4) == []


def test_k_and_ngram_bounds() -> None:
    assert lookup_continuation([1, 2, 1, 2], 0) == []
    assert lookup_continuation([9, 1, 2, 9, 1, 2], 2, max_ngram=3, min_ngram=3) == [9, 1]
    assert lookup_continuation([5, 1, 2, 7, 2], 2) == []  # only a 1-token match, a guess: none by default
    assert lookup_continuation([5, 1, 2, 7, 2], 2, min_ngram=1) == [7, 2]
    with pytest.raises(ValueError, match="n-gram"):
        lookup_continuation([1, 2], 1, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="n-gram"):
        PromptLookupDraft(min_ngram=0)


def test_proposals_say_one_hot_and_carry_no_distributions() -> None:
    drafter = PromptLookupDraft()
    drafter.prefill(0, 10, [1, 2, 3])
    drafter.prefill(1, 11, [1, 5])
    drafter.merge(0, 11, 1)
    assert drafter.has_batch(0) and not drafter.has_batch(1)
    rows = [DraftRow(10, [1, 2, 3, 1, 2], 3, None, 0),
            DraftRow(11, [1, 5, 1, 5], 2, SamplingParams(temperature=1.0), 0)]
    proposal = drafter.propose(0, rows)
    assert proposal.tokens == {10: [3, 1, 2], 11: [1, 5]}
    assert proposal.one_hot and proposal.probs == {}  # the last stage builds q: no [K, V] on the wire
    drafter.drop(0, {10})
    assert drafter.has_batch(0)
    drafter.drop(0, {11})
    assert not drafter.has_batch(0)
    with pytest.raises(ValueError, match="micro-batch 0"):
        drafter.propose(0, rows)


def test_open_drafter_picks_the_kind_asked_for() -> None:
    assert open_drafter(None, False) is None
    assert isinstance(open_drafter(None, True), PromptLookupDraft)


def _brute_force(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The definition, spelled out: longest suffix first, most recent earlier start, periodic copy."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        starts = [s for s in range(len(context) - n) if context[s:s + n] == context[-n:]]
        if starts and k > 0:
            extended = list(context)
            follow = starts[-1] + n
            for index in range(follow, follow + k):
                extended.append(extended[index])
            return extended[len(context):]
    return []


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(0, 6), st.integers(1, 5), st.integers(1, 5))
def test_lookup_matches_its_definition(context: list[int], k: int, max_ngram: int, min_ngram: int) -> None:
    min_ngram = min(min_ngram, max_ngram)
    assert lookup_continuation(context, k, max_ngram, min_ngram) == _brute_force(context, k, max_ngram, min_ngram)


def test_one_pc_needs_a_2_token_match_and_a_chain_of_pcs_takes_1() -> None:
    # A verification costs ~2.5 plain calls on one PC and little more than a step over the fleet's hops
    local, fleet = open_drafter(None, True), open_drafter(None, True, over_fleet=True)
    assert isinstance(local, PromptLookupDraft) and local.min_ngram == 2
    assert isinstance(fleet, PromptLookupDraft) and fleet.min_ngram == 1


def test_a_draft_folder_that_is_no_export_is_named_as_the_draft(tmp_path: Path) -> None:
    # beside --model, "nowhere does not exist" did not say which of the two folders was wrong
    with pytest.raises(ManifestError, match=r"^--draft: .*nowhere does not exist$"):
        open_drafter(tmp_path / "nowhere", False)
    with pytest.raises(ManifestError, match=r"^--draft: .*it is not a deskfleet export"):
        open_drafter(tmp_path, True)


@pytest.mark.parametrize("prompt_lookup", [False, True])
def test_a_damaged_draft_file_is_named_as_the_draft(tmp_path: Path, other_draft: Path, prompt_lookup: bool) -> None:
    # a truncated draft .bin said "... has N bytes, the manifest says M" without the --draft: its manifest has
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(other_draft, draft)
    with (draft / "layer_000.bin").open("r+b") as layer:
        layer.truncate(10)
    with pytest.raises(ManifestError, match=r"^--draft: .*layer_000\.bin has 10 bytes"):
        open_drafter(draft, prompt_lookup)


def test_a_draft_model_no_smaller_than_the_target_is_warned_of(target: Path, other_draft: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    # `--draft` given the target itself, or the two swapped, ran slower than plain decoding without a word
    import logging

    with caplog.at_level(logging.WARNING, logger="deskfleet"):
        open_drafter(other_draft, False, target=target)
        assert not any("not smaller" in record.getMessage() for record in caplog.records)
        open_drafter(target, False, target=target)
    assert any(record.getMessage().startswith("--draft is not smaller than the target (") and "--prompt-lookup" in
               record.getMessage() for record in caplog.records)


class KRecordingLookup(PromptLookupDraft):
    """Prompt lookup that records the K each round asked of it."""

    def __init__(self, prior_acceptance: float) -> None:
        super().__init__()
        self.prior_acceptance = prior_acceptance
        self.asked: list[int] = []

    def propose(self, micro_batch_id: int, rows: list[DraftRow]) -> Proposal:
        self.asked.extend(row.k for row in rows)
        return super().propose(micro_batch_id, rows)


@pytest.mark.parametrize(("prior", "first_k"), [(LOOKUP_PRIOR_ACCEPTANCE, 8), (DEFAULT_PRIOR_ACCEPTANCE, 3)])
def test_a_lookup_streams_first_rounds_run_at_the_k_its_own_prior_gives(target: Path, prior: float,
                                                                        first_k: int) -> None:
    # From a draft model's prior (0.6) a lookup stream's first rounds asked for 3 tokens and climbed, where a
    # copied token is accepted ~0.9 of the time (demo pair: adaptive K 1.73x of plain decoding, 1.83x with this)
    manifest = load_manifest(target)
    drafter = KRecordingLookup(prior)
    with LocalPipeline(target, 1, CompileSettings(precision=Precision.F32), manifest) as pipeline:
        engine = Engine(pipeline, manifest.spec, drafter, EngineOptions(max_rows=1, micro_batches=1, k_max=8))
        engine.add(StreamRequest([1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], max_new_tokens=20, ignore_eos=True))
        engine.run()
    assert drafter.asked[0] == first_k
