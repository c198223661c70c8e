"""One process per pipeline stage on torch.distributed, several micro-batches in flight:

    torchrun --nproc-per-node 2 -m k3export.runtime out/k3-tiny --prompt-len 32 --max-new-tokens 16

Rank r holds stage r alone: its session and every micro-batch's rows of its caches. Every rank makes
the prompts and their micro-batches itself (the same arguments give the same ones, the lengths of each
call included), so a message carries only a header (kind, micro-batch, rows, seq) and, for RUN, the
tensors the next stage takes from this one, by name in that stage's input order. Every rank walks
schedule.round_robin's order. Rank 0 prefills micro-batches 0..M-1 one after another, sending each on
as soon as it is done (isend: it computes the next while the last one travels), then runs a
micro-batch's next decode step as soon as its tokens are back. The other ranks compute what comes in,
in order, and send it on; the last one samples and sends each micro-batch's tokens back to rank 0
(FINISHED once all its rows are done: rank 0 then sends STOP along the chain instead of another
step). With M at least the number of stages, every stage has a micro-batch to work on while the
others compute theirs. A receiver posts its next header before it computes, so the header arrives
meanwhile; the tensors it posts once the header has given their shapes (gloo moves a send once its
receive is posted, so on the receiving side the transfer itself is not hidden; k3-small sends 12 KB
a row, over the loopback here).

Faults: every wait for another stage has a deadline (`--timeout`, 60 s): a stage that sends or takes
nothing for that long is named (it died or hangs, or a stage before it did) and this process exits 1.
A stage process that dies breaks its gloo links (its neighbours name it and exit 1), and torchrun,
which checks its processes every 0.1 s, stops the others (SIGTERM: each says so and exits 1) and
lists the dead one in its report. Ctrl-C (SIGINT to every process) stops each at once, exit 130.
Loading the sessions and the closing exchange of timings use the process group's own timeout.
gloo on CPU; with NCCL (`--dist-backend nccl`) the same tensors would go through the GPUs.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from k3export.errors import UserError
from k3export.onnx.export import TensorSpec, resolve_shape
from k3export.options import positive_int
from k3export.runtime import (
    Generation,
    Pipeline,
    Sampler,
    Stage,
    add_run_arguments,
    generate,
    intra_op_threads,
    passed_on,
    prompts_of,
    report,
    stage_exports,
    stage_name,
)
from k3export.runtime.schedule import (
    MicroBatch,
    StageTimes,
    Tokens,
    default_micro_batches,
    round_robin,
    split_prompts,
)

RUN, STOP, FINISHED = 1, 2, 3  # a header's kind
TOKENS = TensorSpec("tokens", "int64", ["batch"], "the last stage's tokens for a micro-batch's next step")


class StageFailed(Exception):
    """Another stage stopped answering: this process exits 1."""


class Links:
    """This rank's messages, every send non-blocking and every wait with a deadline. A message is a
    header [kind, micro-batch, rows, seq] and, for RUN, tensors whose shapes the header gives."""

    def __init__(self, timeout: int, window: int) -> None:
        self.timeout = timeout
        self.window = window  # messages sent ahead before waiting for the oldest to be received
        self.header: tuple[dist.Work, torch.Tensor] | None = None  # the next one, posted ahead
        self.sending: deque[tuple[int, list[tuple[dist.Work, torch.Tensor]]]] = deque()  # kept until sent

    def send(self, peer: int, kind: int, batch: MicroBatch, arrays: list[np.ndarray]) -> int:
        """Sends a message about `batch`'s current call (before its `advance`); returns its bytes."""
        tensors = [torch.tensor([kind, batch.index, batch.size, batch.seq]),
                   *(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)]
        while len(self.sending) >= self.window:
            self.wait_sent()
        self.sending.append((peer, [(self.post(dist.isend, t, peer), t) for t in tensors]))
        return sum(t.nbytes for t in tensors)

    def wait_sent(self) -> None:
        """Waits until the oldest message sent has been taken."""
        peer, works = self.sending.popleft()
        for work, _ in works:
            self.wait(work, peer)

    def expect(self, peer: int) -> None:
        """Posts the receive of the next header from `peer`, so that it arrives while this rank computes."""
        header = torch.empty(4, dtype=torch.int64)
        self.header = (self.post(dist.irecv, header, peer), header)

    def receive(self, peer: int, specs: list[TensorSpec]) -> tuple[int, int, dict[str, np.ndarray]]:
        """The expected message from `peer`: its kind, micro-batch and (RUN) tensors by name."""
        work, header = self.header
        self.wait(work, peer)
        kind, index, rows, seq = header.tolist()
        tensors = {}
        if kind != STOP:
            sizes = {"batch": rows, "seq": seq}
            tensors = {s.name: torch.empty(resolve_shape(s, sizes), dtype=getattr(torch, s.dtype))
                       for s in specs}
            for work in [self.post(dist.irecv, t, peer) for t in tensors.values()]:
                self.wait(work, peer)
        return kind, index, {name: t.numpy() for name, t in tensors.items()}

    def post(self, op: Callable[..., dist.Work], tensor: torch.Tensor, peer: int) -> dist.Work:
        """`dist.isend` or `dist.irecv` of `tensor`: a link already broken fails here, as in `wait`."""
        try:
            return op(tensor, peer)
        except RuntimeError as e:
            raise self.failure(e, peer) from None

    def wait(self, work: dist.Work, peer: int) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self.failure(e, peer) from None

    def failure(self, error: RuntimeError, peer: int) -> StageFailed:
        """What a failed send or receive with `peer` means, in words."""
        if "Timed out" in str(error):
            return StageFailed(f"stage {peer} (rank {peer}) took nothing or sent nothing for "
                               f"{self.timeout} s (--timeout): it died or hangs, or a stage before it did")
        # gloo says "[file:line] Connection reset by peer [address]. This is typically ..."
        reason = re.search(r"\] ([^.\[]*)", str(error))
        reason = reason.group(1).strip() if reason else str(error)
        return StageFailed(f"the link with stage {peer} (rank {peer}) broke ({reason}): it died, or a "
                           "stage before it did")

    def flush(self) -> None:
        """Waits until every message sent has been taken."""
        while self.sending:
            self.wait_sent()


