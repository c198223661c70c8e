"""tests/test_runtime_engines.py's watchdog under torchrun, gloo standing in for NCCL: process 1
answers one message, then stays silent (alive, as a hung peer, blocked in a receive from process 0);
process 0 waits for both under a watchdog of 2 s whose abort hook appends a line to the file ABORTS
(argv[1]) and then never returns (an NCCL abort can hang), waited for 1 s. The second wait is a gloo
receive with no deadline of its own within the test (the group's 30 s), as an NCCL wait has none.
Process 0 prints when its second wait begins and process 1 when process 0 is gone (its receive
fails as the link closes), both on time.monotonic()'s clock, which the processes of a host share."""

from __future__ import annotations

import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from k3export.exits import end_process, run_to_end
from k3export.runtime.faults import process_name
from k3export.runtime.watchdog import Watchdog

TIMEOUT, ABORT_WAIT = 2, 1


def main() -> None:
    aborts = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == 1:
        # It ends itself once process 0 is gone: torchrun's SIGTERM must not end it before it says when.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dist.send(torch.ones(1), 0)
        try:
            dist.recv(torch.zeros(1), 0)  # silent until process 0 is gone
        except RuntimeError:
            print(f"process 0 gone at {time.monotonic()}", flush=True)
        end_process(0, fault=True)  # at once: destroying a group whose peer is gone takes seconds

    def abort() -> None:
        with aborts.open("a") as file:
            file.write("aborted\n")
        threading.Event().wait()  # hangs

    watchdog = Watchdog(process_name(0, 1), TIMEOUT, abort, ABORT_WAIT)
    received = torch.zeros(1)
    with watchdog.guard("the first message from stage 1 (rank 1)"):
        dist.recv(received, 1)
    time.sleep(TIMEOUT + 0.5)  # longer than the timeout, outside any wait: nothing fires
    print(f"first message: {received.item()}", flush=True)
    print(f"second wait from {time.monotonic()}", flush=True)
    with watchdog.guard("the boundary from stage 1 (rank 1)"):
        dist.irecv(received, 1).wait()
    print("the silent peer answered", flush=True)


if __name__ == "__main__":
    run_to_end(main)
