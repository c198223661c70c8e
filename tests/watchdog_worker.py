"""tests/test_runtime_engines.py's watchdog under torchrun, gloo standing in for NCCL: process 1
answers one message, then stays silent (alive, as a hung peer); process 0 waits for both under a
watchdog of 2 s whose abort hook appends a line to the file ABORTS (argv[1]). The second wait is a
gloo receive with no deadline of its own within the test (the default group's 30 minutes), as an
NCCL wait has none."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from k3export.runtime.faults import process_name
from k3export.runtime.watchdog import Watchdog


def main() -> None:
    aborts = Path(sys.argv[1])
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        dist.send(torch.ones(1), 0)
        time.sleep(120)  # silent: torchrun ends it once process 0 has exited
        return

    def abort() -> None:
        with aborts.open("a") as file:
            file.write("aborted\n")

    watchdog = Watchdog(process_name(0, 1), 2, abort)
    received = torch.zeros(1)
    with watchdog.guard("the first message from stage 1 (rank 1)"):
        dist.recv(received, 1)
    time.sleep(3)  # longer than the timeout, outside any wait: nothing fires
    print(f"first message: {received.item()}", flush=True)
    with watchdog.guard("the boundary from stage 1 (rank 1)"):
        dist.irecv(received, 1).wait()
    print("the silent peer answered", flush=True)


if __name__ == "__main__":
    main()
