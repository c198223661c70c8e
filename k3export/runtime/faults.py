"""How a process of the torchrun run names the process it waited for, the process that failed, and
how it ends.

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

Which of those reaches a surviving process first is a race (on a loaded host torchrun's SIGTERM often
wins), and what it meets first names only its neighbour. So every exit for a fault says two lines, in
this order: what this process met (a broken link, a missed deadline, SIGTERM), then the process the
run stopped for, read off the FaultBoard: one that failed on its own, or one that went silent (no
word and no heartbeat for SILENCE_SECONDS: it was killed, crashed or hangs).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from k3export.exits import INTERRUPTED, end_process
from k3export.runtime.watchdog import Watchdog

BEAT_SECONDS = 0.2
# Longer than a live process's heartbeat thread waits for a core on a loaded host (ten beats).
SILENCE_SECONDS = 2.0


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


def watch_signals(watchdog: Watchdog) -> None:
    """SIGINT (Ctrl-C) and SIGTERM (torchrun stopping the others when one fails) end this process at
    once with a message, even while its main thread is blocked in gloo or ONNX Runtime, where a
    Python handler would wait for the call to return: Python's C-level handler, in whichever thread
    the signal lands, writes its number to a pipe that a thread of ours reads. SIGTERM takes the
    watchdog's exit for a fault (its two lines, the NCCL abort)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: None)  # the thread below acts

    def watch() -> None:
        if os.read(read, 1)[0] == signal.SIGINT:
            watchdog.say("interrupted (Ctrl-C)")
            end_process(INTERRUPTED, fault=True)
        watchdog.stop("stopped by SIGTERM: torchrun stops every process when one fails")

    threading.Thread(target=watch, name="signals", daemon=True).start()


class FaultBoard:
    """What each process of the run said when it stopped, and its heartbeat, kept in the run's store,
    which torchrun's agent holds (TORCHELASTIC_USE_AGENT_STORE), so it outlives every worker. A
    process that stops says why first ("failed: ..." on an error of its own, "stopped: ..." when it
    met another's fault, "finished"); so a process that never said anything and whose heartbeat
    stopped was killed, crashed or hangs. `cause` names the process the run stopped for from there,
    the same whichever fault reached the caller first."""

    FAILED, STOPPED, FINISHED = "failed: ", "stopped: ", "finished"

    def __init__(self, store: dist.Store, process: int, world: int, ranks: int) -> None:
        self.store, self.process, self.ranks = store, process, ranks
        self.others = [p for p in range(world) if p != process]
        # Both keys exist before the barrier that follows (runtime.__main__), so that `cause` reads every
        # process's at once.
        self.store.set(f"said/{process}", "")
        self.store.add(f"beat/{process}", 1)
        self.stopped = threading.Event()
        self.beating = threading.Thread(target=self.beat, name="heartbeat", daemon=True)
        self.beating.start()

    @classmethod
    def of_run(cls, process: int, world: int, ranks: int) -> FaultBoard:
        """The board in the store of this torchrun run (MASTER_ADDR, MASTER_PORT), on a connection of its
        own: the process group's waits on its connection must not hold up the heartbeat."""
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=5))
        return cls(dist.PrefixStore("k3export.faults", store), process, world, ranks)

    def beat(self) -> None:
        while not self.stopped.wait(BEAT_SECONDS):
            try:
                self.store.add(f"beat/{self.process}", 1)
            except RuntimeError:  # the store is gone (torchrun ended): nobody reads the beats
                return

    def close(self) -> None:
        """Stops the heartbeat before the interpreter's teardown, which must not find the thread inside
        the store's C++ client (a process whose run ended aborted there: "terminate called without an
        active exception"). Every exit is end_process (k3export.exits): os._exit, without the teardown."""
        self.stopped.set()
        self.beating.join()

    def say(self, what: str) -> None:
        """Records why this process stops: FAILED, STOPPED or FINISHED (with the reason)."""
        self.store.set(f"said/{self.process}", what)

    def read(self) -> tuple[list[bytes], list[bytes]]:
        """What every other process said, and its heartbeat count, in one reading."""
        values = self.store.multi_get([f"{key}/{p}" for key in ("said", "beat") for p in self.others])
        return values[:len(self.others)], values[len(self.others):]

    def cause(self, seen: str) -> str:
        """Records that this process stopped for `seen` (another's fault), then names the processes the
        run stopped for: those that failed on their own, at once; else those silent (no word, no beat)
        for SILENCE_SECONDS, waited for. Its line starts "the run stopped because"."""
        failed = self.FAILED.encode()
        try:
            self.say(self.STOPPED + seen)
            _, beats_then = self.read()
            first = time.monotonic()
            while True:
                said, beats = self.read()
                causes = [f"{process_name(p, self.ranks)} failed ({s[len(failed):].decode()})"
                          for p, s in zip(self.others, said, strict=True) if s.startswith(failed)]
                if not causes and time.monotonic() - first >= SILENCE_SECONDS:
                    causes = [f"{process_name(p, self.ranks)} went silent: no word and no heartbeat for "
                              f"{SILENCE_SECONDS:g} s (it was killed, crashed or hangs)"
                              for p, s, then, now in zip(self.others, said, beats_then, beats, strict=True)
                              if not s and then == now]
                    break
                if causes:
                    break
                time.sleep(BEAT_SECONDS)
        except RuntimeError as e:  # torchrun's store did not answer: torchrun itself is gone
            reason = str(e).splitlines()[0]  # not the C++ stack that follows
            return (f"the run stopped, and its store did not answer ({reason}); "
                    "torchrun's report lists each exit")
        if not causes:
            return (f"the run stopped, and no other process failed on its own or went silent for "
                    f"{SILENCE_SECONDS:g} s; torchrun's report lists each exit")
        return "the run stopped because " + "; and ".join(causes)
