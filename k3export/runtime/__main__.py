"""One process per pipeline stage (per rank of a split stage) on torch.distributed, several
micro-batches in flight:

    torchrun --nproc-per-node 2 -m k3export.runtime out/k3-tiny --prompt-len 32 --max-new-tokens 16
    torchrun --nproc-per-node 4 -m k3export.runtime out/grid   # 2 stages x 2 ranks ([parallel] ranks = 2)

A build of S stages, each split over N ranks (N = 1: not split), runs in S*N processes: process p is
rank p % N of stage p // N and holds that rank's session and every micro-batch's rows of its caches
(a rank's graph runs in pieces between the sums over its stage's ranks: runtime.segments). The ranks
of a stage compute the same boundary, so each rank r is a lane of its own: a chain from stage 0's
rank r to the last stage's rank r, which sends the tokens back to stage 0's rank r (every rank of the
last stage has the same logits). A stage's ranks meet only in their sums, which they call in the same
order because every process walks the same schedule. Below, "stage" is a stage's process in one lane.

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

Runners (`--runner`, runtime.engines): ONNX Runtime on CPU, where everything crosses gloo; or the
stages' TensorRT engines, each process on the GPU torchrun's LOCAL_RANK gives it. With engines the
boundary tensors stay CUDA tensors and cross an NCCL process group over every process (the data
plane), a split stage's engines sum through their stage's NCCL communicator (runtime.nccl), and only
the last stage reads anything back to the host, its logits; headers, tokens and stop messages stay on
gloo (the control plane). Both planes are one code path: torch tensors over a process group.

Faults: every wait for another process has a deadline (`--timeout`, 60 s): a stage that sends or
takes nothing for that long, or a rank that does not join its stage's sum for that long (the timeout
of the stage's process group), is named (it died or hangs, or a stage before it did) and this process
exits 1. A process that dies breaks its gloo links and sums (the processes that meet it name it and
exit 1), and torchrun, which checks its processes every 0.1 s, stops the others (SIGTERM: each says
so and exits 1) and lists the dead one in its report by process number (stage p // N, rank p % N).
NCCL has no deadline: an engine's call (its sums, the boundary it reads) runs under the watchdog
(runtime.watchdog), which ends the process after --timeout, and every exit for a fault aborts the
NCCL communicators first. Ctrl-C (SIGINT to every process) stops each at once, exit 130. Loading the
sessions and the closing exchange of timings use the default process group's own timeout.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from k3export.errors import UserError
from k3export.onnx.export import TensorSpec, resolve_shape
from k3export.options import positive_int
from k3export.runtime import (
    ENGINE,
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
    stage_name,
    stage_ranks,
)
from k3export.runtime.engines import RunnerChoice, choose_runner, device_of
from k3export.runtime.nccl import abort, communicator_capsule
from k3export.runtime.schedule import (
    MicroBatch,
    StageTimes,
    Tokens,
    default_micro_batches,
    round_robin,
    split_prompts,
)
from k3export.runtime.watchdog import Watchdog

RUN, STOP, FINISHED = 1, 2, 3  # a header's kind
TOKENS = TensorSpec("tokens", "int64", ["batch"], "the last stage's tokens for a micro-batch's next step")


def process_name(process: int, ranks: int) -> str:
    """A process as messages name it: its stage, and its rank of a split stage (`ranks` > 1)."""
    if ranks == 1:
        return f"stage {process} (rank {process})"
    return f"stage {process // ranks} rank {process % ranks} (process {process})"


def gloo_reason(error: RuntimeError) -> str:
    """gloo's reason for a failed send, receive or sum, without its place and hints: it says
    "[file:line] Connection reset by peer [address]. This is typically ..."."""
    reason = re.search(r"\] ([^.\[]*)", str(error))
    return reason.group(1).strip() if reason else str(error)


class StageFailed(Exception):
    """Another stage stopped answering: this process exits 1."""


@dataclass(frozen=True)
class Plane:
    """Where a message's tensors travel: over a process group (None: the default one, gloo), living on
    a device. Headers, tokens and stop messages take the control plane (gloo, CPU); the boundary
    tensors the data plane: the control plane too with ONNX Runtime's stages, an NCCL group over every
    process and this process's GPU with engines."""

    group: dist.ProcessGroup | None
    device: torch.device


