"""The smallest program whose end raced gloo's threads (issue 46; k3export.exits): one rank of
2 sums a tensor over gloo (as k3export.runtime.segments does), drops it, destroys the process group
and ends through end_process, or, with K3EXPORT_GLOO_TEARDOWN=1, through the interpreter's teardown.
With --idle it first puts its gloo threads at SCHED_IDLE (idle_gloo_threads), where a loaded host
keeps them off the CPU until the main thread ends.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P WORLD_SIZE=2 RANK=R python tests/gloo_exit_worker.py [--idle]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from k3export.exits import run_to_end

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # their names in /proc/PID/task/TID/comm


def idle_gloo_threads(pid: int | str = "self") -> int:
    """Puts process `pid`'s gloo threads at SCHED_IDLE (they run only when a core has nothing else);
    returns how many. A process may lower its own threads' policy without privileges."""
    idled = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            if (task / "comm").read_text().strip() in GLOO_THREADS:
                os.sched_setscheduler(int(task.name), os.SCHED_IDLE, os.sched_param(0))
                idled += 1
        except (FileNotFoundError, ProcessLookupError):  # the thread or process ended meanwhile
            pass
    return idled


def main() -> int:
    dist.init_process_group("gloo")
    if "--idle" in sys.argv[1:] and idle_gloo_threads() == 0:
        print("gloo_exit_worker: no gloo thread found to idle", file=sys.stderr)
        return 3
    total = torch.ones(1 << 12)
    dist.all_reduce(total)
    del total
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_to_end(main)
