"""A process's part of the schedule, in its lane (its rank of every stage). Here "stage" is a
stage's process in one lane.

Every process makes the prompts and their micro-batches itself (the same arguments give the same
ones, the lengths of each call included), so a message carries only a header (kind, micro-batch,
rows, seq) and, for RUN, the tensors the next stage takes from this one, by name in that stage's
input order. Every process walks schedule.round_robin's order. Stage 0 prefills micro-batches
0..M-1 one after another, sending each on as soon as it is done (isend: it computes the next while
the last one travels), then runs a micro-batch's next decode step as soon as its tokens are back.
The other stages compute what comes in, in order, and send it on; the last one samples and sends
each micro-batch's tokens back to stage 0 (FINISHED once all its rows are done: stage 0 then sends
STOP along the chain instead of another step). With M at least the number of stages, every stage has
a micro-batch to work on while the others compute theirs. A receiver posts its next header before
it computes, so the header arrives meanwhile; the tensors it posts once the header has given their
shapes (gloo moves a send once its receive is posted, so on the receiving side the transfer itself
is not hidden; k3-small sends 12 KB a row, over the loopback here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3export.onnx.export import TensorSpec
from k3export.onnx.runner import DRAFT_LENGTHS
from k3export.runtime.links import FINISHED, RUN, STOP, TOKENS, Links
from k3export.runtime.pipeline import Stage, passed_on
from k3export.runtime.schedule import MicroBatch, StageTimes, Tokens, round_robin
from k3export.runtime.speculation import Speculation

# A speculative run's calls have the lengths the last stage decides (runtime.speculation): they go with
# every message on the control plane, and the last stage sends the first the next call's token ids.
LENGTHS = [TensorSpec("cache_lengths", "int64", ["batch"], "each row's tokens in its caches"),
           TensorSpec("input_lengths", "int64", ["batch"], "each row's tokens in this call"),
           TensorSpec(DRAFT_LENGTHS, "int64", ["batch"], "each row's drafts in this call (its rollback's)")]
REQUEST = [TensorSpec("input_ids", "int64", ["batch", "seq"], "the next call's tokens"), *LENGTHS]


@dataclass(frozen=True)
class Peers:
    """The processes a stage's process exchanges messages with, all in its lane (its rank of every
    stage): the stage before it (None: it is the first) and after it (None: the last), the first,
    to which the last sends the tokens, and the last, from which the first takes them."""

    previous: int | None
    next: int | None
    first: int
    last: int

    @classmethod
    def of(cls, process: int, stages: int, ranks: int) -> Peers:
        stage, rank = divmod(process, ranks)
        return cls(process - ranks if stage else None, process + ranks if stage + 1 < stages else None,
                   rank, (stages - 1) * ranks + rank)


@dataclass
class Part:
    """This process's part of the schedule: its stage, where its messages go, its clock, and the
    context its calls run in (`call_waits`)."""

    stage: Stage
    links: Links
    peers: Peers
    clock: StageTimes
    waits: Callable[[], AbstractContextManager[None]]

    def compute(self, batch: MicroBatch, feed: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """Runs `batch`'s current call on this stage, its caches; returns the outputs and when it started."""
        self.stage.use(batch.index)
        started = time.perf_counter()
        with self.waits():
            return self.stage(self.stage.feeds(feed, {})), started

    def record(self, batch: MicroBatch, started: float, sent: int) -> None:
        runner = self.stage.runner
        self.clock.record(batch, started, runner.inference_time, sent, runner.collective_time)


def lengths_of(batch: MicroBatch, speculative: bool) -> list:
    """What a message carries on the control plane: a speculative call's lengths (nothing otherwise:
    every process advances them alike)."""
    if not speculative:
        return []
    none = batch.draft_lengths is None  # a prefill's
    drafts = np.zeros(batch.size, np.int64) if none else batch.draft_lengths
    return [batch.cache_lengths, batch.input_lengths, drafts]


def next_call(batch: MicroBatch, speculative: bool) -> None:
    """After a call: a speculative one's next lengths come in a message; a plain one's advance."""
    if speculative:
        batch.calls += 1
    else:
        batch.advance()