CONTROL = Plane(None, torch.device("cpu"))


def as_tensor(value: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A stage's output as a tensor to send: numpy shared, not copied; a CUDA tensor as it is."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    return torch.from_numpy(np.ascontiguousarray(value))


class Links:
    """This process's messages, every send non-blocking and every wait on the control plane with a
    deadline (an NCCL wait returns once the transfer is ordered before this process's next GPU work,
    which the watchdog guards). A message is a header [kind, micro-batch, rows, seq] and, for RUN,
    tensors whose shapes the header gives, on the plane the caller names."""

    def __init__(self, timeout: int, window: int, ranks: int, data: Plane = CONTROL) -> None:
        self.timeout = timeout
        self.ranks = ranks  # of each stage, to name a peer
        self.window = window  # messages sent ahead before waiting for the oldest to be received
        self.data = data  # the plane of the boundary tensors
        self.header: tuple[dist.Work, torch.Tensor] | None = None  # the next one, posted ahead
        self.sending: deque[tuple[int, list[tuple[dist.Work, torch.Tensor]]]] = deque()  # kept until sent

    def send(self, peer: int, kind: int, batch: MicroBatch, values: list[np.ndarray | torch.Tensor],
             plane: Plane = CONTROL) -> int:
        """Sends a message about `batch`'s current call (before its `advance`), its tensors on `plane`;
        returns its bytes."""
        header = torch.tensor([kind, batch.index, batch.size, batch.seq])
        tensors = [(header, CONTROL), *((as_tensor(v), plane) for v in values)]
        while len(self.sending) >= self.window:
            self.wait_sent()
        self.sending.append((peer, [(self.post(dist.isend, t, peer, p), t) for t, p in tensors]))
        return sum(t.nbytes for t, _ in tensors)

    def wait_sent(self) -> None:
        """Waits until the oldest message sent has been taken."""
        peer, works = self.sending.popleft()
        for work, _ in works:
            self.wait(work, peer)

    def expect(self, peer: int) -> None:
        """Posts the receive of the next header from `peer`, so that it arrives while this one computes."""
        header = torch.empty(4, dtype=torch.int64)
        self.header = (self.post(dist.irecv, header, peer, CONTROL), header)

    def receive(self, peer: int, specs: list[TensorSpec],
                plane: Plane = CONTROL) -> tuple[int, int, dict[str, np.ndarray | torch.Tensor]]:
        """The expected message from `peer`: its kind, micro-batch and (RUN) tensors by name, taken on
        `plane`: numpy arrays on the CPU, CUDA tensors on a GPU."""
        work, header = self.header
        self.wait(work, peer)
        kind, index, rows, seq = header.tolist()
        tensors = {}
        if kind != STOP:
            sizes = {"batch": rows, "seq": seq}
            tensors = {s.name: torch.empty(resolve_shape(s, sizes), dtype=getattr(torch, s.dtype),
                                           device=plane.device) for s in specs}
            for work in [self.post(dist.irecv, t, peer, plane) for t in tensors.values()]:
                self.wait(work, peer)
        return kind, index, {name: t.numpy() if t.device.type == "cpu" else t for name, t in tensors.items()}

    def post(self, op: Callable[..., dist.Work], tensor: torch.Tensor, peer: int, plane: Plane) -> dist.Work:
        """`dist.isend` or `dist.irecv` of `tensor`: a link already broken fails here, as in `wait`."""
        try:
            return op(tensor, peer, group=plane.group)
        except RuntimeError as e:
            raise self.failure(e, peer) from None

    def wait(self, work: dist.Work, peer: int) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self.failure(e, peer) from None

    def failure(self, error: RuntimeError, peer: int) -> StageFailed:
        """What a failed send or receive with `peer` means, in words."""
        name = process_name(peer, self.ranks)
        if "Timed out" in str(error):
            return StageFailed(f"{name} took nothing or sent nothing for {self.timeout} s (--timeout): it "
                               "died or hangs, or a stage before it did")
        return StageFailed(f"the link with {name} broke ({gloo_reason(error)}): it died, or a stage before "
                           "it did")

    def flush(self) -> None:
        """Waits until every message sent has been taken."""
        while self.sending:
            self.wait_sent()


def stage_partners(process: int, ranks: int) -> str:
    """The other ranks of process `process`'s stage, in words."""
    stage, rank = divmod(process, ranks)
    others = [r for r in range(ranks) if r != rank]
    if len(others) == 1:
        return process_name(stage * ranks + others[0], ranks)
    return f"one of stage {stage}'s ranks " + ", ".join(f"{r} (process {stage * ranks + r})" for r in others)


def engine_waits(process: int, ranks: int) -> str:
    """What an engine's call of process `process` may wait for inside NCCL, in words."""
    waits = [f"its sums with {stage_partners(process, ranks)}"] if ranks > 1 else []
    if process >= ranks:
        waits.append(f"the boundary from {process_name(process - ranks, ranks)}")
    return "its engine's call" + (f" ({'; '.join(waits)})" if waits else "")


@dataclass(frozen=True)
class NamedSums:
    """The context of a split stage's calls: a sum of its ranks that fails within (a partner died, or
    did not join it within `timeout`) is raised as a StageFailed naming the partners (gloo does not
    say which one). gloo raises RuntimeError (ONNX Runtime's errors are not one)."""

    process: int
    ranks: int
    timeout: int

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: Any) -> None:
        if self.ranks == 1 or not isinstance(error, RuntimeError):
            return
        partners = stage_partners(self.process, self.ranks)
        if "Timed out" in str(error):
            raise StageFailed(f"{partners} did not join a sum for {self.timeout} s (--timeout): it died or "
                              "hangs, or a stage before it did") from None
        raise StageFailed(f"a sum with {partners} failed ({gloo_reason(error)}): it died, or stopped when "
                          "a process it waits for failed") from None


