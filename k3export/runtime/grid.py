"""A tensor/expert-parallel build (`[parallel] ranks = N` in its recipe) on torch.distributed: S stages
x N ranks, one process each.

    torchrun --nproc-per-node S*N -m k3export.runtime.grid DIR --prompt-len 32 --max-new-tokens 16

Process p runs rank p % N of stage p // N: its graph as ONNX Runtime pieces with the stage's sums
between them (k3export.runtime.segments, over a process group of the stage's N processes), holding its
caches (its KDA heads, the whole MLA latent cache). Process 0 drives generation: for every call it
broadcasts a header (op, batch, seq) and the request (token ids, cache and input lengths) to every
process. Rank r of stage s receives the AttnRes boundary from rank r of stage s - 1 and sends its own
to rank r of stage s + 1 (the ranks of a stage compute the same boundary, so the N pairs run side by
side); rank 0 of the last stage sends the logits to process 0. gloo on CPU (`--dist-backend nccl`
where GPUs are). A process that dies leaves the others waiting at most --timeout seconds, after which
torch.distributed raises in each of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from k3export.errors import UserError
from k3export.onnx.export import MANIFEST_FILE, resolve_shape
from k3export.onnx.runner import PAST, PRESENT, Signature
from k3export.onnx.taps import parse_tap
from k3export.options import positive_real
from k3export.runtime import Generation, Sampler, add_run_arguments, prompts_of, report, stage_ranks
from k3export.runtime.schedule import Tokens, round_robin, split_prompts
from k3export.runtime.segments import SegmentedGraph

RUN, RESET_AND_RUN, STOP = 1, 2, 0
REQUEST = ("input_ids", "cache_lengths", "input_lengths")


def _boundary(names: list[str]) -> list[str]:
    """The AttnRes tensors crossing a stage boundary, in the order both sides use (by name)."""
    return sorted(n for n in names if n not in REQUEST and n != "logits" and not n.startswith((PAST, PRESENT))
                  and not parse_tap(n))


class GridRank:
    """This process's rank of its stage, and where its boundary tensors come from and go."""

    def __init__(self, exports: list[list[Path]], process: int, threads: int | None) -> None:
        self.ranks, self.stages = len(exports[0]), len(exports)
        self.process, self.stage, self.rank = process, process // self.ranks, process % self.ranks
        # Every process creates every stage's group, in the same order (torch.distributed's rule).
        groups = [dist.new_group(list(range(s * self.ranks, (s + 1) * self.ranks)))
                  for s in range(self.stages)]
        folder = exports[self.stage][self.rank]
        self.signature = Signature(_manifest(folder))
        self.graph = SegmentedGraph(folder / "model.onnx", groups[self.stage], threads)
        crossing = set(_boundary([s.name for s in self.signature.feeds]))
        self.received = sorted((s for s in self.signature.feeds if s.name in crossing), key=lambda s: s.name)
        self.sent = _boundary([s.name for s in self.signature.outputs])
        last = Signature(_manifest(exports[-1][0]))
        self.logits = next(s for s in last.outputs if s.name == "logits")
        self.caches: dict[str, np.ndarray] = {}

    def step(self, header: torch.Tensor, request: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """One call on this process (the request given on process 0 only); process 0 gets the logits."""
        op, batch, seq = header.tolist()
        sizes = {"batch": batch, "seq": seq, "capacity": self.signature.capacity}
        if op == RESET_AND_RUN:
            self.caches = self.signature.empty_caches(batch)
        feed = dict(self.caches)
        for name, shape in zip(REQUEST, ([batch, seq], [batch], [batch]), strict=True):
            t = _tensor(request[name]) if self.process == 0 else torch.empty(shape, dtype=torch.int64)
            dist.broadcast(t, src=0)
            feed[name] = t.numpy()
        if self.stage > 0:
            del feed["input_ids"]
            for spec in self.received:
                t = torch.empty(resolve_shape(spec, sizes), dtype=getattr(torch, spec.dtype))
                dist.recv(t, src=self.process - self.ranks)
                feed[spec.name] = t.numpy()
        outputs = self.graph(feed)
        self.caches = {PAST + n.removeprefix(PRESENT): v for n, v in outputs.items() if n.startswith(PRESENT)}
        if self.stage + 1 < self.stages:
            for name in self.sent:
                dist.send(_tensor(outputs[name]), dst=self.process + self.ranks)
        elif self.rank == 0 and self.process != 0:
            dist.send(_tensor(outputs["logits"]), dst=0)
        if self.process != 0 or self.stages == 1:
            return outputs
        t = torch.empty(resolve_shape(self.logits, sizes), dtype=getattr(torch, self.logits.dtype))
        dist.recv(t, src=(self.stages - 1) * self.ranks)
        return {"logits": t.numpy()}


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST_FILE).read_text())


