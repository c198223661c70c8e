"""How a process of the torchrun run names the process it waited for, and how it ends.

Every wait for another process has a deadline (`--timeout`, 60 s): a stage that sends or
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

import functools
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from k3export.runtime.watchdog import Watchdog


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