def call_waits(process: int, ranks: int, timeout: int,
               watchdog: Watchdog | None) -> Callable[[], AbstractContextManager[None]]:
    """The context each stage call of process `process` runs in: ONNX Runtime's gloo sums, a failure
    named (NamedSums); with `watchdog`, an engine's NCCL sums and receives under its deadline."""
    if watchdog is not None:
        return functools.partial(watchdog.guard, engine_waits(process, ranks))
    sums = NamedSums(process, ranks, timeout)
    return lambda: sums


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


def first_stage(part: Part, batches: list[MicroBatch], passed: list[str]) -> None:
    """Stage 0: each micro-batch's prefill, then its decode steps as its tokens come back from the last."""
    links, peers = part.links, part.peers
    links.expect(peers.last)  # the first tokens, posted ahead as every later message
    for batch in round_robin(batches):
        if batch.calls:
            kind, index, received = links.receive(peers.last, [TOKENS])
            assert index == batch.index, "the last stage's tokens come in round-robin order"
            batch.finished = kind == FINISHED
            if not all(b.finished for b in batches):
                links.expect(peers.last)
            if batch.finished:
                links.send(peers.next, STOP, batch, [])
                continue
            batch.input_ids = received["tokens"][:, None]
        outputs, started = part.compute(batch, batch.request())
        sent = links.send(peers.next, RUN, batch, [outputs[n] for n in passed], links.data)
        part.record(batch, started, sent)
        batch.advance()