def generate_on(run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], prompts: list[list[int]],
                max_new_tokens: int, sampler: Sampler,
                stop_tokens: frozenset[int] = frozenset()) -> Generation:
    """Prefill, then decode steps, the whole batch as one micro-batch through `run` (the grid's
    stages in turn; micro-batches in flight are the stage pipeline's, not yet the grid's)."""
    batches = split_prompts(prompts, 1)
    tokens = Tokens(len(prompts), max_new_tokens, sampler, stop_tokens)
    start = time.perf_counter()
    for batch in round_robin(batches):
        ids = tokens.take(batch, run(batch.request())["logits"])
        batch.advance()
        batch.input_ids = ids[:, None].astype(np.int64)
    return Generation(tokens.rows, tokens.prefilled_at - start, tokens.decode_seconds(),
                      batches[0].calls - 1, [])


def run_grid(args: argparse.Namespace) -> None:
    exports = stage_ranks(args.build)
    processes, world = sum(len(s) for s in exports), dist.get_world_size()
    if len({len(s) for s in exports}) != 1 or world != processes:
        raise UserError(f"{args.build}: {len(exports)} stages x {len(exports[0])} ranks, started with "
                        f"{world} processes; expected torchrun --nproc-per-node {processes}")
    grid = GridRank(exports, dist.get_rank(), args.threads)
    if grid.process == 0:
        fresh = [True]

        def run(request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            header = torch.tensor([RESET_AND_RUN if fresh[0] else RUN, *request["input_ids"].shape])
            fresh[0] = False
            dist.broadcast(header, src=0)
            return grid.step(header, request)

        try:
            sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
            result = generate_on(run, prompts_of(args, [f for stage in exports for f in stage]),
                                 args.max_new_tokens, sampler, frozenset(args.stop))
        finally:
            dist.broadcast(torch.tensor([STOP, 0, 0]), src=0)
    else:
        while True:
            header = torch.empty(3, dtype=torch.int64)
            dist.broadcast(header, src=0)
            if header[0] == STOP:
                break
            grid.step(header, None)
    seconds = [None] * world
    mine = {"pieces": grid.graph.compute_seconds, "sums": grid.graph.collective_seconds}
    dist.all_gather_object(seconds, mine)
    if grid.process == 0:
        result.stage_seconds = [s["pieces"] + s["sums"] for s in seconds]
        names = [f"stage {p // grid.ranks} rank {p % grid.ranks}: ONNX Runtime {s['pieces']:.3f} s, sums "
                 f"{s['sums']:.3f} s, in all" for p, s in enumerate(seconds)]
        report(args, result, names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node S*N -m k3export.runtime.grid",
                                     description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--dist-backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--timeout", type=positive_real, default=300.0,
                        help="seconds a process waits for another before giving up (a dead rank)")
    args = parser.parse_args(argv)
    dist.init_process_group(args.dist_backend, timeout=timedelta(seconds=args.timeout))
    try:
        run_grid(args)
    except UserError as e:
        print(f"k3export.runtime.grid: error (process {dist.get_rank()}): {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
