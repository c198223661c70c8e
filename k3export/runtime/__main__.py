"""One process per pipeline stage on torch.distributed:

    torchrun --nproc-per-node 2 -m k3export.runtime out/k3-tiny --prompt-len 32 --max-new-tokens 16

Rank r holds stage r alone (its session and caches). Rank 0 drives generation: for every call it
broadcasts a header (op, batch, seq) and the request inputs that later stages take (the lengths),
runs stage 0 and sends the next stage the outputs it takes, by name, in that stage's input order;
each rank receives (shapes and dtypes from its export.json at this call's batch and seq), runs,
sends on, and the last rank sends its outputs (the logits) back to rank 0. gloo on CPU; with NCCL
(`--dist-backend nccl`) the same tensors would go through the GPUs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.distributed as dist

from k3export.errors import UserError
from k3export.onnx.export import resolve_shape
from k3export.runtime import (
    Generation,
    Sampler,
    Stage,
    add_run_arguments,
    generate,
    prompts_of,
    report,
    stage_exports,
)
from k3export.taps import parse_tap

RUN, RESET_AND_RUN, STOP = 1, 2, 0


def _results(stage: Stage) -> list:
    """What the last stage returns to rank 0: its outputs but the caches and the taps (the logits)."""
    return [s for s in stage.signature.outputs if not s.name.startswith("present.") and not parse_tap(s.name)]


class Ring:
    """This rank's side of the pipeline: which tensors it receives, takes from the request, sends."""

    def __init__(self, stages: list[Stage], rank: int) -> None:
        self.stage, self.rank, self.world = stages[rank], rank, len(stages)
        previous = {s.name for s in stages[rank - 1].signature.outputs} if rank else set()
        self.received = [s for s in self.stage.signature.feeds if s.name in previous]
        # Request inputs of the later stages (the lengths): rank 0 broadcasts them, in name order.
        shared = {}
        for i in range(1, self.world):
            produced = {s.name for s in stages[i - 1].signature.outputs}
            shared.update({s.name: s for s in stages[i].signature.feeds if s.name not in produced})
        self.shared = [shared[n] for n in sorted(shared)]
        following = stages[rank + 1] if rank + 1 < self.world else None
        # The last stage sends back its outputs other than caches and taps (check --build reads those).
        self.sent = (following.signature.feeds if following else _results(self.stage))
        if following:
            outputs = {s.name for s in self.stage.signature.outputs}
            self.sent = [s for s in self.sent if s.name in outputs]
        self.last_outputs = _results(stages[-1])

    @staticmethod
    def _empty(spec, sizes: dict[str, int]) -> torch.Tensor:
        return torch.empty(resolve_shape(spec, sizes), dtype=getattr(torch, spec.dtype))

    def step(self, header: torch.Tensor, request: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """One call on this rank (request given on rank 0 only); rank 0 gets the last stage's outputs."""
        op, batch, seq = header.tolist()
        sizes = {"batch": batch, "seq": seq, "capacity": self.stage.signature.capacity}
        if op == RESET_AND_RUN:
            self.stage.runner.reset(batch)
        shared = {}
        for spec in self.shared:
            t = torch.from_numpy(np.ascontiguousarray(request[spec.name])) if self.rank == 0 else \
                self._empty(spec, sizes)
            dist.broadcast(t, src=0)
            shared[spec.name] = t.numpy()
        feed = dict(request or shared)
        for spec in self.received:
            t = self._empty(spec, sizes)
            dist.recv(t, src=self.rank - 1)
            feed[spec.name] = t.numpy()
        outputs = self.stage(self.stage.feeds(feed, {}))
        destination = self.rank + 1 if self.rank + 1 < self.world else 0
        if self.world > 1:
            for spec in self.sent:
                dist.send(torch.from_numpy(np.ascontiguousarray(outputs[spec.name])), dst=destination)
        if self.rank != 0 or self.world == 1:
            return outputs
        result = {}
        for spec in self.last_outputs:
            t = self._empty(spec, sizes)
            dist.recv(t, src=self.world - 1)
            result[spec.name] = t.numpy()
        return result


def drive(ring: Ring, args: argparse.Namespace, prompts: list[list[int]]) -> Generation:
    fresh = [True]

    def run(request: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        op = RESET_AND_RUN if fresh[0] else RUN
        fresh[0] = False
        header = torch.tensor([op, *request["input_ids"].shape])
        dist.broadcast(header, src=0)
        return ring.step(header, request)

    try:
        return generate(run, prompts, args.max_new_tokens,
                        Sampler(args.temperature, args.top_k, args.top_p, args.seed), frozenset(args.stop))
    finally:
        dist.broadcast(torch.tensor([STOP, 0, 0]), src=0)


def serve(ring: Ring) -> None:
    while True:
        header = torch.empty(3, dtype=torch.int64)
        dist.broadcast(header, src=0)
        if header[0] == STOP:
            return
        ring.step(header, None)


def run_rank(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    exports = stage_exports(args.build)
    if world != len(exports):
        raise UserError(f"{args.build}: {len(exports)} stages, started with {world} processes; expected "
                        f"torchrun --nproc-per-node {len(exports)}")
    prompts = prompts_of(args, exports)  # on every rank, so that all refuse a bad request alike
    # Every rank reads every stage's signature (to agree on what crosses); each activates its own.
    stages = [Stage(d, f"stage{i}") for i, d in enumerate(exports)]
    stages[rank].runner.activate()
    try:
        ring = Ring(stages, rank)
        if rank == 0:
            result = drive(ring, args, prompts)
        else:
            serve(ring)
        seconds = [None] * world
        dist.all_gather_object(seconds, stages[rank].seconds)
        if rank == 0:
            result.stage_seconds = seconds
            report(args, result, [f"rank {i}: {s.runner.name} (layers {s.layers.start}..{s.layers.stop - 1})"
                                  for i, s in enumerate(stages)])
    finally:
        stages[rank].runner.deactivate()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m k3export.runtime",
                                     description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--dist-backend", default="gloo", choices=["gloo", "nccl"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dist.init_process_group(args.dist_backend)
    try:
        run_rank(args)
    except UserError as e:
        print(f"k3export.runtime: error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