def first_stage(part: Part, batches: list[MicroBatch], passed: list[str], speculative: bool) -> None:
    """Stage 0: each micro-batch's prefill, then its decode steps as its tokens come back from the last
    (speculative: the next call's tokens and lengths)."""
    links, peers = part.links, part.peers
    links.expect(peers.last)  # the first tokens, posted ahead as every later message
    for batch in round_robin(batches):
        if batch.calls:
            kind, index, received = links.receive(peers.last, [] if speculative else [TOKENS],
                                                  control=REQUEST if speculative else [])
            assert index == batch.index, "the last stage's tokens come in round-robin order"
            batch.finished = kind == FINISHED
            if not all(b.finished for b in batches):
                links.expect(peers.last)
            if batch.finished:
                links.send(peers.next, STOP, batch, [])
                continue
            if speculative:
                request = [received[s.name] for s in REQUEST]
                batch.input_ids, batch.cache_lengths, batch.input_lengths, batch.draft_lengths = request
            else:
                batch.input_ids = received["tokens"][:, None]
        outputs, started = part.compute(batch, batch.request())
        sent = links.send(peers.next, RUN, batch, [outputs[n] for n in passed], links.data,
                          lengths_of(batch, speculative))
        part.record(batch, started, sent)
        next_call(batch, speculative)


def later_stage(part: Part, batches: list[MicroBatch], passed: list[str], received: list[TensorSpec],
                tokens: Tokens | Speculation) -> None:
    """Stages 1..: what comes in, in order, sent on; the last one samples and sends the tokens back to
    the first (speculative: takes the drafts its logits accept and sends the next call's request)."""
    links, peers = part.links, part.peers
    speculative = isinstance(tokens, Speculation)
    running = len(batches)
    links.expect(peers.previous)
    while running:
        kind, index, tensors = links.receive(peers.previous, received, links.data,
                                             LENGTHS if speculative else [])
        batch = batches[index]
        running -= kind == STOP
        if running:
            links.expect(peers.previous)
        if kind == STOP:
            if peers.next is not None:
                links.send(peers.next, STOP, batch, [])
            continue
        if speculative:
            batch.cache_lengths, batch.input_lengths, batch.draft_lengths = \
                (tensors.pop(s.name) for s in LENGTHS)
        outputs, started = part.compute(batch, {**batch.lengths(), **tensors})
        if peers.next is None and speculative:
            tokens.take(batch, outputs["logits"])
            if not batch.finished:
                tokens.request(batch)
            sent = links.send(peers.first, FINISHED if batch.finished else RUN, batch, [],
                              control=[batch.input_ids, *lengths_of(batch, True)])
        elif peers.next is None:
            ids = tokens.take(batch, outputs["logits"])
            sent = links.send(peers.first, FINISHED if batch.finished else RUN, batch, [ids])
        else:
            sent = links.send(peers.next, RUN, batch, [outputs[n] for n in passed], links.data,
                              lengths_of(batch, speculative))
        part.record(batch, started, sent)
        next_call(batch, speculative)


def pipelined(part: Part, lane: list[Stage], index: int, batches: list[MicroBatch],
              tokens: Tokens | Speculation) -> dict[str, Any]:
    """Stage `index` of `lane` (S > 1) walks the schedule; its timings, and the last stage's tokens
    (and drafts)."""
    part.stage.reset_slots([b.size for b in batches])
    start = time.perf_counter()
    passed = passed_on(lane, index) if index + 1 < len(lane) else []
    if index == 0:
        first_stage(part, batches, passed, isinstance(tokens, Speculation))
    else:
        previous = {s.name for s in lane[index - 1].signature.outputs}
        received = [s for s in part.stage.signature.feeds if s.name in previous]
        later_stage(part, batches, passed, received, tokens)
    part.links.flush()
    mine = {"seconds": part.stage.seconds, "times": part.clock.summary()}
    if index + 1 == len(lane):
        mine.update(tokens=tokens.rows, prefill=tokens.prefilled_at - start, decode=tokens.decode_seconds(),
                    steps=max(b.calls for b in batches) - 1,
                    drafts=tokens.counts if isinstance(tokens, Speculation) else None)
    return mine
