"""One process of the torchrun run: its stage (its rank of a split stage), the process groups every
process makes alike, its planes, the schedule it walks (runtime.lane; one stage: generate), and the
closing exchange of timings that process 0 reports."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from k3export.errors import UserError
from k3export.runtime.engines import ENGINE, RunnerChoice
from k3export.runtime.faults import call_waits
from k3export.runtime.generation import Generation, generate
from k3export.runtime.lane import Part, Peers, pipelined
from k3export.runtime.links import CONTROL, Links, Plane
from k3export.runtime.nccl import communicator_capsule
from k3export.runtime.pipeline import Pipeline, Stage
from k3export.runtime.request import (
    intra_op_threads,
    micro_batches_of,
    prompts_of,
    report,
    sampler_of,
    stage_name,
)
from k3export.runtime.schedule import StageTimes, Tokens
from k3export.runtime.speculation import require_verify_profiles, speculate, speculation_of
from k3export.runtime.watchdog import Watchdog


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
    batches = micro_batches_of(args, prompts, stages)
    count = len(batches)
    sampler = sampler_of(args)
    speculation = speculation_of(args, lane, prompts, sampler)
    tokens = speculation or Tokens(len(prompts), args.max_new_tokens, sampler, frozenset(args.stop))
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
    if engine and speculation:
        lane_engines = [choice.engines[s][process % ranks] for s in range(stages)]
        require_verify_profiles(speculation, lane_engines, lane, batches[0].size)
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
            result = speculate(pipeline, speculation, count, waits) if speculation else \
                generate(pipeline, prompts, args.max_new_tokens, sampler, frozenset(args.stop), count, waits)
            mine = {"seconds": result.stage_seconds[0], "times": result.stages[0], "tokens": result.tokens,
                    "prefill": result.prefill_seconds, "decode": result.decode_seconds,
                    "steps": result.decode_steps, "drafts": result.drafts}
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
                                threads, last["drafts"])
            label = "rank {p}" if ranks == 1 else "stage {s} rank {r}"
            report(args, result, [label.format(p=p, s=p // ranks, r=p % ranks)
                                  + f": {stage_name(lane_stages[p // ranks])}" for p in range(world)])
    finally:
        lane_stages[index].runner.deactivate()
