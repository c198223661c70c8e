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
order because every process walks the same schedule.

The process (runtime.process) walks the schedule in its lane (runtime.lane), its messages over
runtime.links; runtime.faults names what it waited for when another process fails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from k3export.errors import UserError
from k3export.exits import run_to_end
from k3export.options import positive_int
from k3export.runtime.builds import stage_ranks
from k3export.runtime.engines import ENGINE, choose_runner, device_of
from k3export.runtime.faults import FaultBoard, StageFailed, process_name, watch_signals
from k3export.runtime.nccl import abort
from k3export.runtime.process import run_process
from k3export.runtime.request import add_run_arguments
from k3export.runtime.watchdog import Watchdog


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node S*N -m k3export.runtime",
                                     description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--timeout", type=positive_int, default=60, metavar="SECONDS",
                        help="the longest wait for another process (a message from it, taking one, or "
                        "joining a sum) before naming it and exiting 1")
    return parser


def refuse(error: UserError) -> int:
    """Says the refusal on stderr and, under torchrun, in the process's error file, whose message
    torchrun's report then shows as the failure's "traceback" (that 30-line report follows the line
    here and would bury it; torch.distributed.elastic.multiprocessing.errors.ProcessFailure reads
    {"message": str, "timestamp": int}). Returns the exit status of bad input."""
    line = f"k3export.runtime: error: {error}"
    print(line, file=sys.stderr, flush=True)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError):  # the report then says what it says without it
            Path(path).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    process = int(os.environ.get("RANK", 0))
    try:  # before the process group: every process refuses alike
        exports = stage_ranks(args.build)
        choice = choose_runner(args.build, args.runner)
        device = device_of(os.environ, torch.cuda.device_count()) if choice.kind == ENGINE else None
    except UserError as e:
        return refuse(e)
    if process == 0:
        print(f"k3export.runtime: {choice.line()}", file=sys.stderr, flush=True)
    ranks = len(exports[0])
    nccl_groups: list[dist.ProcessGroup] = []  # run_process makes them; every exit for a fault aborts them
    watchdog = Watchdog(process_name(process, ranks), args.timeout, functools.partial(abort, nccl_groups))
    watch_signals(watchdog)
    if device is not None:
        torch.cuda.set_device(device)  # before any NCCL group, which takes the current device
    dist.init_process_group("gloo")
    board = FaultBoard.of_run(process, dist.get_world_size(), ranks)
    watchdog.cause = board.cause
    dist.barrier()  # every process's board is written before any reads it
    try:
        run_process(args, exports, choice, device, watchdog, nccl_groups)
    except UserError as e:
        board.say(f"{board.FAILED}error: {e}")
        return refuse(e)
    except StageFailed as e:
        watchdog.stop(str(e))  # exits 1 at once (end_process for a fault)
    except Exception as e:  # its traceback follows (run_to_end, exit 1); the others name it
        board.say(f"{board.FAILED}{type(e).__name__}: {e}")
        raise
    else:
        board.say(board.FINISHED)
    finally:
        board.close()  # the heartbeat joined before the process ends
    return 0


if __name__ == "__main__":
    run_to_end(main)  # destroys the process group and ends without the interpreter's teardown