def compute(stage: Stage, batch: MicroBatch,
            feed: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    """Runs `batch`'s current call on this stage, its caches; returns the outputs and when it started."""
    stage.use(batch.index)
    started = time.perf_counter()
    return stage(stage.feeds(feed, {})), started


@dataclass(frozen=True)
class Peers:
    """The ranks a stage process exchanges messages with: the stage before it (None: it is the first)
    and after it (None: the last), and the first one, to which the last sends the tokens. One rank a
    stage here; in a grid of ranks each would name its counterpart in the neighbouring stages."""

    previous: int | None
    next: int | None
    first: int

    @classmethod
    def of(cls, rank: int, world: int) -> Peers:
        return cls(rank - 1 if rank else None, rank + 1 if rank + 1 < world else None, 0)


def first_stage(stage: Stage, batches: list[MicroBatch], links: Links, clock: StageTimes, passed: list[str],
                peers: Peers, last: int) -> None:
    """Stage 0: each micro-batch's prefill, then its decode steps as its tokens come back from `last`."""
    links.expect(last)  # the first tokens, posted ahead as every later message
    for batch in round_robin(batches):
        if batch.calls:
            kind, index, received = links.receive(last, [TOKENS])
            assert index == batch.index, "the last stage's tokens come in round-robin order"
            batch.finished = kind == FINISHED
            if not all(b.finished for b in batches):
                links.expect(last)
            if batch.finished:
                links.send(peers.next, STOP, batch, [])
                continue
            batch.input_ids = received["tokens"][:, None]
        outputs, started = compute(stage, batch, batch.request())
        sent = links.send(peers.next, RUN, batch, [outputs[n] for n in passed])
        clock.record(batch, started, stage.runner.inference_time, sent)
        batch.advance()


def later_stage(stage: Stage, batches: list[MicroBatch], links: Links, clock: StageTimes, passed: list[str],
                peers: Peers, received: list[TensorSpec], tokens: Tokens) -> None:
    """Stages 1..: what comes in, in order, sent on; the last one samples and sends the tokens back to
    the first."""
    running = len(batches)
    links.expect(peers.previous)
    while running:
        kind, index, tensors = links.receive(peers.previous, received)
        batch = batches[index]
        running -= kind == STOP
        if running:
            links.expect(peers.previous)
        if kind == STOP:
            if peers.next is not None:
                links.send(peers.next, STOP, batch, [])
            continue
        outputs, started = compute(stage, batch, {**batch.lengths(), **tensors})
        if peers.next is None:
            ids = tokens.take(batch, outputs["logits"])
            sent = links.send(peers.first, FINISHED if batch.finished else RUN, batch, [ids])
        else:
            sent = links.send(peers.next, RUN, batch, [outputs[n] for n in passed])
        clock.record(batch, started, stage.runner.inference_time, sent)
        batch.advance()


def run_rank(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    exports = stage_exports(args.build)
    if world != len(exports):
        raise UserError(f"{args.build}: {len(exports)} stages, started with {world} processes; expected "
                        f"torchrun --nproc-per-node {len(exports)}")
    threads = intra_op_threads(args, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    prompts = prompts_of(args, exports)  # on every rank, so that all refuse a bad request alike
    count = args.micro_batches or default_micro_batches(len(prompts), world)
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    batches = split_prompts(prompts, count)  # refuses a bad --micro-batches before any session loads
    if world == 1:  # one stage: no messages
        pipeline = Pipeline(exports, threads)
        try:
            result = generate(pipeline, prompts, args.max_new_tokens, sampler, frozenset(args.stop), count)
        finally:
            pipeline.close()
        result.threads = threads
        report(args, result, [f"rank 0: {stage_name(pipeline.stages[0])}"])
        return
    # Every rank reads every stage's signature (to agree on what crosses); each activates its own.
    stages = [Stage(d, f"stage{i}", threads) for i, d in enumerate(exports)]
    stage = stages[rank]
    stage.runner.activate()
    try:
        stage.reset_slots([b.size for b in batches])
        clock = StageTimes(stage.runner.name)
        passed = passed_on(stages, rank) if rank + 1 < world else []
        previous = {s.name for s in stages[rank - 1].signature.outputs} if rank else set()
        received = [s for s in stage.signature.feeds if s.name in previous]
        tokens = Tokens(len(prompts), args.max_new_tokens, sampler, frozenset(args.stop))
        links = Links(args.timeout, window=count)
        dist.barrier()  # every session is loaded
        if rank == 0:
            print(f"k3export.runtime: {world} stages, {count} micro-batches of {[b.size for b in batches]} "
                  f"rows, {threads} thread{'s' if threads > 1 else ''} a stage, --timeout {args.timeout:g} s",
                  file=sys.stderr, flush=True)
        start = time.perf_counter()
        peers = Peers.of(rank, world)
        if rank == 0:
            first_stage(stage, batches, links, clock, passed, peers, last=world - 1)
        else:
            later_stage(stage, batches, links, clock, passed, peers, received, tokens)
        links.flush()
        mine = {"seconds": stage.seconds, "times": clock.summary()}
        if rank == world - 1:
            mine.update(tokens=tokens.rows, prefill=tokens.prefilled_at - start,
                        decode=tokens.decode_seconds(), steps=max(b.calls for b in batches) - 1)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            last = gathered[-1]
            result = Generation(last["tokens"], last["prefill"], last["decode"], last["steps"],
                                [g["seconds"] for g in gathered], count, [g["times"] for g in gathered],
                                threads)
            report(args, result, [f"rank {i}: {stage_name(s)}" for i, s in enumerate(stages)])
    finally:
        stage.runner.deactivate()


def watch_signals(rank: str) -> None:
    """SIGINT (Ctrl-C) and SIGTERM (torchrun stopping the others when one fails) end this process at
    once with a message, even while its main thread is blocked in gloo or ONNX Runtime, where a
    Python handler would wait for the call to return: Python's C-level handler, in whichever thread
    the signal lands, writes its number to a pipe that a thread of ours reads."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)  # the thread below acts

    def watch() -> None:
        interrupted = os.read(read, 1)[0] == signal.SIGINT
        why = ("interrupted (Ctrl-C)" if interrupted else
               "stopped by SIGTERM: torchrun stops every stage when one fails (its report names which)")
        print(f"k3export.runtime: stage {rank} (rank {rank}): {why}", file=sys.stderr, flush=True)
        os._exit(130 if interrupted else 1)

    threading.Thread(target=watch, name="signals", daemon=True).start()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m k3export.runtime",
                                     description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--timeout", type=positive_int, default=60, metavar="SECONDS",
                        help="the longest wait for another stage (a message from it, or taking one) "
                        "before naming it and exiting 1")
    parser.add_argument("--dist-backend", default="gloo", choices=["gloo", "nccl"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    watch_signals(os.environ.get("RANK", "?"))
    dist.init_process_group(args.dist_backend)
    rank = dist.get_rank()
    try:
        run_rank(args)
    except UserError as e:
        print(f"k3export.runtime: error: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    except StageFailed as e:
        # One write with its newline, so that stages failing together do not share a line.
        sys.stderr.write(f"k3export.runtime: stage {rank} (rank {rank}): {e}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # Not destroy_process_group: its teardown can wait on a peer that is gone.
        os._exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
