"""Micro-batches: a batch's rows in groups that follow each other through the pipeline's stages, so
that with as many groups in flight as there are stages every stage has work (GPipe-style).

The rows split into M groups of consecutive rows whose sizes differ by at most one, the first ones
larger (10 rows in 4: 3, 3, 2, 2): M need not divide the batch, and the groups stay as even as it
allows. Each stage keeps every micro-batch's caches apart (`Stage.reset_slots`), so a micro-batch
is a batch of its own to every graph. Every stage walks the same order, the prefills of micro-batches
0..M-1 and then their decode steps round robin, a finished micro-batch dropping out; the stage that
samples takes each micro-batch's logits in that order, so row r's draws come from the seeded
generator in the same order whatever M (the rows of a step, micro-batch after micro-batch).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3export.errors import UserError
from k3export.onnx.runner import DRAFT_LENGTHS


def split_rows(batch: int, count: int) -> list[range]:
    """The rows 0..batch-1 in `count` groups of consecutive rows, sizes differing by at most one."""
    if not 1 <= count <= batch:
        raise UserError(f"--micro-batches {count}: expected 1 up to the batch's {batch} sequences")
    sizes = [batch // count + (i < batch % count) for i in range(count)]
    starts = np.cumsum([0, *sizes]).tolist()
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def default_micro_batches(batch: int, stages: int) -> int:
    """As many micro-batches as stages (each stage then has one to work on), at most one per row."""
    return min(batch, stages)


@dataclass
class MicroBatch:
    """One micro-batch's rows and the lengths of its next call (every stage keeps its own copy and
    advances it after each call, so only the first stage needs the token ids)."""

    index: int
    rows: range
    input_ids: np.ndarray  # [rows, seq]: the right-padded prompts, then each step's tokens
    cache_lengths: np.ndarray
    input_lengths: np.ndarray
    calls: int = 0  # 0: the next call is the prefill
    finished: bool = False  # every row has its tokens: no more calls
    # Speculative decoding's: each row's drafts, the last of its input_lengths (the rows whose caches the
    # runners keep for a rollback: onnx.runner.Rollback); None: no row drafts.
    draft_lengths: np.ndarray | None = None

    @classmethod
    def of(cls, index: int, rows: range, prompts: list[list[int]]) -> MicroBatch:
        lengths = np.array([len(prompts[r]) for r in rows], np.int64)
        ids = np.zeros((len(rows), int(lengths.max())), np.int64)
        for i, r in enumerate(rows):
            ids[i, :lengths[i]] = prompts[r]
        return cls(index, rows, ids, np.zeros(len(rows), np.int64), lengths)

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def seq(self) -> int:
        """Tokens a row of the next call, padding included: the longest row's (every process knows the
        lengths; only the first stage has the token ids)."""
        return int(self.input_lengths.max())

    def lengths(self) -> dict[str, np.ndarray]:
        lengths = {"cache_lengths": self.cache_lengths, "input_lengths": self.input_lengths}
        return lengths if self.draft_lengths is None else {**lengths, DRAFT_LENGTHS: self.draft_lengths}

    def request(self) -> dict[str, np.ndarray]:
        """The first stage's feeds beyond its caches."""
        return {"input_ids": self.input_ids, **self.lengths()}

    def advance(self) -> None:
        """After a call: the next one decodes one token a row, after the ones written so far."""
        self.cache_lengths = self.cache_lengths + self.input_lengths
        self.input_lengths = np.ones(self.size, np.int64)
        self.calls += 1


def last_positions(logits: np.ndarray, input_lengths: np.ndarray) -> np.ndarray:
    """Each row's logits at its last valid position: [batch, vocab]."""
    if logits.ndim == 2:  # exported with --last-logits
        return logits
    return logits[np.arange(len(input_lengths)), input_lengths - 1]


