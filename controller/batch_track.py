"""The driver's view of one micro-batch: its ledger, its rows, and the deltas not yet sent.

The same bookkeeping serves the target chain and the draft model: rows are streams, every change to
rows or slots is a ledger delta queued until the micro-batch's next step, and a step is a Forward whose
beam_idx and position_ids the driver computes from its ledger and a RowOrder that follows the row
reorders as the stages' mirrors will (the stages check both against their mirror).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deskfleet.common.kv_ledger import CompactionPolicy, Ledger, RowOrder, SlotDelta, position_ids
from deskfleet.common.wire import DraftInfo, Forward, LogitsAdjust, SamplingInfo


@dataclass
class BatchTrack:
    micro_batch_id: int
    max_positions: int
    ledger: Ledger = field(init=False)
    order: RowOrder = field(init=False)  # the stages' row order, as their mirrors will replay it
    stream_ids: list[int] = field(default_factory=list)
    pending: list[SlotDelta] = field(default_factory=list)
    admit_from: list[int] = field(default_factory=list)
    keep_sources: list[bool] = field(default_factory=list)  # per admit_from: the stages keep the source (a cache's)
    copy_into: list[int] = field(default_factory=list)  # per CopyRow delta pending: the new micro-batch's id
    steps: int = 0
    in_flight: bool = False

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.max_positions)
        self.order = RowOrder()

    @property
    def rows(self) -> int:
        return len(self.stream_ids)

    # Public methods

    def add_row(self, stream_id: int) -> None:
        """A new empty row for a stream that will be prefilled inside this micro-batch."""
        delta = self.ledger.add_rows(1)
        self.order.reorder(delta.source_rows)
        self.pending.append(delta)
        self.stream_ids.append(stream_id)

    def admit(self, stream_id: int, source_batch: int, live_slots: int, keep_source: bool = False) -> None:
        """Queue the merge of a stream prefilled alone in `source_batch` as the new last row; with `keep_source` the
        stages keep that micro-batch as it was (Forward.keep_sources), else they free it."""
        self.pending.append(self.ledger.admit(live_slots))
        self.order.gathered(self.ledger.rows)  # the stages gather pending reorders on the host to admit
        self.admit_from.append(source_batch)
        self.keep_sources.append(keep_source)
        self.stream_ids.append(stream_id)

    def copy_row(self, stream_id: int, new_batch: int) -> None:
        """Queue a copy of the stream's row (its live slots) into a new one-row micro-batch `new_batch`."""
        self.pending.append(self.ledger.copy_row(self.stream_ids.index(stream_id)))
        self.order.gathered(self.ledger.rows)  # the stages gather pending reorders on the host to copy
        self.copy_into.append(new_batch)

    @classmethod
    def copied(cls, micro_batch_id: int, max_positions: int, stream_id: int, live_slots: int) -> BatchTrack:
        """The driver's view of the one-row micro-batch a copy_row() makes on the stages once its step runs."""
        track = cls(micro_batch_id, max_positions)
        track.ledger.admit(live_slots)
        track.order.gathered(1)
        track.stream_ids.append(stream_id)
        return track

    def drop(self, stream_ids: set[int]) -> None:
        rows = [row for row, stream in enumerate(self.stream_ids) if stream in stream_ids]
        if rows:
            delta = self.ledger.drop_rows(rows)
            self.order.reorder(delta.source_rows)
            self.pending.append(delta)
            self.stream_ids = [stream for stream in self.stream_ids if stream not in stream_ids]

    def reject(self, stream_id: int, count: int) -> None:
        delta = self.ledger.reject(self.stream_ids.index(stream_id), count)
        if delta is not None:
            self.pending.append(delta)

    def compact(self, policy: CompactionPolicy) -> None:
        delta = self.ledger.compact(policy)
        if delta is not None:
            self.order.gathered(self.ledger.rows)  # the stages gather pending reorders on the host to compact
            self.pending.append(delta)

    def next_position(self, stream_id: int) -> int:
        return int(self.ledger.next_positions[self.stream_ids.index(stream_id)])

    def step(self, tokens: list[list[int]], draft: DraftInfo | None = None,
             sampling: SamplingInfo | None = None, logprobs: tuple[int, ...] | None = None,
             scored_ids: np.ndarray | None = None, adjust: LogitsAdjust | None = None) -> Forward:
        """The Forward that feeds row r the tokens[r] (possibly none) and takes every queued delta; `logprobs`,
        `scored_ids`, `adjust`: Forward's."""
        if len(tokens) != self.rows:
            raise ValueError(f"{len(tokens)} token rows for a micro-batch of {self.rows}")
        width = max((len(row) for row in tokens), default=0)
        if width and all(len(row) == width for row in tokens):  # plain decoding, equal prompts: no padding
            input_ids = np.array(tokens, dtype=np.int64).reshape(self.rows, width)  # [B, T]
        else:
            input_ids = np.zeros((self.rows, width), dtype=np.int64)
            for row, row_tokens in enumerate(tokens):
                input_ids[row, : len(row_tokens)] = row_tokens
                if row_tokens:
                    input_ids[row, len(row_tokens):] = row_tokens[-1]
        append = self.ledger.append([len(row) for row in tokens], width)
        self.pending.append(append)
        message = Forward(micro_batch_id=self.micro_batch_id, step_id=self.steps, stream_ids=tuple(self.stream_ids),
                          slot_deltas=tuple(self.pending), beam_idx=self.order.take(self.ledger.rows),
                          position_ids=position_ids(append),
                          input_ids=input_ids, hidden_states=None, draft=draft, admit_from=tuple(self.admit_from),
                          keep_sources=tuple(self.keep_sources) if any(self.keep_sources) else (),
                          copy_into=tuple(self.copy_into),
                          sampling=sampling, logprobs=logprobs, scored_ids=scored_ids, adjust=adjust)
        self.pending.clear()
        self.admit_from.clear()
        self.keep_sources.clear()
        self.copy_into.clear()
        self.steps += 1
        return message
