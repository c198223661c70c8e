"""The sharded runtime: a built recipe's stages run in order, each holding its own caches.

    k3export run DIR --prompt-len 32 --seed 0 --max-new-tokens 16        # in-process, one session a stage
    torchrun --nproc-per-node S -m k3export.runtime DIR --prompt-len 32   # one process a stage (gloo)
    torchrun --nproc-per-node S*N -m k3export.runtime DIR                 # stages split over N ranks

The batch's rows go through in micro-batches (`--micro-batches M`, k3export.runtime.schedule), each
with its own rows of every stage's caches; under torchrun they are in flight together, one stage
computing a micro-batch while the next computes the one before. In one process M changes nothing
but the grouping.

A stage takes named tensors and gives named tensors; what backs it is its own business: ONNX Runtime
through IO binding on CPU (onnx.runner.BoundOnnxrtRunner: the MLA cache written in place; a rank of a
split stage: runtime.segments.SegmentedRunner, the same caches, its graph in pieces between the sums
of the stage's ranks), or the stage's TensorRT engine on a GPU (engine.runner.EngineRunner: its
caches on the GPU, boundaries kept there as CUDA tensors, only the logits read back), chosen by
`--runner` (runtime.engines). Each is driven by the stage's export.json, so no tensor name is written
here: a stage's feeds are the previous stage's outputs of the same name, or the request's own (token
ids, cache and input lengths).
A build with taps (`build RECIPE --taps`) has more outputs per stage; nothing here reads them.
`check --build` runs this same chain as one check runner (k3export.check.runners.chain.ChainRunner).

Here: the `k3export run` command. Its parts: builds.py (a build folder held to its manifest, its
stages' folders), pipeline.py (`Stage`, `Pipeline`), generation.py (`Sampler`, `generate`),
request.py (the arguments `run` and torchrun share, the prompts, the report), schedule.py
(micro-batches), engines.py (the runner a build gets), segments.py (a rank's graph between its
sums). The torchrun process: __main__.py (its entry), process.py, lane.py (its part of the
schedule), links.py (messages and planes), faults.py, watchdog.py and nccl.py (what it waited for
when another fails, and how it ends).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from k3export.artifacts import BUILD_MANIFEST
from k3export.runtime.builds import stage_exports, stage_ranks, verify_build
from k3export.runtime.engines import ENGINE, choose_runner, device_of
from k3export.runtime.generation import Generation, Sampler, generate
from k3export.runtime.pipeline import Pipeline, Stage
from k3export.runtime.request import (
    add_run_arguments,
    intra_op_threads,
    micro_batches_of,
    prompts_of,
    random_prompts,
    report,
    sampler_of,
    stage_name,
)
from k3export.runtime.speculation import require_verify_profiles, speculate, speculation_of

# The names other packages, tests and tools import from k3export.runtime.
__all__ = ["BUILD_MANIFEST", "Generation", "Pipeline", "Sampler", "Stage", "add_parser", "generate",
           "random_prompts", "stage_exports", "stage_ranks", "verify_build"]


def cmd_run(args: argparse.Namespace) -> int:
    exports = stage_exports(args.build)
    choice = choose_runner(args.build, args.runner)
    print(choice.line(), file=sys.stderr, flush=True)
    threads = intra_op_threads(args, 1) if choice.kind != ENGINE else None  # ONNX Runtime's
    prompts = prompts_of(args, exports)
    sampler = sampler_of(args)
    speculation = speculation_of(args, exports, prompts, sampler)
    batches = micro_batches_of(args, prompts, len(exports))
    engines = None
    if choice.kind == ENGINE:  # every stage on this process's GPU
        device = device_of(os.environ, torch.cuda.device_count())
        engines = [choice.place(i, 0, device) for i in range(len(exports))]
        if speculation:
            require_verify_profiles(speculation, [e.path for e in engines], exports, batches[0].size)
    pipeline = Pipeline(exports, threads, engines=engines)
    try:
        if speculation:
            result = speculate(pipeline, speculation, len(batches))
        else:
            result = generate(pipeline, prompts, args.max_new_tokens, sampler, frozenset(args.stop),
                              len(batches))
    finally:
        pipeline.close()
    result.threads = threads
    report(args, result, [stage_name(s) for s in pipeline.stages])
    return 0


def add_parser(sub: Any) -> None:
    """Registers `k3export run` on the CLI's subparsers."""
    run = sub.add_parser("run", help="generate with a sharded build: its stages in order, in this process "
                                     "(torchrun -m k3export.runtime: one process a stage)")
    add_run_arguments(run)
    run.set_defaults(run=cmd_run)