def split_prompts(prompts: list[list[int]], count: int) -> list[MicroBatch]:
    return [MicroBatch.of(i, rows, prompts) for i, rows in enumerate(split_rows(len(prompts), count))]


def round_robin(batches: list[MicroBatch]) -> Iterator[MicroBatch]:
    """Every stage's order of calls: each unfinished micro-batch in turn, until all have finished (a
    micro-batch marked finished while the round runs is skipped from the next round on)."""
    while running := [b for b in batches if not b.finished]:
        yield from running


@dataclass
class Tokens:
    """Each row's new tokens, on the stage that samples: a micro-batch has finished when each of its
    rows has `max_new_tokens` or a stop token (its rows keep running until then, their draws
    dropped, as in one batch)."""

    batch: int
    max_new_tokens: int
    sampler: Any  # runtime.Sampler: [rows, vocab] logits -> [rows] token ids
    stop_tokens: frozenset[int] = frozenset()
    rows: list[list[int]] = field(init=False)
    done: np.ndarray = field(init=False)
    prefilled_at: float | None = None  # when the last prefill's tokens were taken
    last_at: float | None = None

    def __post_init__(self) -> None:
        self.rows = [[] for _ in range(self.batch)]
        self.done = np.zeros(self.batch, bool)

    def take(self, batch: MicroBatch, logits: np.ndarray) -> np.ndarray:
        """Samples the micro-batch's next tokens from its call's logits (before `advance`), records
        them and marks the micro-batch finished when every row is; returns them [rows]."""
        ids = self.sampler(last_positions(logits, batch.input_lengths))
        for i, r in enumerate(batch.rows):
            if not self.done[r]:
                self.rows[r].append(int(ids[i]))
                self.done[r] = len(self.rows[r]) >= self.max_new_tokens or int(ids[i]) in self.stop_tokens
        batch.finished = bool(self.done[batch.rows].all())
        now = time.perf_counter()
        if batch.calls == 0:
            self.prefilled_at = now
        self.last_at = now
        return ids

    def decode_seconds(self) -> float:
        """From the last prefill's tokens to the last tokens: the decode steps, pipelined."""
        return self.last_at - self.prefilled_at


@dataclass
class StageTimes:
    """One stage's decode calls: `busy` is the time in its graph (session), the window runs from the
    start of its first decode call to the end of its last, and the rest of the window is waiting
    (for inputs, sends, sampling: the pipeline's bubble). `sums`: the part of `busy` a split
    stage's rank spends in the sums with the stage's other ranks (runtime.segments). `sent` counts
    the bytes it passes on in decode calls (to the next stage; the last stage: the tokens back to
    the first)."""

    name: str
    busy: float = 0.0
    sums: float = 0.0
    start: float | None = None
    end: float = 0.0
    rows: int = 0  # decode rows computed (a micro-batch's size per call)
    sent: int = 0

    def record(self, batch: MicroBatch, started: float, seconds: float, sent_bytes: int,
               sums: float = 0.0) -> None:
        """A call of `batch` (before its `advance`) that ran its graph from `started` for `seconds`,
        `sums` of them in sums with the stage's other ranks."""
        if batch.calls == 0:
            return
        if self.start is None:
            self.start = started
        self.end = started + seconds
        self.busy += seconds
        self.sums += sums
        self.rows += batch.size
        self.sent += sent_bytes

    def summary(self) -> dict[str, Any]:
        window = self.end - self.start if self.start is not None else 0.0
        return {"name": self.name, "busy_seconds": self.busy, "sums_seconds": self.sums,
                "window_seconds": window,
                "waiting_seconds": window - self.busy,
                "busy_fraction": self.busy / window if window else None,
                "sent_bytes_per_token": self.sent / self.rows if self.rows else None}


def nbytes(arrays: list[Any]) -> int:
    """Bytes of numpy arrays or torch tensors (an engine's boundaries stay on its GPU)."""
    return sum(int(a.nbytes) for a in arrays)