def later_stage(part: Part, batches: list[MicroBatch], passed: list[str], received: list[TensorSpec],
                tokens: Tokens) -> None:
    """Stages 1..: what comes in, in order, sent on; the last one samples and sends the tokens back to
    the first."""
    links, peers = part.links, part.peers
    running = len(batches)
    links.expect(peers.previous)
    while running:
        kind, index, tensors = links.receive(peers.previous, received, links.data)
        batch = batches[index]
        running -= kind == STOP
        if running:
            links.expect(peers.previous)
        if kind == STOP:
            if peers.next is not None:
                links.send(peers.next, STOP, batch, [])
            continue
        outputs, started = part.compute(batch, {**batch.lengths(), **tensors})
        if peers.next is None:
            ids = tokens.take(batch, outputs["logits"])
            sent = links.send(peers.first, FINISHED if batch.finished else RUN, batch, [ids])
        else:
            sent = links.send(peers.next, RUN, batch, [outputs[n] for n in passed], links.data)
        part.record(batch, started, sent)
        batch.advance()


def run_process(args: argparse.Namespace, exports: list[list[Path]], choice: RunnerChoice, device: int | None,
                watchdog: Watchdog, nccl_groups: list[dist.ProcessGroup]) -> None:
    """This process's stage (rank) of the build: `choice`'s runner, an engine on CUDA `device`; the
    NCCL groups it makes are added to `nccl_groups`, which the watchdog aborts."""
    process, world = dist.get_rank(), dist.get_world_size()
    stages, ranks = len(exports), len(exports[0])
    grid = f"{stages} stages" + (f" x {ranks} ranks" if ranks > 1 else "")
    if len({len(s) for s in exports}) != 1 or world != stages * ranks:
        raise UserError(f"{args.build}: {grid}, started with {world} processes; expected "
                        f"torchrun --nproc-per-node {stages * ranks}")
    index = process // ranks
    lane = [folders[process % ranks] for folders in exports]
    engine = choice.kind == ENGINE
    threads = None if engine else intra_op_threads(args, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    prompts = prompts_of(args, lane)  # on every process, so that all refuse a bad request alike
    count = args.micro_batches or default_micro_batches(len(prompts), stages)
    batches = split_prompts(prompts, count)  # refuses a bad --micro-batches before any session loads
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    tokens = Tokens(len(prompts), args.max_new_tokens, sampler, frozenset(args.stop))
    # The ranks of each stage sum over a group of their own, which every process creates, in the same
    # order (torch.distributed's rule). ONNX Runtime's pieces sum over gloo, whose timeout names a rank
    # that does not join; engines sum over NCCL inside TensorRT, where the watchdog keeps the deadline
    # (the groups keep torch's own, longer, NCCL timeout).
    options = {"backend": "nccl"} if engine else {"timeout": timedelta(seconds=args.timeout)}
    groups = [dist.new_group(list(range(s * ranks, (s + 1) * ranks)), **options) if ranks > 1 else None
              for s in range(stages)]
    data = Plane(dist.new_group(backend="nccl"), torch.device("cuda", device)) if engine and stages > 1 \
        else CONTROL
    nccl_groups.extend(g for g in [*groups, data.group] if engine and g is not None)
    waits = call_waits(process, ranks, args.timeout, watchdog if engine else None)
    place = None
    if engine:  # the stage's communicator: a collective of its ranks, as the engines' set_communicator
        place = choice.place(index, process % ranks, device,
                             communicator_capsule(groups[index]) if ranks > 1 else None)
    if stages == 1:  # one stage: no messages, it samples its own tokens
        pipeline = Pipeline(lane, threads, group=groups[0], engines=[place] if place else None)
        lane_stages = pipeline.stages
    else:  # every process reads every stage's signature (to agree on what crosses); each activates its own
        lane_stages = [Stage(d, f"stage{i}", threads, group=groups[i], engine=place if i == index else None)
                       for i, d in enumerate(lane)]
        lane_stages[index].runner.activate()
    try:
        dist.barrier()  # every session is loaded
        if process == 0:
            work = f"{threads} thread{'s' if threads > 1 else ''} a process" if threads else "engines"
            print(f"k3export.runtime: {grid}, {count} micro-batches of {[b.size for b in batches]} rows, "
                  f"{work}, --timeout {args.timeout:g} s",
                  file=sys.stderr, flush=True)
        if stages == 1:
            result = generate(pipeline, prompts, args.max_new_tokens, sampler, frozenset(args.stop), count,
                              waits)
            mine = {"seconds": result.stage_seconds[0], "times": result.stages[0], "tokens": result.tokens,
                    "prefill": result.prefill_seconds, "decode": result.decode_seconds,
                    "steps": result.decode_steps}
        else:
            stage = lane_stages[index]
            part = Part(stage, Links(args.timeout, count, ranks, data), Peers.of(process, stages, ranks),
                        StageTimes(stage.runner.name), waits)
            mine = pipelined(part, lane_stages, index, batches, tokens)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if process == 0:
            last = gathered[-1]
            result = Generation(last["tokens"], last["prefill"], last["decode"], last["steps"],
                                [g["seconds"] for g in gathered], count, [g["times"] for g in gathered],
                                threads)
            label = "rank {p}" if ranks == 1 else "stage {s} rank {r}"
            report(args, result, [label.format(p=p, s=p // ranks, r=p % ranks)
                                  + f": {stage_name(lane_stages[p // ranks])}" for p in range(world)])
    finally:
        lane_stages[index].runner.deactivate()


def pipelined(part: Part, lane: list[Stage], index: int, batches: list[MicroBatch],
              tokens: Tokens) -> dict[str, Any]:
    """Stage `index` of `lane` (S > 1) walks the schedule; its timings, and the last stage's tokens."""
    part.stage.reset_slots([b.size for b in batches])
    start = time.perf_counter()
    passed = passed_on(lane, index) if index + 1 < len(lane) else []
    if index == 0:
        first_stage(part, batches, passed)
    else:
        previous = {s.name for s in lane[index - 1].signature.outputs}
        received = [s for s in part.stage.signature.feeds if s.name in previous]
        later_stage(part, batches, passed, received, tokens)
    part.links.flush()
    mine = {"seconds": part.stage.seconds, "times": part.clock.summary()}
    if index + 1 == len(lane):
        mine.update(tokens=tokens.rows, prefill=tokens.prefilled_at - start, decode=tokens.decode_seconds(),
                    steps=max(b.calls for b in batches) - 1)
    return mine


def watch_signals(name: str) -> None:
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
        print(f"k3export.runtime: {name}: {why}", file=sys.stderr, flush=True)
        os._exit(130 if interrupted else 1)

    threading.Thread(target=watch, name="signals", daemon=True).start()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node S*N -m k3export.runtime",
                                     description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--timeout", type=positive_int, default=60, metavar="SECONDS",
                        help="the longest wait for another process (a message from it, taking one, or "
                        "joining a sum) before naming it and exiting 1")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    process = int(os.environ.get("RANK", 0))
    try:  # before the process group: every process refuses alike
        exports = stage_ranks(args.build)
        choice = choose_runner(args.build, args.runner)
        device = device_of(os.environ, torch.cuda.device_count()) if choice.kind == ENGINE else None
    except UserError as e:
        print(f"k3export.runtime: error: {e}", file=sys.stderr)
        return 2
    if process == 0:
        print(f"k3export.runtime: {choice.line()}", file=sys.stderr, flush=True)
    name = process_name(process, len(exports[0]))
    watch_signals(name)
    nccl_groups: list[dist.ProcessGroup] = []  # run_process makes them; every exit for a fault aborts them
    watchdog = Watchdog(name, args.timeout, functools.partial(abort, nccl_groups))
    if device is not None:
        torch.cuda.set_device(device)  # before any NCCL group, which takes the current device
    dist.init_process_group("gloo")
    try:
        run_process(args, exports, choice, device, watchdog, nccl_groups)
    except UserError as e:
        print(f"k3export.runtime: error: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    except StageFailed as e:
        watchdog.stop(str(e))  # not destroy_process_group: its teardown can wait on a peer that is gone
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
